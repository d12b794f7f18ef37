"""Protocol and resource limits, checked with real clients on loopback (docs/security.md, "Limits").

The 50 MB test runs the relay as a separate process (``mta serve``) so that
its memory can be read from /proc without the test's own allocations in it.
"""

from __future__ import annotations

import os
import re
import smtplib
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import trio
from process_support import MTA
from relay_support import DeliveryWatch, RawClient, relay_config, start_relay

from spool.format.record import Status

LOCAL = {"localhost": "maildir:maildir", "*": "discard"}


async def test_command_lines_are_limited_to_512_octets(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), LOCAL))
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.command(b"EHLO c.example")
        assert (await c.command(b"NOOP " + b"x" * 505))[0].startswith(b"250")  # 512 with the CRLF
        assert (await c.command(b"NOOP " + b"x" * 506))[0].startswith(b"500 5.5.2")
        # The over-long line was skipped whole: its tail is not read as a command.
        assert (await c.command(b"NOOP " + b"x" * 4000 + b"\r\nRSET"))[0].startswith(b"500 5.5.2")
        assert (await c.reply())[0].startswith(b"250")
        await c.aclose()
        nursery.cancel_scope.cancel()


async def test_text_lines_are_limited_to_1000_octets(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), LOCAL))
        watch = DeliveryWatch(relay)

        def client() -> tuple[int, int]:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                s.ehlo()
                s.mail("a@example.org")
                s.rcpt("someone@localhost")
                over = s.data(b"Subject: long\r\n\r\n" + b"y" * 999 + b"\r\n")[0]
                s.mail("a@example.org")
                s.rcpt("someone@localhost")
                at_limit = s.data(b"Subject: fits\r\n\r\n" + b"x" * 998 + b"\r\n")[0]
                return over, at_limit

        assert await trio.to_thread.run_sync(client) == (550, 250)
        await watch.wait_for(Status.DELIVERED, 1)
        assert len(os.listdir(tmp_path / "maildir" / "someone" / "new")) == 1
        nursery.cancel_scope.cancel()


async def test_message_size_is_announced_and_enforced_while_streaming(tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), LOCAL, extra="max_message_size = 20000\n")
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)

        def client() -> tuple[str, int, int, int]:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                s.ehlo()
                announced = s.esmtp_features["size"]
                declared = s.mail("a@example.org", ["SIZE=20001"])[0]
                s.rset()
                # No SIZE parameter: the limit holds while the body streams in.
                s.mail("a@example.org")
                s.rcpt("someone@localhost")
                streamed = s.data(b"Subject: big\r\n\r\n" + (b"z" * 98 + b"\r\n") * 300)[0]
                s.mail("a@example.org")
                s.rcpt("someone@localhost")
                small = s.data(b"Subject: small\r\n\r\nok\r\n")[0]
                return announced, declared, streamed, small

        assert await trio.to_thread.run_sync(client) == ("20000", 552, 552, 250)
        await watch.wait_for(Status.DELIVERED, 1)
        (name,) = os.listdir(tmp_path / "maildir" / "someone" / "new")
        assert b"Subject: small" in (tmp_path / "maildir" / "someone" / "new" / name).read_bytes()
        nursery.cancel_scope.cancel()


async def test_recipients_per_message_are_limited(tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), LOCAL, extra="max_recipients = 3\n")
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)

        def client() -> list[tuple[int, bytes]]:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                s.ehlo()
                s.mail("a@example.org")
                return [s.rcpt(f"r{i}@localhost") for i in range(4)]

        replies = await trio.to_thread.run_sync(client)
        assert [code for code, _ in replies] == [250, 250, 250, 452]
        assert replies[3][1].startswith(b"4.5.3")
        nursery.cancel_scope.cancel()


async def test_too_many_errors_end_the_session(tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), LOCAL, extra="max_errors = 3\n")
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.send(b"FOO\r\nBAR\r\nBAZ\r\nNOOP\r\n")
        assert [await c.code() for _ in range(3)] == [500, 500, 500]
        assert (await c.reply())[0].startswith(b"421")
        assert await c.closed() == b""  # the NOOP was never answered
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_idle_clients_time_out_in_commands_and_in_data(tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), LOCAL, extra='command_timeout = "1s"\ndata_timeout = "1s"\n')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        assert (await c.reply())[0].startswith(b"421 4.4.2")  # said nothing after the greeting
        assert await c.closed() == b""
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.send(b"EHLO c.example\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<x@localhost>\r\nDATA\r\n")
        assert [(await c.reply())[-1][:3] for _ in range(4)] == [b"250", b"250", b"250", b"354"]
        await c.send(b"Subject: half\r\n\r\nand then silence")
        assert (await c.reply())[0].startswith(b"421 4.4.2")
        assert await c.closed() == b""

        def sentinel() -> None:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                s.sendmail("a@example.org", ["x@localhost"], "Subject: whole\r\n\r\ncomplete\r\n")

        await trio.to_thread.run_sync(sentinel)
        await watch.wait_for(Status.DELIVERED, 1)
        (name,) = os.listdir(tmp_path / "maildir" / "x" / "new")  # the half-sent message was dropped
        assert b"Subject: whole" in (tmp_path / "maildir" / "x" / "new" / name).read_bytes()
        nursery.cancel_scope.cancel()


