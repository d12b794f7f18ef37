"""The SMTP transport's connection cache: idle connections to a next hop carry the next batch.

Real TCP on 127.0.0.1 against the tests' next hop (relay_support.NextHop),
which counts connections made and ended. Every wait is on an event or a
count, bounded in time.
"""

from __future__ import annotations

import gc
import os
import resource
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
import trustme
from relay_support import NextHop, relay_config, server_context

from mta.delivery.smtp_transport import SmtpTransport
from mta.delivery.transport import Destination, Job
from spool.format.record import Status


def job(n: int) -> Job:
    body = [b"Subject: message %d\r\n\r\nbody %d\r\n" % (n, n)]
    return Job(f"Q{n}", "a@src.example", (f"r{n}@far.example",), body, len(body[0]))


@asynccontextmanager
async def transport_to_hop(tmp_path: Path, delivery: str, *,
                           keeper: bool = True) -> AsyncIterator[tuple[SmtpTransport, Destination, NextHop]]:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        config = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=none"},
                              extra=f"[delivery]\n{delivery}\n")
        transport = SmtpTransport(config)
        if keeper:
            await nursery.start(transport.run)
        yield transport, Destination("smtp", f"127.0.0.1:{port}", "none"), hop
        nursery.cancel_scope.cancel()


async def delivered(transport: SmtpTransport, dest: Destination, n: int) -> bool:
    (outcomes,) = await transport.deliver(dest, [job(n)])
    return [o.status for o in outcomes] == [Status.DELIVERED]


async def test_batches_to_one_hop_share_a_connection_while_it_is_cached(tmp_path: Path) -> None:
    async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"') as (transport, dest, hop):
        for n in range(3):
            assert await delivered(transport, dest, n)
        assert hop.connections == 1 and hop.closed == 0
        assert transport.cache.reused == 2 and len(transport.cache) == 1
        assert [m.recipients for m in hop.messages] == [["r0@far.example"], ["r1@far.example"], ["r2@far.example"]]


async def test_a_cached_connection_the_hop_has_closed_is_replaced_without_a_failure(tmp_path: Path) -> None:
    async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"') as (transport, dest, hop):
        hop.hang_up_after_message = True
        assert await delivered(transport, dest, 0)
        await hop.wait_closed(1, timeout=30)  # the cache still holds the connection, dead on the far side
        assert len(transport.cache) == 1
        assert await delivered(transport, dest, 1)
        assert hop.connections == 2 and transport.cache.reused == 0
        assert len(hop.messages) == 2


async def test_an_idle_connection_is_closed_after_the_cache_time(tmp_path: Path) -> None:
    async with transport_to_hop(tmp_path, 'connection_cache_time = "200ms"') as (transport, dest, hop):
        assert await delivered(transport, dest, 0)
        assert len(transport.cache) == 1
        await hop.wait_closed(1, timeout=30)
        assert len(transport.cache) == 0
        assert await delivered(transport, dest, 1)
        assert hop.connections == 2


async def test_time_zero_or_no_keeper_means_a_connection_per_batch(tmp_path: Path) -> None:
    async with transport_to_hop(tmp_path, "connection_cache_time = 0") as (transport, dest, hop):
        assert await delivered(transport, dest, 0) and await delivered(transport, dest, 1)
        await hop.wait_closed(2, timeout=30)
        assert hop.connections == 2 and len(transport.cache) == 0
    async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"', keeper=False) as (transport, dest, hop):
        assert await delivered(transport, dest, 0) and await delivered(transport, dest, 1)
        await hop.wait_closed(2, timeout=30)
        assert hop.connections == 2


async def test_a_connection_that_carried_max_messages_is_not_kept(tmp_path: Path) -> None:
    delivery = 'connection_cache_time = "60s"\nmax_messages_per_connection = 2'
    async with transport_to_hop(tmp_path, delivery) as (transport, dest, hop):
        results = await transport.deliver(dest, [job(0), job(1)])
        assert all(o.status is Status.DELIVERED for outs in results for o in outs)
        await hop.wait_closed(1, timeout=30)
        assert len(transport.cache) == 0
        assert await delivered(transport, dest, 2)
        assert hop.connections == 2 and len(transport.cache) == 1


async def test_a_connection_reused_within_probe_after_goes_straight_to_mail(tmp_path: Path) -> None:
    async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"') as (transport, dest, hop):
        transport.cache.probe_after = 60.0  # however slow the machine, the second batch comes sooner
        assert await delivered(transport, dest, 0) and await delivered(transport, dest, 1)
        assert hop.connections == 1 and hop.rsets == 0
        assert (transport.cache.reused, transport.cache.probed) == (1, 0)


async def test_a_connection_idle_past_probe_after_is_checked_with_rset(tmp_path: Path) -> None:
    async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"') as (transport, dest, hop):
        transport.cache.probe_after = 0.0  # every reuse counts as idle long enough
        assert await delivered(transport, dest, 0) and await delivered(transport, dest, 1)
        assert hop.connections == 1 and hop.rsets == 1
        assert (transport.cache.reused, transport.cache.probed) == (1, 1)


