"""MX routing end to end: the relay asks a DNS server started by the test, then delivers to real next hops.

Every next hop of a test listens on the same port (``[delivery] mx_port``)
at a different loopback address, so the DNS answers alone decide where the
mail goes. 127.0.0.2 is a host that is down: nothing listens there.
"""

from __future__ import annotations

import email
import functools
import os
import smtplib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
from dns_server import DnsServer
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.process.relay import Relay
from spool.format.record import Status

DEAD = "127.0.0.2"


class BoundNextHop(NextHop):
    """A NextHop on a chosen address and port."""

    async def start_on(self, nursery: trio.Nursery, host: str, port: int) -> int:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._handle, port, host=host))
        self.port = int(listeners[0].socket.getsockname()[1])
        return self.port


@attrs.define
class World:
    dns: DnsServer
    relay: Relay
    watch: DeliveryWatch
    hops: dict[str, BoundNextHop]
    port: int
    nursery: trio.Nursery


@asynccontextmanager
async def mx_world(tmp_path: Path, addresses: tuple[str, ...] = ("127.0.0.1",)) -> AsyncIterator[World]:
    """A DNS server, next hops on ``addresses`` (same port each), and a relay routing "*" by MX."""
    async with trio.open_nursery() as nursery:
        dns = DnsServer()
        dns_port = await nursery.start(dns.serve)
        hops: dict[str, BoundNextHop] = {}
        port = 0
        for address in addresses:
            hop = BoundNextHop()
            port = await hop.start_on(nursery, address, port)
            hops[address] = hop
        extra = f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\nconnect_timeout = "10s"\n'
        cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": "mx"}, extra=extra)
        relay = await start_relay(nursery, cfg)
        yield World(dns, relay, DeliveryWatch(relay), hops, port, nursery)
        nursery.cancel_scope.cancel()