async def test_sessions_are_limited_in_total_and_per_client(tmp_path: Path) -> None:
    # Outsiders only (mynetworks is elsewhere): clients in mynetworks are exempt from the per-client limit.
    cfg = relay_config(str(tmp_path), LOCAL, extra='max_sessions = 2\nmax_sessions_per_client = 1\n'
                       'reserved_sessions = 0\n[relay]\nmynetworks = ["10.0.0.0/8"]\n')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        port = relay.ports[0]
        first = await RawClient.connect(port, "127.0.0.1")
        assert await first.code() == 220
        same = await RawClient.connect(port, "127.0.0.1")
        assert (await same.reply())[0].startswith(b"421 4.7.0")
        other = await RawClient.connect(port, "127.0.0.3")
        assert await other.code() == 220
        third = await RawClient.connect(port, "127.0.0.4")
        assert (await third.reply())[0].startswith(b"421 4.7.0")
        # The server counts a session down before it closes the socket, so EOF means a free slot.
        await first.send(b"QUIT\r\n")
        assert (await first.closed()).startswith(b"221")
        again = await RawClient.connect(port, "127.0.0.1")
        assert await again.code() == 220
        for c in (same, other, third, again):
            await c.aclose()
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- 50 MB in bounded memory


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}


class _Smtp:
    """A blocking SMTP client on a socket that can stream a body it never holds whole."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.file = self.sock.makefile("rb")

    def reply(self) -> bytes:
        while True:
            line = self.file.readline()
            if line[3:4] != b"-":
                return line

    def command(self, line: bytes) -> bytes:
        self.sock.sendall(line + b"\r\n")
        return self.reply()

    def start_message(self) -> None:
        for line, code in ((b"EHLO big.example", b"250"), (b"MAIL FROM:<a@example.org>", b"250"),
                           (b"RCPT TO:<b@far.example>", b"250"), (b"DATA", b"354")):
            answer = self.command(line)
            assert answer.startswith(code), answer


def test_a_50mb_message_streams_through_in_bounded_memory(tmp_path: Path) -> None:
    (tmp_path / "relay.toml").write_text(
        '[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\nmax_message_size = "60MB"\n'
        '[spool]\ndir = "spool"\nqueue_minfree = "1MB"\n[routes]\n"*" = "discard"\n')
    proc = subprocess.Popen([MTA, "serve", "--config", "relay.toml"], cwd=tmp_path, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        port = 0
        for line in proc.stderr:  # ends at the relay's exit if it never listens
            if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "the relay did not start"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        warm = _Smtp(port)
        assert warm.reply().startswith(b"220")
        warm.start_message()
        assert warm.command(b"Subject: warm-up\r\n\r\nsmall\r\n.").startswith(b"250")
        idle = _memory(proc.pid)["VmRSS"]

        c = _Smtp(port)
        assert c.reply().startswith(b"220")
        c.start_message()
        block = (b"x" * 998 + b"\r\n") * 64
        for _ in range((50 << 20) // len(block) + 1):
            c.sock.sendall(block)
        # Before the final dot the message cannot be queued, let alone delivered: this is DATA alone.
        streamed = _memory(proc.pid)["VmHWM"]
        assert c.command(b".").startswith(b"250")
        grew_mib = (streamed - idle) / 1024
        # The spool holds at most one flush threshold (4 MiB) of data unwritten, pending and being written
        # together, and drops a batch once written; a body chunk has a buffer of its exact size, so glibc
        # reuses the blocks instead of keeping holes (docs/design.md, "Memory while a body streams").
        # The rest is the read, the partial chunk and the allocator's slack, a fixed cost: measured
        # 5.3-9.9 MiB in 24 runs idle and loaded, and 8-9.8 for 50 to 200 MB alike (tools/bench/
        # body_memory_probe.py). Before, a buffer grown by realloc to megabytes and a written batch kept
        # uncounted made it 7.8-19.2 MiB, flaky against this bound under load.
        assert grew_mib < 16, f"RSS grew by {grew_mib:.1f} MiB while 50 MB streamed in"
    finally:
        proc.kill()
        proc.wait()
