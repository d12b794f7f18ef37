"""The relay behind Debian's haproxy (``[proxy]``): the PROXY header's client is the session's peer.

haproxy runs in TCP mode with two frontends, one passing connections with
``send-proxy`` (v1), the other with ``send-proxy-v2``; it connects to the
relay from 127.0.0.1 for every client. The clients bind 127.0.0.2, .3 and .4
as their source addresses. What would see the balancer if the header were
ignored is checked against the real address: ``mynetworks`` (only .2 is in
it), the per-client session limit (1), the ``Received:`` header, the log.
A connection from an address that is no configured balancer, and one with
no header, are closed before the banner.
"""

from __future__ import annotations

import email
import email.policy
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
from haproxy_support import haproxy, have_haproxy
from logfmt import events
from relay_support import DeliveryWatch, NextHop, RawClient, relay_config, start_relay

from mta.process.relay import Relay
from spool.format.record import Status

assert have_haproxy(), "haproxy is needed (make sysdeps installs it)"

EXTRA = """max_sessions_per_client = 1
metrics_listen = "127.0.0.1:0"
[relay]
mynetworks = ["127.0.0.2/32"]
[proxy]
listen = ["127.0.0.1:0"]
balancers = ["127.0.0.1/32"]
header_timeout = "1s"
"""


@attrs.frozen
class Stack:
    relay: Relay
    hop: NextHop
    ports: dict[str, int]  # haproxy's frontends: "v1", "v2"
    proxied: int  # the relay's own [proxy] listen port
    tmp: Path


@pytest.fixture
async def stack(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Stack]:
    hop = NextHop()
    hop_port = await hop.start(nursery)
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{hop_port}"},
                       extra=EXTRA)
    relay = await start_relay(nursery, cfg)
    assert relay.server is not None
    proxied = int(relay.server.proxy_listeners[0].socket.getsockname()[1])
    async with haproxy(tmp_path / "haproxy", {"v1": (proxied, "send-proxy"), "v2": (proxied, "send-proxy-v2")}) \
            as ports:
        yield Stack(relay, hop, ports, proxied, tmp_path)


async def transaction(port: int, source: str, rcpt: str) -> list[bytes]:
    """One message from ``source`` through haproxy's ``port``; the replies to RCPT and the end of data."""
    client = await RawClient.connect(port, source)
    try:
        assert await client.code() == 220
        await client.command(b"EHLO client.test")
        (mail,) = await client.command(b"MAIL FROM:<sender@client.test>")
        assert mail.startswith(b"250"), mail
        (rcpt_reply,) = await client.command(b"RCPT TO:<" + rcpt.encode() + b">")
        if not rcpt_reply.startswith(b"250"):
            return [rcpt_reply]
        assert (await client.command(b"DATA"))[0].startswith(b"354")
        (done,) = await client.command(b"Subject: via haproxy\r\n\r\nbody\r\n.")
        await client.command(b"QUIT")
        return [rcpt_reply, done]
    finally:
        await client.aclose()


def received_of(data: bytes) -> str:
    return str(email.message_from_bytes(data, policy=email.policy.default)["Received"])


