"""Slow clients and many clients against the real relay over TCP (docs/security.md, "Denial of service").

Each test runs a relay in this process with small limits set in its config,
drives it with raw sockets (or smtplib) on 127.0.0.0/8, and ends by proving
that a fresh client still gets ``220`` and has a message delivered.

Time: the relay's spool commits in worker threads, so trio's MockClock
(``autojump_clock``) cannot be used: it jumps virtual time forward while an
fdatasync runs and fires every deadline in the process at once. The tests use
real deadlines of about a second and trickle far past them (five to ten times
as long); a trickling client paces its bytes by waiting up to ``gap`` for the
server's reply, so nothing asserts how long anything took, only the order of
events: the ``421`` comes before the client has sent everything.
"""

from __future__ import annotations

import smtplib
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from prometheus_client.metrics_core import Metric
from relay_support import DeliveryWatch, RawClient, relay_config, start_relay

from mta.config import Config, parse_config
from mta.process.relay import Relay
from spool.format.record import Status

LOCAL = {"localhost": "maildir:maildir", "*": "discard"}
OUTSIDERS = '[relay]\nmynetworks = ["10.0.0.0/8"]\n'  # 127.0.0.0/8 is not trusted: every test client is an outsider


def _config(tmp_path: Path, server: str, relay: str = "") -> Config:
    return relay_config(str(tmp_path), LOCAL, extra=server + "\n" + relay)


def _accepted(relay: Relay) -> float:
    return relay.metrics.registry.get_sample_value("logspool_accepted_messages_total") or 0.0


async def _fresh_client_is_served(relay: Relay, watch: DeliveryWatch, tmp_path: Path, n: int,
                                  source: str = "127.0.0.1", port: int | None = None) -> None:
    """A new connection gets 220 (smtplib insists) and its message becomes the n-th delivered, in the Maildir."""
    subject = f"fresh {n}"

    def send() -> None:
        with smtplib.SMTP("127.0.0.1", port or relay.ports[0], timeout=30, source_address=(source, 0)) as s:
            s.sendmail("a@example.org", ["x@localhost"], f"Subject: {subject}\r\n\r\nok\r\n")

    await trio.to_thread.run_sync(send)
    await watch.wait_for(Status.DELIVERED, n)
    bodies = [p.read_bytes() for p in (tmp_path / "maildir" / "x" / "new").iterdir()]
    assert sum(f"Subject: {subject}".encode() in b for b in bodies) == 1
    assert len(bodies) == n


async def _trickle(c: RawClient, data: bytes, gap: float) -> tuple[list[bytes] | None, int]:
    """Send ``data`` one byte at a time, waiting up to ``gap`` for a reply after each.

    Returns the reply that came (None if none did) and how many bytes had been sent by then.
    """
    for i in range(len(data)):
        await c.send(data[i : i + 1])
        with trio.move_on_after(gap):
            return await c.reply(), i + 1
    return None, len(data)


async def _hang_up(c: RawClient) -> None:
    """Half-close and wait for the server to close too: by then it has given the session's slot back."""
    assert isinstance(c.stream, trio.SocketStream)
    await c.stream.send_eof()
    await c.closed()
    await c.aclose()


# ---------------------------------------------------------------- deadlines


@pytest.mark.slow
async def test_a_command_trickled_byte_by_byte_gets_421_at_the_command_deadline(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, _config(tmp_path, 'command_timeout = "1s"'))
        watch = DeliveryWatch(relay)
        for preamble in (b"", b"EHLO c.example\r\n"):  # the first command, and one later in the session
            c = await RawClient.connect(relay.ports[0])
            assert await c.code() == 220
            if preamble:
                assert (await c.command(preamble.rstrip()))[-1].startswith(b"250")
            # A byte every 50 ms: each read comes long before any per-read timeout of 1 s would fire.
            line = b"MAIL FROM:<" + b"a" * 180 + b"@example.org>\r\n"
            reply, sent = await _trickle(c, line, gap=0.05)
            assert reply is not None and reply[0].startswith(b"421 4.4.2"), reply
            assert sent < len(line)
            assert await c.closed() == b""
        await _fresh_client_is_served(relay, watch, tmp_path, 1)
        nursery.cancel_scope.cancel()