def _send(port: int, sender: str, rcpts: list[str], body: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail(sender, rcpts, body)


async def send(w: World, rcpt: str, subject: str, sender: str = "alice@localhost") -> None:
    await trio.to_thread.run_sync(_send, w.relay.ports[0], sender, [rcpt], f"Subject: {subject}\r\n\r\nbody\r\n")


async def test_mx_preference_order_and_a_dead_preferred_host(tmp_path: Path) -> None:
    async with mx_world(tmp_path, ("127.0.0.1", "127.0.0.3")) as w:
        # dest.test: the most preferred host (10) is down, so the 20 gets it and the 30 never does.
        w.dns.mx("dest.test", 30, "mx3.dest.test")
        w.dns.mx("dest.test", 10, "mx1.dest.test")
        w.dns.mx("dest.test", 20, "mx2.dest.test")
        w.dns.a("mx1.dest.test", DEAD)
        w.dns.a("mx2.dest.test", "127.0.0.1")
        w.dns.a("mx3.dest.test", "127.0.0.3")
        # up.test: both hosts are up, so the most preferred one gets the mail.
        w.dns.mx("up.test", 20, "second.up.test")
        w.dns.mx("up.test", 10, "first.up.test")
        w.dns.a("first.up.test", "127.0.0.3")
        w.dns.a("second.up.test", "127.0.0.1")

        await send(w, "bob@dest.test", "to dest")
        (msg,) = await w.hops["127.0.0.1"].wait_messages(1)
        assert msg.recipients == ["bob@dest.test"] and b"Subject: to dest" in msg.data
        (out,) = await w.watch.wait_for(Status.DELIVERED, 1, recipient="bob@dest.test")
        assert out.next_hop.startswith(f"mx2.dest.test[127.0.0.1]:{w.port}")
        assert w.hops["127.0.0.3"].messages == []
        assert ("dest.test", "MX") in w.dns.queries

        await send(w, "carol@up.test", "to up")
        (msg,) = await w.hops["127.0.0.3"].wait_messages(1)
        assert msg.recipients == ["carol@up.test"]
        (out,) = await w.watch.wait_for(Status.DELIVERED, 1, recipient="carol@up.test")
        assert out.next_hop.startswith(f"first.up.test[127.0.0.3]:{w.port}")
        assert len(w.hops["127.0.0.1"].messages) == 1


async def test_no_mx_falls_back_to_the_domains_own_a_and_aaaa(tmp_path: Path) -> None:
    async with mx_world(tmp_path, ("127.0.0.1", "::1")) as w:
        w.dns.a("bare.test", "127.0.0.1")
        w.dns.aaaa("six.test", "::1")

        await send(w, "dave@bare.test", "implicit mx")
        (msg,) = await w.hops["127.0.0.1"].wait_messages(1)
        assert msg.recipients == ["dave@bare.test"]
        (out,) = await w.watch.wait_for(Status.DELIVERED, 1, recipient="dave@bare.test")
        assert out.next_hop.startswith(f"bare.test[127.0.0.1]:{w.port}")

        await send(w, "erin@six.test", "implicit mx over v6")
        (msg,) = await w.hops["::1"].wait_messages(1)
        assert msg.recipients == ["erin@six.test"]
        (out,) = await w.watch.wait_for(Status.DELIVERED, 1, recipient="erin@six.test")
        assert out.next_hop.startswith(f"six.test[::1]:{w.port}")
        assert ("bare.test", "MX") in w.dns.queries and ("bare.test", "A") in w.dns.queries


async def test_nxdomain_bounces_and_the_dsn_reaches_the_sender(tmp_path: Path) -> None:
    async with mx_world(tmp_path) as w:
        await send(w, "ghost@nowhere.test", "lost")
        (out,) = await w.watch.wait_for(Status.BOUNCED, 1, recipient="ghost@nowhere.test")
        assert (out.code, out.enhanced) == (550, "5.1.2")
        assert "does not exist" in out.reply
        await w.watch.wait_for(Status.DELIVERED, 1, recipient="alice@localhost")
        box = tmp_path / "maildir" / "alice" / "new"
        (name,) = os.listdir(box)
        dsn = email.message_from_bytes((box / name).read_bytes())
        assert dsn.get_content_type() == "multipart/report"
        status = next(p for p in dsn.walk() if p.get_content_type() == "message/delivery-status").as_string()
        assert "rfc822;ghost@nowhere.test" in status.replace(" ", "") and "5.1.2" in status
        assert w.hops["127.0.0.1"].messages == []


async def test_servfail_defers_and_the_mail_goes_once_dns_answers(tmp_path: Path) -> None:
    async with mx_world(tmp_path) as w:
        w.dns.mx("flaky.test", 10, "mx.flaky.test")
        w.dns.a("mx.flaky.test", "127.0.0.1")
        w.dns.servfail("flaky.test")
        await send(w, "fred@flaky.test", "retry after servfail")
        deferred = await w.watch.wait_for(Status.DEFERRED, 1, recipient="fred@flaky.test")
        assert (deferred[0].code, deferred[0].enhanced) == (0, "4.4.3")
        assert "DNS lookup for flaky.test failed" in deferred[0].reply
        assert w.watch.count(Status.BOUNCED) == 0
        w.dns.heal("flaky.test")
        (out,) = await w.watch.wait_for(Status.DELIVERED, 1, recipient="fred@flaky.test")
        assert out.next_hop.startswith("mx.flaky.test[127.0.0.1]")
        (msg,) = await w.hops["127.0.0.1"].wait_messages(1)
        assert b"retry after servfail" in msg.data


@pytest.mark.slow
async def test_a_dns_timeout_defers(tmp_path: Path) -> None:
    async with mx_world(tmp_path) as w:
        w.dns.drop("silent.test")
        await send(w, "gina@silent.test", "no answer")
        deferred = await w.watch.wait_for(Status.DEFERRED, 1, recipient="gina@silent.test", timeout=90)
        assert (deferred[0].code, deferred[0].enhanced) == (0, "4.4.3")
        assert "DNS lookup for silent.test failed" in deferred[0].reply
        assert w.watch.count(Status.BOUNCED) == 0
        assert ("silent.test", "MX") in w.dns.queries