async def test_behind_haproxy_v1_and_v2_relay_control_and_received_see_the_real_client(
        stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta")
    watch = DeliveryWatch(stack.relay)
    # 127.0.0.2 is in mynetworks: it may relay; through v1.
    replies = await transaction(stack.ports["v1"], "127.0.0.2", "bob@far.example")
    assert replies[1].startswith(b"250 2.0.0 Ok: queued"), replies
    (msg,) = await stack.hop.wait_messages(1)
    assert "[127.0.0.2]" in received_of(msg.data) and "127.0.0.1]" not in received_of(msg.data)
    # 127.0.0.3 is not (the balancer, 127.0.0.1, would be in the default mynetworks): refused; through v2.
    (denied,) = await transaction(stack.ports["v2"], "127.0.0.3", "carol@far.example")
    assert denied.startswith(b"554 5.7.1"), denied
    replies = await transaction(stack.ports["v2"], "127.0.0.3", "alice@localhost")
    assert replies[1].startswith(b"250 2.0.0"), replies
    await watch.wait_for(Status.DELIVERED, 1, recipient="alice@localhost")
    (name,) = list((stack.tmp / "maildir" / "alice" / "new").iterdir())
    assert "[127.0.0.3]" in received_of(name.read_bytes())
    lines = [r.getMessage() for r in caplog.records]
    proxied = list(events([r for r in caplog.records if r.name == "mta.smtpd"], "proxy"))
    assert {(e["client"], e["version"]) for e in proxied} >= {("127.0.0.2", "1"), ("127.0.0.3", "2")}, proxied
    assert all(e["balancer"] == "127.0.0.1" and e["client_port"].isdigit() for e in proxied)
    accepted = events([r for r in caplog.records if r.name == "mta.smtpd"], "accepted")
    assert {e["client"] for e in accepted} == {"127.0.0.2", "127.0.0.3"}, lines
    rejected = [e for e in events([r for r in caplog.records if r.name == "mta.smtpd"], "reject")
                if e.get("reason") == "relay"]
    assert [e["client"] for e in rejected] == ["127.0.0.3"]


async def test_the_per_client_session_limit_counts_the_real_client_not_the_balancer(stack: Stack) -> None:
    first = await RawClient.connect(stack.ports["v2"], "127.0.0.3")
    assert await first.code() == 220
    second = await RawClient.connect(stack.ports["v1"], "127.0.0.3")  # the same client through the other frontend
    (refused,) = await second.reply()
    assert refused.startswith(b"421 4.7.0"), refused
    other = await RawClient.connect(stack.ports["v2"], "127.0.0.4")  # another client: its own limit
    assert await other.code() == 220
    for client in (first, second, other):
        await client.aclose()


async def test_a_header_from_an_unconfigured_address_or_no_header_gets_no_banner(
        stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta")
    forged = await RawClient.connect(stack.proxied, "127.0.0.5")  # not in [proxy] balancers
    await forged.send(b"PROXY TCP4 10.9.9.9 127.0.0.1 1234 25\r\n")
    assert await forged.closed() == b""
    bare = await RawClient.connect(stack.proxied, "127.0.0.1")  # a balancer's address, but SMTP at once
    await bare.send(b"EHLO client.test\r\n")
    assert await bare.closed() == b""
    silent = await RawClient.connect(stack.proxied, "127.0.0.1")  # nothing: closed after header_timeout
    assert await silent.closed(timeout=10) == b""
    reasons = [(e["client"], e["reason"]) for e in events([r for r in caplog.records if r.name == "mta.smtpd"],
                                                          "reject") if e.get("command") == "PROXY"]
    assert reasons == [("127.0.0.5", "proxy_untrusted"), ("127.0.0.1", "proxy_header"),
                       ("127.0.0.1", "proxy_timeout")], reasons
    for client in (forged, bare, silent):
        await client.aclose()
    # The direct listener is untouched by [proxy]: a client there is its own address, and a PROXY line is SMTP.
    direct = await RawClient.connect(stack.relay.ports[0], "127.0.0.2")
    assert await direct.code() == 220
    (reply,) = await direct.command(b"PROXY TCP4 10.9.9.9 127.0.0.1 1234 25")
    assert reply.startswith(b"5"), reply
    await direct.aclose()


async def http_get(port: int, path: str) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
        out = b""
        with trio.fail_after(10):
            while data := await stream.receive_some(4096):
                out += data
        return out
    finally:
        await stream.aclose()


async def test_readiness_turns_503_as_soon_as_a_drain_starts(stack: Stack) -> None:
    port = int(stack.relay.metrics_listeners[0].socket.getsockname()[1])
    ready = await http_get(port, "/ready")
    assert ready.startswith(b"HTTP/1.1 200 OK\r\n") and ready.endswith(b"\r\n\r\nready\n"), ready
    assert (await http_get(port, "/metrics")).startswith(b"HTTP/1.1 200")
    assert stack.relay.server is not None
    stack.relay.server.drain()  # what SIGTERM's drain does first (mta.process.lifecycle.Lifecycle.drain)
    draining = await http_get(port, "/ready")
    assert draining.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and draining.endswith(b"draining\n")
    late = await RawClient.connect(stack.ports["v2"], "127.0.0.3")  # through the balancer anyway: told, as direct
    (reply,) = await late.reply()
    assert reply.startswith(b"421 4.3.2"), reply
    await late.aclose()