async def test_a_data_phase_trickled_past_its_deadline_gets_421_and_nothing_is_queued(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 'data_timeout = "1s"\nmin_data_rate = 100')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.send(b"EHLO c.example\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<x@localhost>\r\nDATA\r\n")
        assert [(await c.reply())[-1][:3] for _ in range(4)] == [b"250", b"250", b"250", b"354"]
        # 20 bytes/s, a fifth of min_data_rate, in reads 50 ms apart (per-read timeouts of 1 s never fire);
        # the whole message would take 10 s to arrive, ten times data_timeout.
        message = b"Subject: trickled\r\n\r\n" + b"slow " * 34 + b"\r\n.\r\n"
        reply, sent = await _trickle(c, message, gap=0.05)
        assert reply is not None and reply[0].startswith(b"421 4.4.2"), reply
        assert sent < len(message)
        assert await c.closed() == b""
        assert _accepted(relay) == 0  # the half-received message was dropped, never queued
        await _fresh_client_is_served(relay, watch, tmp_path, 1)
        assert _accepted(relay) == 1
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_slow_but_steady_data_phase_longer_than_data_timeout_is_accepted(tmp_path: Path) -> None:
    # The scaled-down slow link: 20 kB/s against a minimum of 1 kB/s, for 3 s against data_timeout = 2 s.
    cfg = _config(tmp_path, 'data_timeout = "2s"\nmin_data_rate = 1000')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.send(b"EHLO c.example\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<x@localhost>\r\nDATA\r\n")
        assert [(await c.reply())[-1][:3] for _ in range(4)] == [b"250", b"250", b"250", b"354"]
        await c.send(b"Subject: slow link\r\n\r\n")
        for _ in range(60):
            await c.send(b"y" * 98 + b"\r\n" + b"z" * 898 + b"\r\n")  # 1000 bytes
            with trio.move_on_after(0.05):
                raise AssertionError(f"the relay spoke during DATA: {await c.reply()!r}")
        assert (await c.command(b"."))[0].startswith(b"250 2.0.0")
        await watch.wait_for(Status.DELIVERED, 1)
        await c.aclose()
        await _fresh_client_is_served(relay, watch, tmp_path, 2)
        nursery.cancel_scope.cancel()


async def test_no_new_command_is_taken_after_the_session_time_limit(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, _config(tmp_path, 'session_time_limit = "1s"'))
        watch = DeliveryWatch(relay)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        replies = []
        for _ in range(200):  # a busy client (a NOOP every 50 ms) is not an idle one, and still ends
            await c.send(b"NOOP\r\n")
            replies.append((await c.reply())[0])
            if not replies[-1].startswith(b"250"):
                break
            with trio.move_on_after(0.05):
                replies.append((await c.reply())[0])
                break
        assert replies[-1].startswith(b"421 4.4.2") and len(replies) > 2, replies[-3:]
        await c.closed()
        await _fresh_client_is_served(relay, watch, tmp_path, 1)
        nursery.cancel_scope.cancel()


async def test_a_client_that_never_reads_its_replies_is_cut_at_the_command_deadline(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, _config(tmp_path, 'command_timeout = "1s"'))
        watch = DeliveryWatch(relay)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()

        async def flood() -> None:  # pipelined NOOPs, their replies never read: both sides' buffers fill up
            while True:
                await c.send(b"NOOP\r\n" * 10000)

        def timeouts() -> float:
            value = relay.metrics.registry.get_sample_value("logspool_smtp_timeouts_total", {"phase": "command"})
            return value or 0.0

        async with trio.open_nursery() as flooding:
            flooding.start_soon(flood)
            with trio.fail_after(30):
                while not timeouts():  # the relay gave up on writing to it
                    await trio.sleep(0.01)
            flooding.cancel_scope.cancel()
        await c.closed()
        await c.aclose()
        await _fresh_client_is_served(relay, watch, tmp_path, 1)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- session slots


async def _hold(c: RawClient) -> None:
    """Trickle a command that never ends (a byte every 200 ms) until cancelled."""
    while True:
        await c.send(b"x")
        await trio.sleep(0.2)


async def test_trickling_outsiders_cannot_take_the_slots_kept_for_mynetworks(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 'max_sessions = 8\nreserved_sessions = 2\ncommand_timeout = "60s"\n'
                  "max_sessions_per_client = 10\nmax_sessions_per_network = 10",
                  '[relay]\nmynetworks = ["127.0.0.1/32"]\n')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        port = relay.ports[0]
        async with trio.open_nursery() as holders:
            outsiders = []
            for i in range(6):  # every slot outsiders may have
                c = await RawClient.connect(port, f"127.0.0.{2 + i}")
                assert await c.code() == 220
                outsiders.append(c)
                holders.start_soon(_hold, c)
            late = await RawClient.connect(port, "127.0.0.20")
            assert (await late.reply())[0].startswith(b"421 4.7.0")
            assert await late.closed() == b""
            # The relay's own client still gets in, and its mail goes through, while the trickle goes on.
            await _fresh_client_is_served(relay, watch, tmp_path, 1, source="127.0.0.1")
            trusted = [await RawClient.connect(port, "127.0.0.1") for _ in range(2)]
            assert [await t.code() for t in trusted] == [220, 220]
            full = await RawClient.connect(port, "127.0.0.1")
            assert (await full.reply())[0].startswith(b"421 4.7.0")  # reserved is not unlimited: 8 in all
            holders.cancel_scope.cancel()
        for c in [*outsiders, *trusted]:
            await _hang_up(c)
        await _fresh_client_is_served(relay, watch, tmp_path, 2, source="127.0.0.30")
        nursery.cancel_scope.cancel()


