"""Bodies for delivery workers: read by the worker from the segment files by position, the relay's reads as the
fallback (``mta/delivery/worker_body.py``).

Real worker processes, real segment files, real next hops on 127.0.0.1. A
record the worker cannot read is read by the relay instead: from its cache
(delivered intact) or from the file, where the damage is found and named by
the spool as without workers.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from relay_support import DeliveryWatch, NextHop, relay_config_text, start_relay
from spool_support import running_spool

from mta.config import Config, parse_config
from mta.delivery.transport import Destination, Job
from mta.delivery.workers import INLINE_BODY, DeliveryWorkers
from mta.observe.logline import LogEvent
from spool.aio.async_spool import AsyncSpool, StoredBody
from spool.config.engine import SpoolConfig
from spool.errors import DamagedBody
from spool.format.record import Status


def _config(tmp_path: Path, port: int) -> Config:
    text = relay_config_text({"*": f"smtp://127.0.0.1:{port}"})
    text = text.replace("[routes]", "[delivery]\nprocesses = 1\n\n[routes]")
    return parse_config(text, source=str(tmp_path / "test.toml"), base_dir=str(tmp_path))


def _lines(tag: str, n: int) -> bytes:
    return b"".join(b"%s %08d the quick brown fox jumps over the lazy dog\r\n" % (tag.encode(), i) for i in range(n))


def _open_segments(pid: int, log_dir: str) -> list[str]:
    """The segment files process ``pid`` holds open."""
    fd_dir = f"/proc/{pid}/fd"
    held = []
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith(log_dir) and ".seg" in target:
            held.append(target)
    return held


def _worker_events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if isinstance(r.msg, LogEvent) and r.msg.name == name]


async def _send(port: int, sender: str, rcpts: list[str], body: bytes) -> None:
    import smtplib

    def send() -> None:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.sendmail(sender, rcpts, body)
    await trio.to_thread.run_sync(send)


@pytest.mark.parametrize("body_cache", [16 << 20, 0])
async def test_stored_bodies_are_read_by_the_worker_from_the_segments_and_one_segment_at_most_stays_open(
        tmp_path: Path, body_cache: int) -> None:
    """Small and big bodies, cached by the relay or not, across several segments: each is delivered whole, the
    relay reads none of them for the worker, and the worker keeps at most one segment file open."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = _config(tmp_path, port)
        cfg = attrs.evolve(cfg, spool=attrs.evolve(cfg.spool, segment_size=256 << 10, body_chunk=64 * 1024,
                                                   body_cache=body_cache))
        relay = await start_relay(nursery, cfg)
        assert relay.workers is not None
        worker_pid = relay.workers.pids[0]
        watch = DeliveryWatch(relay)
        bodies = [b"Subject: m%d\r\n\r\n" % i + _lines(f"m{i}", 20 if i % 2 else 9000) for i in range(7)]  # 1, 540 KB
        for i, body in enumerate(bodies):
            await _send(relay.ports[0], "a@example.org", [f"r{i}@far.example"], body)
            await watch.wait_for(Status.DELIVERED, i + 1)
        got = {m.recipients[0]: m.data for m in await hop.wait_messages(len(bodies))}
        assert all(bodies[i].split(b"\r\n\r\n", 1)[1] in got[f"r{i}@far.example"] for i in range(len(bodies)))
        assert relay.workers.served == 0, "every body was read by the worker itself"
        newest = max(int(n.split(".")[0], 16) for n in os.listdir(os.path.join(cfg.spool.dir, "log")) if ".seg" in n)
        assert newest >= 3, "the bodies span several segments"
        assert len(_open_segments(worker_pid, os.path.realpath(cfg.spool.dir))) <= 1
        nursery.cancel_scope.cancel()


def _flip(path: str, marker: bytes) -> None:
    """Flip one bit of ``marker``'s first byte where ``path`` holds it: that record fails its checksum."""
    with open(path, "r+b") as f:
        at = f.read().find(marker)
        assert at >= 0, f"{marker!r} is not in {path}"
        f.seek(at)
        f.write(bytes([marker[0] ^ 0x01]))


async def _claimed(aspool: AsyncSpool, body: bytes) -> tuple[Job, StoredBody]:
    """``body`` enqueued and claimed: its job, with the body as the scheduler gives it to a transport."""
    await aspool.enqueue("a@example.org", ["big@far.example"], body)
    (attempt,) = await aspool.next_due()
    stored = await aspool.read_body(attempt)
    qid = aspool.core.queue_id(attempt.envelope.message_id)
    return Job(qid, "a@example.org", ("big@far.example",), stored, attempt.envelope.body_size), stored


async def _workers(nursery: trio.Nursery, tmp_path: Path, port: int) -> DeliveryWorkers:
    workers = DeliveryWorkers(_config(tmp_path, port), 1)
    await nursery.start(workers.run)
    return workers


def _segment_with(log_dir: str, marker: bytes) -> str:
    for name in sorted(os.listdir(log_dir)):
        path = os.path.join(log_dir, name)
        with open(path, "rb") as f:
            if marker in f.read():
                return path
    raise AssertionError(f"{marker!r} is in no segment")


