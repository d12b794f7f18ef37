"""Short of disk: refuse new mail with 452, keep what was accepted, resume by itself (docs/security.md).

The first test runs the spool on a real 8 MiB tmpfs (mounting needs root,
which the project's test environment has); where the mount is refused it
falls back to the injectable free-space function over a real ``statvfs``
shifted to look like the same small filesystem, and says so in its output.
The second test drives the injectable function directly.

The tests after them are a disk that really fills up, each on a
real tmpfs (they need the mount, and fail, never skip, without it; CI runs as
root): another process fills the disk while the relay runs (a checkpoint, and
a delivery's outcome, find no room), several DATA streams near the floor, a
start on a full disk (``mta serve``, killed with -9 in the middle of a
delivery and restarted), and a small disk with the default 64 MiB segments.
Each ends with space given back, a fresh client's ``220`` and a message that
is delivered, and every message that got ``250`` delivered.
"""

from __future__ import annotations

import logging
import os
import smtplib
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from disk_support import NEEDS_ROOT, fill_disk, small_filesystem
from process_support import RelayProcess
from relay_support import (
    DeliveryWatch,
    GatedHop,
    NextHop,
    RawClient,
    Received,
    relay_config,
    start_relay,
    write_relay_config,
)

from mta.inbound.disk import free_bytes, measured_free
from mta.inbound.server import SmtpServer
from mta.process.relay import Relay
from mta.smtp.common import Reply
from spool.engine.core import LOG_DIR
from spool.fileio import OsFileIO
from spool.format import checkpoint as ckpt
from spool.format.record import Status, pos_offset
from spool.format.segment import list_segments
from spool.read.reader import LogReader

FS_SIZE = 8 << 20
MINFREE = 4 << 20