async def test_sessions_per_address_and_per_24_are_limited_and_free_up(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "max_sessions_per_client = 1\nmax_sessions_per_network = 2", OUTSIDERS)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        port = relay.ports[0]
        first = await RawClient.connect(port, "127.0.0.2")
        assert await first.code() == 220
        same_address = await RawClient.connect(port, "127.0.0.2")
        assert (await same_address.reply())[0].startswith(b"421 4.7.0")
        neighbour = await RawClient.connect(port, "127.0.0.3")
        assert await neighbour.code() == 220
        same_24 = await RawClient.connect(port, "127.0.0.4")
        assert (await same_24.reply())[0].startswith(b"421 4.7.0")
        other_24 = await RawClient.connect(port, "127.0.1.4")
        assert await other_24.code() == 220
        refused = relay.metrics.registry.get_sample_value
        assert refused("logspool_smtp_sessions_refused_total", {"limit": "client"}) == 1
        assert refused("logspool_smtp_sessions_refused_total", {"limit": "network"}) == 1
        await first.send(b"QUIT\r\n")
        assert (await first.closed()).startswith(b"221")  # the slot is free before the socket closes
        again = await RawClient.connect(port, "127.0.0.4")
        assert await again.code() == 220
        for c in (same_address, neighbour, same_24, other_24, again):
            await c.aclose()
        await _fresh_client_is_served(relay, watch, tmp_path, 1, source="127.0.0.5")
        nursery.cancel_scope.cancel()


async def test_ipv6_clients_are_counted_per_network_too(tmp_path: Path) -> None:
    text = f"""
[server]
listen = ["[::1]:0", "127.0.0.1:0"]
hostname = "relay.test"
max_sessions_per_client = 5
max_sessions_per_network = 1
[spool]
dir = "spool"
{OUTSIDERS}
[routes]
"localhost" = "maildir:maildir"
"""
    cfg = parse_config(text, source=str(tmp_path / "test.toml"), base_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        v6_port = relay.ports[0]
        clients = []
        for _ in range(2):
            sock = trio.socket.socket(socket.AF_INET6)
            await sock.connect(("::1", v6_port))
            clients.append(RawClient(trio.SocketStream(sock)))
        assert await clients[0].code() == 220
        assert (await clients[1].reply())[0].startswith(b"421 4.7.0")  # ::1's /64 holds its one slot
        v4 = await RawClient.connect(relay.ports[1], "127.0.0.2")
        assert await v4.code() == 220  # IPv4 clients are counted apart
        for c in (*clients, v4):
            await c.aclose()
        await _fresh_client_is_served(relay, watch, tmp_path, 1, port=relay.ports[1])
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- metrics endpoint


def _scrape(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow
async def test_the_metrics_endpoint_stays_bounded_under_slow_and_abandoned_connections(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 'metrics_listen = "127.0.0.1:0"\nmetrics_max_connections = 3\nmetrics_timeout = "500ms"')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        server = relay.metrics.server
        assert server is not None
        port = relay.metrics_listeners[0].socket.getsockname()[1]
        threads = threading.active_count()
        streams = []
        for i in range(30):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            if i % 3 == 1:
                await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            elif i % 3 == 2:
                await stream.send_all(b"GET /metrics HTTP/1.1\r\n\r\n")  # asks, never reads the answer
            streams.append(stream)
        with trio.fail_after(30):
            while server.accept.active < 3:  # the endpoint has taken all it will take
                await trio.sleep(0.01)
        assert threading.active_count() == threads  # no thread per connection
        for stream in streams[::2]:
            await trio.aclose_forcefully(stream)  # abandoned
        # A fresh scrape waits behind the slow ones, at most their deadlines, and is answered.
        status, body = await trio.to_thread.run_sync(_scrape, port)
        assert status == 200 and b"logspool_smtp_sessions_total" in body
        assert server.accept.peak == 3
        for stream in streams:
            await trio.aclose_forcefully(stream)

        # One bad request is one failed request: garbage gets a 400, a failing collector a 500, and then a 200.
        bad = await trio.open_tcp_stream("127.0.0.1", port)
        await bad.send_all(b"\x00\xff garbage\r\n\r\n")
        assert (await bad.receive_some(100)).startswith(b"HTTP/1.1 400")
        await bad.aclose()

        class Broken:
            def collect(self) -> Iterator[Metric]:
                raise RuntimeError("a collector broke")

        broken = Broken()
        relay.metrics.registry.register(broken)
        assert (await trio.to_thread.run_sync(_scrape, port))[0] == 500
        relay.metrics.registry.unregister(broken)
        assert (await trio.to_thread.run_sync(_scrape, port))[0] == 200
        await _fresh_client_is_served(relay, watch, tmp_path, 1)
        nursery.cancel_scope.cancel()