async def test_a_reused_connection_that_dies_at_its_first_mail_is_replaced_and_the_message_delivered(
        tmp_path: Path) -> None:
    for how in ("eof", "421"):
        async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"') as (transport, dest, hop):
            transport.cache.probe_after = 60.0
            assert await delivered(transport, dest, 0)
            hop.drop_reused = how  # the hop closes it as the next MAIL arrives: too late for peer_spoke()
            assert await delivered(transport, dest, 1), how
            assert hop.connections == 2 and transport.cache.stale == 1, how
            assert [m.recipients for m in hop.messages] == [["r0@far.example"], ["r1@far.example"]], how


async def test_a_reused_connection_the_hop_closed_while_idle_is_not_sent_mail(tmp_path: Path) -> None:
    async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"') as (transport, dest, hop):
        transport.cache.probe_after = 60.0
        hop.hang_up_after_message = True
        assert await delivered(transport, dest, 0)
        await hop.wait_closed(1, timeout=30)
        assert await delivered(transport, dest, 1)
        # Seen closed before anything was sent on it: neither reused nor stale, and no RSET was needed.
        assert (transport.cache.reused, transport.cache.stale, hop.rsets) == (0, 0, 0)
        assert hop.connections == 2 and len(hop.messages) == 2


async def test_a_hop_that_stalls_mid_transaction_is_cut_at_its_deadline(tmp_path: Path) -> None:
    timeouts = 'command_timeout = "1s"\ndata_timeout = "1s"\nconnection_cache_time = "60s"'
    for stall, stage in (("rcpt", "sending the envelope"), ("end of data", "waiting for the reply to the end of data")):
        async with transport_to_hop(tmp_path, timeouts) as (transport, dest, hop):
            transport.cache.probe_after = 60.0
            assert await delivered(transport, dest, 0)
            hop.stall_at = stall  # on the reused connection: a stall is a timeout, not a stale connection
            with trio.fail_after(30):
                (outcomes,) = await transport.deliver(dest, [job(1)])
            assert [(o.status, o.code) for o in outcomes] == [(Status.DEFERRED, 0)], stall
            assert f"timed out while {stage}" in outcomes[0].reply, (stall, outcomes[0].reply)
            assert transport.cache.stale == 0 and len(transport.cache) == 0, stall


async def test_a_tls_connection_is_reused_without_rset_and_its_mail_stays_encrypted(tmp_path: Path) -> None:
    """Nothing the TLS layer leaves unread (session tickets come before the EHLO reply) makes it look closed."""
    async with trio.open_nursery() as nursery:
        hop = NextHop(ssl_context=server_context(trustme.CA().issue_cert("nexthop.test")))
        port = await hop.start(nursery)
        config = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=opportunistic"},
                              extra='[delivery]\nconnection_cache_time = "60s"\n')
        transport = SmtpTransport(config)
        await nursery.start(transport.run)
        transport.cache.probe_after = 60.0
        dest = Destination("smtp", f"127.0.0.1:{port}", "opportunistic")
        for n in range(3):
            assert await delivered(transport, dest, n)
        assert hop.connections == 1 and hop.rsets == 0
        assert (transport.cache.reused, transport.cache.probed, transport.cache.stale) == (2, 0, 0)
        assert [m.tls for m in hop.messages] == [True, True, True]
        nursery.cancel_scope.cancel()


async def test_a_connection_on_a_descriptor_above_1023_is_still_reused(tmp_path: Path) -> None:
    """The idle check polls the socket: select() cannot watch a descriptor past 1023 (a busy relay's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1200
    if soft < need:
        assert hard >= need, "the test needs 1,200 open files"  # never skipped: it fails where it cannot run
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    # Every descriptor below 1,100 taken: the hop's socket gets one above 1023. Garbage from earlier tests is
    # collected first and no collection runs meanwhile, so no descriptor below is freed under the test.
    gc.collect()
    gc.disable()
    filler = [os.open(os.devnull, os.O_RDONLY)]
    while filler[-1] < 1100:
        filler.append(os.open(os.devnull, os.O_RDONLY))
    try:
        async with transport_to_hop(tmp_path, 'connection_cache_time = "60s"') as (transport, dest, hop):
            transport.cache.probe_after = 60.0
            assert await delivered(transport, dest, 0)
            (cached,) = [s for waiting in transport.cache._idle.values() for _, s in waiting]
            assert isinstance(cached.stream, trio.SocketStream) and cached.stream.socket.fileno() > 1023
            assert await delivered(transport, dest, 1)
            assert hop.connections == 1 and (transport.cache.reused, transport.cache.stale) == (1, 0)
    finally:
        for fd in filler:
            os.close(fd)
        gc.enable()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