async def test_a_record_the_worker_cannot_read_comes_from_the_relays_cached_copy(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The file's copy of a body's middle record is damaged after the message was accepted, while the relay still
    has the body in its cache: the worker reads the records before it, says it falls back, and the relay gives
    the rest from its cache; the next hop gets the message whole."""
    caplog.set_level(logging.INFO)
    cfg = SpoolConfig(body_chunk=64 * 1024)
    async with running_spool(tmp_path / "spool", cfg) as aspool, trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        workers = await _workers(nursery, tmp_path, port)
        body = b"Subject: big\r\n\r\n" + _lines("big", 6000)  # ~400 KB: seven DATA records
        job, stored = await _claimed(aspool, body)
        assert stored.cached and len(stored.positions) > 3
        _flip(_segment_with(stored.log_dir, b"big 00003000 the quick"), b"big 00003000 the quick")
        (outcomes,) = await workers.deliver(Destination("smtp", f"127.0.0.1:{port}"), [job])
        assert [o.status for o in outcomes] == [Status.DELIVERED]
        (msg,) = hop.messages
        assert body.split(b"\r\n\r\n", 1)[1] in msg.data
        assert 1 <= workers.served <= len(stored.positions) - 1, "the relay gave only the chunks from the damaged one"
        (fallback,) = _worker_events(caplog, "body_read_fallback")
        assert fallback.process == workers.pids[0] and "checksum" in str(fallback.msg)
        assert stored.damaged is None, "the relay's copy was good"
        nursery.cancel_scope.cancel()


async def test_a_record_damaged_in_the_file_is_found_by_the_relay_when_the_worker_cannot_read_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Not in the relay's cache: the relay reads the record the worker could not, finds it damaged and names it
    (the spool's damage path, in the relay); the batch fails with DamagedBody and the next hop keeps nothing."""
    caplog.set_level(logging.INFO)
    cfg = SpoolConfig(body_chunk=64 * 1024, body_cache=0)
    async with running_spool(tmp_path / "spool", cfg) as aspool, trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        workers = await _workers(nursery, tmp_path, port)
        job, stored = await _claimed(aspool, b"Subject: big\r\n\r\n" + _lines("big", 6000))
        assert not stored.cached
        segment = _segment_with(stored.log_dir, b"big 00003000 the quick")
        _flip(segment, b"big 00003000 the quick")
        with pytest.raises(DamagedBody):
            await workers.deliver(Destination("smtp", f"127.0.0.1:{port}"), [job])
        assert stored.damaged is not None and stored.damaged.path == segment
        assert hop.messages == []
        assert len(_worker_events(caplog, "body_read_fallback")) == 1
        assert workers.deaths == 0, "the worker serves on"
        nursery.cancel_scope.cancel()


async def test_bodies_not_in_the_spool_cross_inline_and_pulled_through_a_full_socket(tmp_path: Path) -> None:
    """Bodies that are not stored bodies (no positions) go in the batch frame up to INLINE_BODY, bigger ones are
    pulled chunk by chunk: a batch frame of two inline bodies is more than the socket's buffer takes at once."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        workers = await _workers(nursery, tmp_path, port)
        inline = [b"Subject: i%d\r\n\r\n" % i + _lines(f"i{i}", 3000) for i in range(2)]  # ~200 KB each
        pulled = b"Subject: p\r\n\r\n" + _lines("p", 9000)  # ~600 KB
        assert all(len(b) <= INLINE_BODY for b in inline) and len(pulled) > INLINE_BODY
        jobs = [Job(f"Q{i}", "a@example.org", (f"r{i}@far.example",), [b], len(b))
                for i, b in enumerate([*inline, pulled])]
        results = await workers.deliver(Destination("smtp", f"127.0.0.1:{port}"), jobs)
        assert [o.status for outs in results for o in outs] == [Status.DELIVERED] * 3
        got = {m.recipients[0]: m.data for m in hop.messages}
        assert all(b.split(b"\r\n\r\n", 1)[1] in got[f"r{i}@far.example"] for i, b in enumerate([*inline, pulled]))
        assert workers.served >= 2, "the big one was pulled"
        nursery.cancel_scope.cancel()



async def test_a_delivery_cancelled_with_half_its_frame_written_ends_that_worker_and_the_next_one_delivers(
        tmp_path: Path) -> None:
    """The worker is stopped (SIGSTOP), so a batch frame bigger than the socket's buffer is written only in part;
    the delivery is cancelled there. The relay shuts the socket down (a stream cut mid-frame is of no use): the
    worker, continued, meets EOF and ends, and the worker started in its place delivers the same jobs."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        workers = await _workers(nursery, tmp_path, port)
        (first,) = workers.pids
        bodies = [b"Subject: i%d\r\n\r\n" % i + _lines(f"i{i}", 3000) for i in range(3)]  # ~200 KB each
        jobs = [Job(f"Q{i}", "a@example.org", (f"r{i}@far.example",), [b], len(b)) for i, b in enumerate(bodies)]
        dest = Destination("smtp", f"127.0.0.1:{port}")
        os.kill(first, signal.SIGSTOP)
        try:
            with trio.CancelScope() as scope:
                async def cancel_once_blocked() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    scope.cancel()
                nursery.start_soon(cancel_once_blocked)
                await workers.deliver(dest, jobs)
            assert scope.cancelled_caught
        finally:
            os.kill(first, signal.SIGCONT)
        await trio.testing.wait_all_tasks_blocked()  # the relay's reader has met the EOF of the shut socket
        assert workers.pids == [], "the cut worker is no longer used"
        results = await workers.deliver(dest, jobs)  # waits for the next worker
        assert [o.status for outs in results for o in outs] == [Status.DELIVERED] * 3
        assert workers.pids and workers.pids[0] != first and workers.deaths == 1
        assert len(hop.messages) == 3
        nursery.cancel_scope.cancel()
