"""Egress addresses on the real relay: connections bound to 127.0.0.2 and 127.0.0.3 as ``[egress]`` says.

The next hop is a real SMTP server on 127.0.0.1 (relay_support.NextHop) that
records each message's peer address and EHLO name; the relay is the real
one, over real TCP, with its spool on disk. Warm-up caps are checked by how
many messages each address carried, and by what a restart rebuilds from the
log.
"""

from __future__ import annotations

import datetime as dt
import logging
import smtplib
from pathlib import Path

import pytest
import trio
from logfmt import events
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from spool import EventStream
from spool.format.record import Status


def _send(port: int, sender: str, rcpt: str, subject: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail(sender, [rcpt], f"Subject: {subject}\r\n\r\nbody of {subject}\r\n")


async def send(port: int, sender: str, rcpt: str, subject: str) -> None:
    await trio.to_thread.run_sync(_send, port, sender, rcpt, subject)


TODAY = dt.datetime.now(dt.UTC).date().isoformat()

SOURCES = """
[egress.sources."127.0.0.2"]
ehlo = "out2.relay.test"
[egress.sources."127.0.0.3"]
ehlo = "out3.relay.test"
"""


def source_events(spool_dir: Path) -> list[tuple[str, str]]:
    """(recipient, source) of every delivered outcome in the log, read as the event stream gives them."""
    batch = EventStream(str(spool_dir)).read()
    return [(e.fields["recipient"], e.fields.get("source", "")) for e in batch.events if e.kind == "delivered"]


async def test_routes_send_from_their_own_address_and_ehlo_name(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta.delivery")
    egress = SOURCES + """
[egress.routes]
"a.example" = "127.0.0.2"
".b.example" = "127.0.0.3"
[egress.senders]
"news.example" = "127.0.0.3"
"""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        route = f"smtp://127.0.0.1:{port}?tls=none"
        cfg = relay_config(str(tmp_path), {"*": route}, spool_extra=egress)
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "x@src.example", "r1@a.example", "one")
        await send(relay.ports[0], "x@src.example", "r2@mx.b.example", "two")
        await send(relay.ports[0], "x@src.example", "r3@elsewhere.example", "three")
        await send(relay.ports[0], "y@news.example", "r4@a.example", "four")  # the sender's rule wins
        await watch.wait_for(Status.DELIVERED, 4)
        seen = {m.recipients[0]: (m.peer, m.helo) for m in await hop.wait_messages(4)}
        assert seen == {"r1@a.example": ("127.0.0.2", "out2.relay.test"),
                        "r2@mx.b.example": ("127.0.0.3", "out3.relay.test"),
                        "r3@elsewhere.example": ("127.0.0.1", "relay.test"),  # no rule: the system's address
                        "r4@a.example": ("127.0.0.3", "out3.relay.test")}
        nursery.cancel_scope.cancel()
    assert sorted(source_events(tmp_path / "spool")) == [
        ("r1@a.example", "127.0.0.2"), ("r2@mx.b.example", "127.0.0.3"), ("r3@elsewhere.example", ""),
        ("r4@a.example", "127.0.0.3")]
    lines = {e["to"]: e.get("source") for e in events(caplog.records, "delivery")}
    assert lines == {"<r1@a.example>": "127.0.0.2", "<r2@mx.b.example>": "127.0.0.3",
                     "<r3@elsewhere.example>": None, "<r4@a.example>": "127.0.0.3"}


async def test_a_warming_address_takes_its_cap_and_the_pool_takes_the_rest(tmp_path: Path) -> None:
    egress = SOURCES + f"""warmup_start = "{TODAY}"
warmup = [[1, 2], [2, 10]]
[egress.pools]
warm = {{ "127.0.0.2" = 1, "127.0.0.3" = 1 }}
[egress.routes]
"*" = "warm"
"""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=none"}, spool_extra=egress)
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        for i in range(8):
            await send(relay.ports[0], "x@src.example", f"r{i}@far.example", f"m{i}")
        await watch.wait_for(Status.DELIVERED, 8)
        peers = [m.peer for m in await hop.wait_messages(8)]
        assert peers.count("127.0.0.3") == 2 and peers.count("127.0.0.2") == 6
        assert relay.scheduler.egress.counts == {"127.0.0.2": 6, "127.0.0.3": 2}
        nursery.cancel_scope.cancel()


async def test_mail_waits_when_its_only_address_is_at_its_cap_and_a_restart_keeps_the_count(
        tmp_path: Path) -> None:
    egress = SOURCES + f"""warmup_start = "{TODAY}"
warmup = [[1, 1]]
[egress.routes]
"*" = "127.0.0.3"
"""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=none"}, spool_extra=egress)
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "x@src.example", "first@far.example", "first")
        await watch.wait_for(Status.DELIVERED, 1)
        await send(relay.ports[0], "x@src.example", "second@far.example", "second")
        (waiting, *_) = await watch.wait_for(Status.DEFERRED, 1, recipient="second@far.example")
        assert waiting.enhanced == "4.4.5" and "warm-up cap" in waiting.reply
        assert [m.peer for m in hop.messages] == ["127.0.0.3"]
        nursery.cancel_scope.cancel()
    relay.aspool.core.close()  # what the process's end would release: its descriptors and the spool's lock
    async with trio.open_nursery() as nursery:  # a restart: the day's count comes back from the log
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=none"}, spool_extra=egress)
        relay = await start_relay(nursery, cfg)
        assert relay.scheduler.egress.counts == {"127.0.0.3": 1}
        watch = DeliveryWatch(relay)
        (again, *_) = await watch.wait_for(Status.DEFERRED, 1, recipient="second@far.example")
        assert "warm-up cap" in again.reply and hop.messages == []
        nursery.cancel_scope.cancel()


async def test_a_connection_that_reached_no_hop_does_not_count(tmp_path: Path) -> None:
    egress = SOURCES + f"""warmup_start = "{TODAY}"
warmup = [[1, 5]]
[egress.routes]
"*" = "127.0.0.3"
"""
    with trio.socket.socket() as s:  # a port nobody listens on: every connection is refused
        await s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    async with trio.open_nursery() as nursery:
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{dead}?tls=none"}, spool_extra=egress)
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "x@src.example", "r@far.example", "refused")
        (deferred, *_) = await watch.wait_for(Status.DEFERRED, 1)
        assert deferred.code == 0 and "connection refused" in deferred.reply
        assert relay.scheduler.egress.counts.get("127.0.0.3", 0) == 0
        nursery.cancel_scope.cancel()