def mail(port: int, rcpt: str, subject: str) -> int:
    """The reply code to MAIL FROM, or to the end of DATA if MAIL was accepted."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo()
        code, _ = s.mail("a@example.org")
        if code != 250:
            return code
        s.rcpt(rcpt)
        return s.data(f"Subject: {subject}\r\n\r\nbody\r\n")[0]


async def extra_server(nursery: trio.Nursery, relay: Relay, free_space: Callable[[str], int]) -> int:
    """A second SMTP listener on the relay's spool with a free-space function of the test's choosing."""
    server = SmtpServer(relay.config, relay.aspool, relay.metrics, free_space=free_space)
    listeners = await nursery.start(server.serve)
    return int(listeners[0].socket.getsockname()[1])


@pytest.mark.slow
async def test_below_queue_minfree_mail_gets_452_and_queued_mail_is_kept(tmp_path: Path) -> None:
    blocked = True

    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.3.0", "not yet") if blocked and stage == "rcpt" else None

    fs = tmp_path / "spool"  # the spool directory is the small filesystem's root
    with small_filesystem(fs) as mounted:
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            hop_port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"},
                               spool_extra=f'queue_minfree = {MINFREE}\nsegment_size = "256k"\n')
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            # Without a mount, pretend the filesystem is FS_SIZE big, from the real statvfs.
            offset = 0 if mounted else free_bytes(str(fs)) - FS_SIZE
            port = relay.ports[0] if mounted else await extra_server(
                nursery, relay, lambda p: free_bytes(p) - offset)

            assert await trio.to_thread.run_sync(mail, port, "kept@far.example", "accepted before") == 250
            await watch.wait_for(Status.DEFERRED, 1, recipient="kept@far.example")

            filler = fs / "filler"
            filler.write_bytes(b"\0" * (free_bytes(str(fs)) - offset - MINFREE // 2))
            assert free_bytes(str(fs)) - offset < MINFREE
            code = await trio.to_thread.run_sync(mail, port, "new@far.example", "while full")
            assert code == 452
            # The queued message is untouched: it is retried (and deferred again) while the disk is short.
            await watch.wait_for(Status.DEFERRED, 2, recipient="kept@far.example")

            filler.unlink()
            blocked = False
            assert await trio.to_thread.run_sync(mail, port, "new@far.example", "after space returned") == 250
            await watch.wait_for(Status.DELIVERED, 1, recipient="kept@far.example")
            await watch.wait_for(Status.DELIVERED, 1, recipient="new@far.example")
            msgs = await hop.wait_messages(2)
            assert sorted(m.recipients[0] for m in msgs) == ["kept@far.example", "new@far.example"]
            assert all(b"while full" not in m.data for m in msgs)
            nursery.cancel_scope.cancel()


async def test_disk_check_at_mail_and_at_end_of_data_with_injected_free_space(tmp_path: Path) -> None:
    free = {"bytes": 1 << 40}
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"localhost": "maildir:maildir"}))
        watch = DeliveryWatch(relay)
        port = await extra_server(nursery, relay, lambda p: free["bytes"])

        def session() -> list[int]:
            with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
                s.ehlo()
                codes = [s.mail("a@example.org")[0], s.rcpt("someone@localhost")[0]]
                free["bytes"] = 0  # the disk fills while the client is in the middle of a message
                codes.append(s.data(b"Subject: x\r\n\r\nbody\r\n")[0])
                codes.append(s.mail("a@example.org")[0])
                free["bytes"] = 1 << 40
                codes.append(s.mail("a@example.org")[0])
                codes.append(s.rcpt("someone@localhost")[0])
                codes.append(s.data(b"Subject: y\r\n\r\nbody\r\n")[0])
                return codes

        assert await trio.to_thread.run_sync(session) == [250, 250, 452, 452, 250, 250, 250]
        await watch.wait_for(Status.DELIVERED, 1)
        box = tmp_path / "maildir" / "someone" / "new"
        (name,) = os.listdir(box)
        assert b"Subject: y" in (box / name).read_bytes()
        nursery.cancel_scope.cancel()


# -- a disk that really fills up --------------------------------------------------------------------------------


def greet_and_mail(port: int) -> tuple[int, int]:
    """A fresh client: the greeting's code and MAIL's."""
    s = smtplib.SMTP()
    try:
        greeting = s.connect("127.0.0.1", port)[0]
        s.ehlo()
        return greeting, s.mail("a@example.org")[0]
    finally:
        s.close()


def send(port: int, rcpt: str | list[str], subject: str, size: int = 0) -> int:
    """One message of about ``size`` bytes: MAIL's (or a RCPT's) code if refused, else the code after DATA."""
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.ehlo()
        code = s.mail("a@example.org")[0]
        if code != 250:
            return code
        for r in [rcpt] if isinstance(rcpt, str) else rcpt:
            code = s.rcpt(r)[0]
            if code != 250:
                return code
        body = (f"Subject: {subject}\r\n\r\n" + ("x" * 76 + "\r\n") * (size // 78 + 1)).encode()
        return s.data(body)[0]


def mail_with_size(port: int, size: int) -> int:
    """MAIL FROM with a declared SIZE: its code."""
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.ehlo()
        return s.mail("a@example.org", [f"SIZE={size}"])[0]


def subjects(messages: list[Received]) -> list[str]:
    out = []
    for m in messages:
        head = m.data.split(b"\r\n\r\n", 1)[0]
        out += [line[9:].decode() for line in head.split(b"\r\n") if line.startswith(b"Subject: ")]
    return out


def cut_zeroed_room(spool_dir: Path) -> None:
    """Cut the zeroed room off the last segment, as if the relay had died right after a commit that used
    it up (a crash state the room allows): what recovery appends then needs new blocks of the disk."""
    reader = LogReader(OsFileIO(), str(spool_dir / LOG_DIR))
    end, _anomalies = reader.log_end()
    assert reader.last is not None
    os.truncate(reader.path(reader.last), pos_offset(end))


async def wait_disk(relay: Relay, condition: Callable[[], bool], timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await relay.aspool.disk_event()


async def test_a_checkpoint_that_finds_the_disk_full_is_retried_and_the_relay_stays_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fs = tmp_path / "spool"
    caplog.set_level(logging.WARNING, logger="spool")
    with small_filesystem(fs) as mounted:
        assert mounted, NEEDS_ROOT
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            hop_port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"},
                               spool_extra='queue_minfree = "1M"\ncheckpoint_interval = "100ms"\n')
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            port = relay.ports[0]
            assert await trio.to_thread.run_sync(send, port, "a@far.example", "before") == 250
            await watch.wait_for(Status.DELIVERED, 1)
            await relay.aspool.commit()  # its FINISH too: from here only a checkpoint has anything to write
            before = relay.aspool.core.checkpoint_state

            fill_disk(fs / "filler")  # another process takes every block
            # The runners pass the message's records 1 s and 2 s after it came: the restart
            # positions move, and the checkpointer tries to store them.
            await wait_disk(relay, lambda: relay.aspool.checkpoint_failures >= 1)
            assert "no room for the checkpoint" in caplog.text
            assert not (fs / ckpt.TEMP).exists(), "the failed temporary checkpoint is removed"
            assert relay.aspool.core.checkpoint_state == before
            assert await trio.to_thread.run_sync(greet_and_mail, port) == (220, 452)

            (fs / "filler").unlink()
            assert await trio.to_thread.run_sync(send, port, "b@far.example", "after") == 250
            await watch.wait_for(Status.DELIVERED, 2)
            assert sorted(subjects(await hop.wait_messages(2))) == ["after", "before"]
            await wait_disk(relay, lambda: relay.aspool.core.checkpoint_state != before)  # retried, and stored
            assert relay.aspool.core.writer.poisoned is None
            nursery.cancel_scope.cancel()


async def stream_message(port: int, rcpt: str, subject: str, size: int, all_in_data: trio.Event,
                         ready: list[int], streams: int) -> int:
    """One client that sends its message in 64 KiB writes once every client is inside DATA; the final code."""
    client = await RawClient.connect(port)
    try:
        assert await client.code() == 220
        for line, want in ((b"EHLO c.test", 250), (b"MAIL FROM:<a@example.org>", 250),
                           (f"RCPT TO:<{rcpt}>".encode(), 250), (b"DATA", 354)):
            reply = await client.command(line)
            assert int(reply[0][:3]) == want, (line, reply)
        ready.append(1)
        if len(ready) == streams:
            all_in_data.set()
        await all_in_data.wait()
        body = f"Subject: {subject}\r\n\r\n".encode() + b"x" * 76 + b"\r\n"
        line = b"x" * 76 + b"\r\n"
        block = line * (65536 // len(line))
        sent = len(body)
        await client.send(body)
        while sent < size:
            await client.send(block)
            sent += len(block)
        await client.send(b".\r\n")
        return await client.code(60)
    finally:
        await client.stream.aclose()


@pytest.mark.parametrize("minfree", ["2M", "0"])
async def test_concurrent_data_streams_near_the_floor_get_452_and_nothing_accepted_is_lost(
        tmp_path: Path, minfree: str) -> None:
    """Six clients pass MAIL above the floor, then send 1 MiB each at once into 1.5 MiB of room."""
    blocked = True

    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.3.0", "not yet") if blocked and stage == "rcpt" else None

    fs = tmp_path / "spool"
    with small_filesystem(fs) as mounted:
        assert mounted, NEEDS_ROOT
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            hop_port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"},
                               spool_extra=f'queue_minfree = "{minfree}"\n')
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            port = relay.ports[0]
            assert await trio.to_thread.run_sync(send, port, "kept@far.example", "kept") == 250
            await watch.wait_for(Status.DEFERRED, 1, recipient="kept@far.example")

            fill_disk(fs / "filler", leave=relay.config.spool.queue_minfree + (3 << 19))
            codes: dict[int, int] = {}
            all_in_data, ready = trio.Event(), list[int]()

            async def stream(i: int) -> None:
                codes[i] = await stream_message(port, f"s{i}@far.example", f"stream {i}", 1 << 20, all_in_data,
                                                ready, 6)

            with trio.fail_after(60):
                async with trio.open_nursery() as streams:
                    for i in range(6):
                        streams.start_soon(stream, i)
            assert set(codes.values()) <= {250, 452}, codes
            assert 452 in codes.values(), codes
            assert relay.aspool.core.writer.poisoned is None

            (fs / "filler").unlink()
            blocked = False
            await wait_disk(relay, lambda: relay.aspool.space_ok)
            assert await trio.to_thread.run_sync(greet_and_mail, port) == (220, 250)
            assert await trio.to_thread.run_sync(send, port, "fresh@far.example", "fresh") == 250
            accepted = {"kept", "fresh"} | {f"stream {i}" for i, c in codes.items() if c == 250}
            got = await hop.wait_messages(len(accepted))
            await watch.wait_for(Status.DELIVERED, len(accepted))
            assert sorted(subjects(got)) == sorted(accepted)
            nursery.cancel_scope.cancel()


async def test_an_outcome_that_finds_the_disk_full_waits_for_room_and_delivery_resumes(tmp_path: Path) -> None:
    """The next hop takes a message; before the relay can record it, another process fills the disk."""
    fs = tmp_path / "spool"
    with small_filesystem(fs) as mounted:
        assert mounted, NEEDS_ROOT
        async with trio.open_nursery() as nursery:
            hop = GatedHop()  # holds its 250 until the gate opens
            # A long reply makes the DELIVERY record longer than the zeroed room the log keeps ahead of its
            # write position (at most the 512 KiB segment here) and than the slack of the segment's last
            # tmpfs page: it finds the disk full for certain.
            hop.reply_text = "taken\n" + "\n".join(f"line {i} " + "x" * 3000 for i in range(190))
            await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                               spool_extra='queue_minfree = "1M"\n')
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            port = relay.ports[0]
            assert await trio.to_thread.run_sync(send, port, "a@far.example", "first") == 250
            await hop.wait_until(lambda: len(hop.held) == 1)
            fill_disk(fs / "filler")
            hop.gate.set()  # the next hop answers 250; its DELIVERY record finds no room
            await wait_disk(relay, lambda: relay.aspool.disk_full)
            assert watch.count(Status.DELIVERED) == 0, "an outcome is reported only once it is durable"
            assert relay.aspool.core.attempts, "the message stays in flight"
            assert await trio.to_thread.run_sync(greet_and_mail, port) == (220, 452)

            (fs / "filler").unlink()
            await watch.wait_for(Status.DELIVERED, 1)
            await wait_disk(relay, lambda: relay.aspool.space_ok)
            assert await trio.to_thread.run_sync(greet_and_mail, port) == (220, 250)
            assert await trio.to_thread.run_sync(send, port, "b@far.example", "second") == 250
            await watch.wait_for(Status.DELIVERED, 2)
            assert sorted(r for _, _, r in hop.received) == ["a@far.example", "b@far.example"]  # no copy
            assert relay.aspool.core.writer.poisoned is None
            nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_start_on_a_full_disk_answers_452_until_space_returns(tmp_path: Path) -> None:
    """``mta serve`` killed with -9 while a delivery is in flight; another process fills the disk; restart."""
    fs = tmp_path / "fs"
    with small_filesystem(fs) as mounted:
        assert mounted, NEEDS_ROOT
        async with trio.open_nursery() as nursery:
            hop = GatedHop()
            await hop.start(nursery)
            hop.accept_first = 1
            # "redeliver": m1, in flight at the kill, is to be delivered again after the disk has room.
            config = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                        spool_extra='queue_minfree = "1M"\nin_doubt = "redeliver"',
                                        spool_dir=str(fs / "spool"))
            relay = RelayProcess(config)
            await relay.start(nursery)
            # m1's envelope is longer than a page (many recipients): recovery's replacement for it cannot
            # hide in the slack of the last segment's last tmpfs page, and finds the disk full for certain.
            many = [f"recipient-{i:03}-of-the-message-in-flight@far.example" for i in range(120)]
            assert await trio.to_thread.run_sync(send, relay.port, "r0@far.example", "m0") == 250
            assert await trio.to_thread.run_sync(send, relay.port, many, "m1") == 250
            await hop.wait_until(lambda: len(hop.held) == 1)  # m0 delivered, m1 taken and not answered
            await relay.kill()

            cut_zeroed_room(fs / "spool")
            (fs / "spool" / ckpt.TEMP).write_bytes(b"a temporary checkpoint left by a crash")
            fill_disk(fs / "filler")
            hop.new_life(accept_first=1 << 30)
            await relay.start(nursery)  # recovery needs room for m1's replacement envelope: it waits
            log = "\n".join(relay.lines)
            assert "on a full disk" in log, log
            assert "removed a temporary checkpoint" in log, log
            assert not (fs / "spool" / ckpt.TEMP).exists()
            assert await trio.to_thread.run_sync(greet_and_mail, relay.port) == (220, 452)

            seen = len(relay.lines)
            (fs / "filler").unlink()
            # Mail is taken once the waiting records are written and the reserve is whole again, in either order;
            # the line of whichever comes second says so.
            with trio.fail_after(30):
                while not any(line.endswith("mail is accepted") for line in relay.lines[seen:]):
                    await relay._changed.wait()
            assert any("room on disk again" in line for line in relay.lines[seen:]), relay.lines[seen:]
            assert await trio.to_thread.run_sync(send, relay.port, "r2@far.example", "m2") == 250
            await hop.wait_until(lambda: {r for lf, _, r in hop.received if lf == 2} >= {"r2@far.example", *many})
            assert "r0@far.example" in {r for _, _, r in hop.received}
            assert relay.proc is not None and relay.proc.returncode is None
            nursery.cancel_scope.cancel()


async def test_a_small_disk_with_the_default_segment_size_keeps_rotating_and_deleting(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """10 MiB of mail through an 8 MiB filesystem: only possible if segments are deleted as it goes."""
    fs = tmp_path / "spool"
    caplog.set_level(logging.WARNING, logger="spool")
    with small_filesystem(fs) as mounted:
        assert mounted, NEEDS_ROOT
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            hop_port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"}, retry='["100ms", "200ms"]',
                               spool_extra='queue_minfree = "1M"\ncheckpoint_interval = "100ms"\n')
            assert cfg.spool.segment_size == 64 << 20
            relay = await start_relay(nursery, cfg)
            fitted = relay.aspool.core.config.segment_size
            watch = DeliveryWatch(relay)
            port = relay.ports[0]
            log_dir = relay.aspool.core.log_dir
            seen: set[int] = set()
            refused = 0
            for i in range(40):
                # A client faster than the runners' 200 ms lag can meet the floor for a moment: it is told
                # 452 and tries again after the next checkpoint, which deletes what the runners left behind.
                # Without deletion (64 MiB segments) the disk stays full and the retries run out.
                while (code := await trio.to_thread.run_sync(send, port, f"r{i}@far.example", f"m{i}",
                                                              256 << 10)) == 452 and refused < 100:
                    refused += 1
                    with trio.fail_after(10):  # a jammed spool makes no checkpoint attempt at all
                        await relay.aspool.disk_event()
                assert code == 250, f"message {i} refused with {code} ({refused} refusals): the spool is jammed"
                await watch.wait_for(Status.DELIVERED, i + 1)
                seen.update(list_segments(relay.aspool.core.io, log_dir))
            assert max(seen) >= 15, "the spool did not rotate"
            assert min(list_segments(relay.aspool.core.io, log_dir)) > 1, "no segment was deleted"
            assert fitted == 512 << 10 and "using segments of 524288 bytes" in caplog.text
            assert await trio.to_thread.run_sync(greet_and_mail, port) == (220, 250)
            assert len(await hop.wait_messages(40)) == 40
            nursery.cancel_scope.cancel()


async def test_a_message_larger_than_the_disk_could_ever_hold_gets_552(tmp_path: Path) -> None:
    """7.5 MB into an 8 MiB filesystem with a 1 MiB floor: 552 5.3.4 (never fits), not 452 (try later).

    smtplib's ``send`` does not declare SIZE, so the refusal comes at the end of DATA; a declared SIZE is
    refused at MAIL.
    """
    fs = tmp_path / "spool"
    with small_filesystem(fs) as mounted:
        assert mounted, NEEDS_ROOT
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            hop_port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"},
                               spool_extra='queue_minfree = "1M"\n')
            assert cfg.server.max_message_size > 7_500_000
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            port = relay.ports[0]
            # Declared at MAIL, it is refused there, before any data; undeclared, at the end of DATA.
            assert await trio.to_thread.run_sync(mail_with_size, port, 7_500_000) == 552
            assert await trio.to_thread.run_sync(send, port, "big@far.example", "big", 7_500_000) == 552
            # What it wrote before it crossed the floor is garbage, reclaimed once the runners pass it.
            floor = relay.config.spool.queue_minfree
            # Reclaim frees its segments one checkpoint at a time (and refills the reserve between them), so
            # the room can pass the floor and fall back under it: a client told 452 tries again, as a real
            # one does, after the next change on disk. A spool that stays jammed fails at fail_after.
            for _ in range(20):
                await wait_disk(relay, lambda: relay.aspool.space_ok
                                and free_bytes(str(fs)) - relay.aspool.unflushed_bytes >= floor)
                if await trio.to_thread.run_sync(greet_and_mail, port) == (220, 250):
                    break
                with trio.fail_after(10):
                    await relay.aspool.disk_event()
            else:
                raise AssertionError("MAIL still refused after 20 changes of room on disk")
            assert await trio.to_thread.run_sync(send, port, "small@far.example", "small") == 250
            await watch.wait_for(Status.DELIVERED, 1)
            assert subjects(await hop.wait_messages(1)) == ["small"]
            nursery.cancel_scope.cancel()


def no_size_statvfs(path: str) -> os.statvfs_result:
    """statfs as some FUSE and network filesystems answer it: total 0, free 0 (the real one for the rest)."""
    real = os.statvfs(path)
    return os.statvfs_result((real.f_bsize, real.f_frsize, 0, 0, 0, 0, 0, 0, real.f_flag, real.f_namemax))


async def test_a_filesystem_that_reports_no_size_is_not_a_full_disk(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25: total 0, free 0 made every message a ``452 4.3.1``, even with ``queue_minfree = 0``; now a
    warning at start, and mail is taken (ENOSPC is still handled where a write meets it)."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"}, spool_extra="queue_minfree = 0\n")
        relay = await start_relay(nursery, cfg)
        with caplog.at_level(logging.WARNING, logger="mta.smtpd"):
            server = SmtpServer(relay.config, relay.aspool, relay.metrics,
                                free_space=lambda p: measured_free(p, no_size_statvfs))
        warned = [r.getMessage() for r in caplog.records if "reports no size" in r.getMessage()]
        assert len(warned) == 1, warned
        listeners = await nursery.start(server.serve)
        port = int(listeners[0].socket.getsockname()[1])
        assert await trio.to_thread.run_sync(mail, port, "b@far.example", "no size") == 250
        await hop.wait_messages(1)
        nursery.cancel_scope.cancel()
