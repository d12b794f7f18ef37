"""A full disk in the engine: ENOSPC cuts back and waits, never poisons; checkpoints fail softly.

``FullDisk`` is the real file system (``OsFileIO``) with a switch that makes
every write, preallocation and file creation fail with ENOSPC, after writing
part of the first write as a real full disk does (a short write, then
ENOSPC). The relay-level tests on a real small tmpfs are in
``test_security_disk.py``; the fault harness (``fault_injection.faults``)
sweeps ENOSPC over every call.
"""

from __future__ import annotations

import errno
import logging
import math
import os
from pathlib import Path

import pytest
import trio
from disk_support import NEEDS_ROOT, fill_disk, small_filesystem
from spool_support import spool_config

from fault_injection.workloads import FakeClock as Clock
from spool.aio.async_spool import AsyncSpool
from spool.config.engine import MIN_SEGMENT_SIZE, SpoolConfig, fit_to_filesystem
from spool.engine.spool import Spool
from spool.errors import CheckpointFailed, DiskFull, SpoolError
from spool.fileio import OsFileIO
from spool.format import checkpoint as ckpt
from spool.format.record import Outcome, Status
from spool.format.segment import list_segments, segment_path
from spool.read import listing as admin
from spool.write.reserve import NAME as RESERVE


class FullDisk(OsFileIO):
    """Real files; while ``full``, writes fail with ENOSPC (the first one after writing half of its bytes)."""

    def __init__(self) -> None:
        self.full = False
        self.short_first = True
        self.checkpoint_only = False  # only the checkpoint's temporary file finds no room

    def _no_room(self, path: str = "") -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path or None)

    def open(self, path: str, *, create: bool = False, truncate: bool = False) -> int:
        if self.full and create and not os.path.exists(path) and not self.checkpoint_only:
            raise self._no_room(path)
        return super().open(path, create=create, truncate=truncate)

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        if self.full and (not self.checkpoint_only or os.readlink(f"/proc/self/fd/{fd}").endswith(ckpt.TEMP)):
            if self.short_first and len(data) > 1:
                self.short_first = False
                return super().write(fd, memoryview(data)[: len(data) // 2], offset)
            raise self._no_room()
        return super().write(fd, data, offset)

    def allocate(self, fd: int, length: int) -> None:
        if self.full and not self.checkpoint_only:
            raise self._no_room()
        super().allocate(fd, length)


def live(sp: Spool) -> dict[int, admin.LiveMessage]:
    return {m.message_id: m for m in admin.iter_live(sp)}


def seg_size(sp: Spool) -> int:
    return os.path.getsize(segment_path(sp.log_dir, sp.writer.segment_id))


def test_enospc_cuts_the_short_write_back_and_the_same_records_are_written_when_there_is_room(
        tmp_path: Path) -> None:
    io, clock = FullDisk(), Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock), io)
    try:
        kept = sp.enqueue("a@x.example", ["r@y.example"], b"before the disk filled")
        sp.commit()
        size = seg_size(sp)
        io.full = True
        waiting = sp.append_message("a@x.example", ["r@y.example"], b"x" * 10_000)
        with pytest.raises(DiskFull) as info:
            sp.commit()
        assert info.value.errno == errno.ENOSPC
        assert not io.short_first, "the fault did not write half first"
        assert seg_size(sp) == size, "the short write was not cut back"
        assert sp.writer.poisoned is None and sp.writer.full is not None
        with pytest.raises(DiskFull):
            sp.commit()
        io.full = False
        sp.commit()  # the same bytes, at the positions already handed out
        assert sp.writer.full is None
        assert set(live(sp)) == {kept, waiting.message_id}
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        got = live(sp)
        assert set(got) == {kept, waiting.message_id}
        assert b"".join(sp.read_body(got[waiting.message_id].envelope)) == b"x" * 10_000
    finally:
        sp.close()


def test_a_cancelled_message_is_never_live_even_when_its_bytes_are_written_later(tmp_path: Path) -> None:
    io, clock = FullDisk(), Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock), io)
    try:
        io.full = True
        refused = sp.append_message("a@x.example", ["r@y.example"], b"answered 452")
        with pytest.raises(DiskFull):
            sp.commit()
        sp.cancel(refused)
        io.full = False
        accepted = sp.enqueue("a@x.example", ["r@y.example"], b"answered 250 later")
        sp.commit()
        assert set(live(sp)) == {accepted}
        clock.now += 1
        assert [a.message_id for a in sp.poll_due()] == [accepted]
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert set(live(sp)) == {accepted}
    finally:
        sp.close()


def test_a_delivery_record_that_found_no_room_is_committed_later_and_the_attempt_goes_on(tmp_path: Path) -> None:
    io, clock = FullDisk(), Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock), io)
    try:
        mid = sp.enqueue("a@x.example", ["r1@y.example", "r2@y.example"], b"body")
        sp.commit()
        clock.now += 1
        (attempt,) = sp.poll_due()
        io.full = True
        sp.record_delivery(attempt, [Outcome("r1@y.example", Status.DELIVERED, 250, "2.0.0", "ok", "hop")])
        with pytest.raises(DiskFull):
            sp.commit()
        assert sp.attempts, "the attempt must stay in flight until its outcome is durable"
        io.full = False
        sp.commit()
        assert sp.finish(attempt) is not None
        sp.commit()
        (msg,) = live(sp).values()
        assert msg.message_id == mid and msg.envelope.recipients == ("r2@y.example",)
    finally:
        sp.close()


def test_a_checkpoint_that_finds_no_room_leaves_the_previous_one_and_no_temporary_file(tmp_path: Path) -> None:
    io, clock = FullDisk(), Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock), io)
    try:
        sp.enqueue("a@x.example", ["r@y.example"], b"body")
        sp.checkpoint()
        before = sp.checkpoint_state
        sp.enqueue("a@x.example", ["r@y.example"], b"body")
        sp.commit()
        io.full, io.checkpoint_only = True, True
        with pytest.raises(DiskFull):
            sp.checkpoint()
        assert not (tmp_path / ckpt.TEMP).exists()
        assert sp.checkpoint_state == before and ckpt.load(io, str(tmp_path)) == before
        assert sp.writer.poisoned is None
        io.full = False
        sp.checkpoint()
        assert sp.checkpoint_state is not None and before is not None
        assert sp.checkpoint_state.sequence == before.sequence + 1
    finally:
        sp.close()


def test_checkpoint_failed_is_not_poison(tmp_path: Path) -> None:
    class BrokenTemp(OsFileIO):
        def fsync(self, fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(ckpt.TEMP):
                raise OSError(errno.EIO, "Input/output error")
            super().fsync(fd)

    sp = Spool.open(str(tmp_path), spool_config(Clock()), BrokenTemp())
    try:
        sp.enqueue("a@x.example", ["r@y.example"], b"body")
        with pytest.raises(CheckpointFailed):
            sp.checkpoint()
        assert not (tmp_path / ckpt.TEMP).exists() and sp.writer.poisoned is None
        sp.enqueue("a@x.example", ["r@y.example"], b"body")
        sp.commit()
    finally:
        sp.close()


def test_start_with_a_leftover_temporary_checkpoint_removes_it(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    mid = sp.enqueue("a@x.example", ["r@y.example"], b"body")
    sp.checkpoint()
    sp.close()
    (tmp_path / ckpt.TEMP).write_bytes(b"half a checkpoint from a crash")
    caplog.set_level(logging.INFO, logger="spool")
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert set(live(sp)) == {mid}
        assert not (tmp_path / ckpt.TEMP).exists()
        assert "removed a temporary checkpoint" in caplog.text
    finally:
        sp.close()


def test_recovery_on_a_full_disk_starts_and_writes_its_replacements_when_there_is_room(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    mid = sp.enqueue("a@x.example", ["r@y.example"], b"in flight at the crash")
    sp.commit()
    clock.now += 1
    (attempt,) = sp.poll_due()
    sp.record_sending(attempt, attempt.remaining)
    sp.commit()  # START and sending durable; no outcome, no FINISH: a crash
    sp.close()

    io = FullDisk()
    io.full, io.short_first = True, False
    caplog.set_level(logging.WARNING, logger="spool")
    sp = Spool.open(str(tmp_path), spool_config(clock), io)
    try:
        assert "on a full disk" in caplog.text
        assert sp.writer.full is not None and sp.writer.pending_bytes > 0
        assert not live(sp), "the replacement is not written yet, and the old envelope is marked"
        io.full = False
        sp.commit()
        (msg,) = live(sp).values()
        assert msg.message_id == mid and msg.envelope.in_doubt == ("r@y.example",)
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert [m.envelope.in_doubt for m in live(sp).values()] == [("r@y.example",)]
    finally:
        sp.close()


def test_a_crash_while_replacements_wait_for_room_recovers_them_again(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    mid = sp.enqueue("a@x.example", ["r@y.example"], b"in flight")
    sp.commit()
    clock.now += 1
    sp.poll_due()
    sp.commit()
    sp.close()
    io = FullDisk()
    io.full = True
    Spool.open(str(tmp_path), spool_config(clock), io).close()  # recovered on a full disk, then crashed
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert [m.message_id for m in live(sp).values()] == [mid]
    finally:
        sp.close()


def test_segments_are_cut_to_a_small_filesystem() -> None:
    default = SpoolConfig()
    assert fit_to_filesystem(default, 100 << 30) is default
    small = fit_to_filesystem(default, 8 << 20)
    assert small.segment_size == 512 << 10 and small.checkpoint_bytes == 512 << 10
    assert small.reserve_bytes == 256 << 10
    tiny = fit_to_filesystem(default, 20_000)
    assert tiny.segment_size == MIN_SEGMENT_SIZE and tiny.reserve_bytes == MIN_SEGMENT_SIZE
    assert fit_to_filesystem(SpoolConfig(fit_to_disk=False), 8 << 20).segment_size == default.segment_size


def test_poisoning_is_kept_for_eio(tmp_path: Path) -> None:
    class Eio(OsFileIO):
        broken = False

        def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
            if self.broken:
                raise OSError(errno.EIO, "Input/output error")
            return super().write(fd, data, offset)

    io = Eio()
    sp = Spool.open(str(tmp_path), spool_config(Clock()), io)
    try:
        io.broken = True
        sp.enqueue("a@x.example", ["r@y.example"], b"body")
        with pytest.raises(OSError) as info:
            sp.commit()
        assert info.value.errno == errno.EIO and not isinstance(info.value, DiskFull)
        io.broken = False
        with pytest.raises(SpoolError):
            sp.enqueue("a@x.example", ["r@y.example"], b"after EIO")
        assert sp.writer.poisoned is not None
    finally:
        sp.close()


async def test_async_waiters_get_disk_full_and_a_waiting_commit_goes_through_when_room_returns(
        tmp_path: Path) -> None:
    io, clock = FullDisk(), Clock()
    aspool = await AsyncSpool.open(str(tmp_path), spool_config(clock), io)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(aspool.run)
            first = await aspool.enqueue("a@x.example", ["r@y.example"], b"accepted")
            clock.now += 1
            (attempt,) = await aspool.next_due()
            io.full = True
            aspool.core.record_delivery(attempt, [Outcome("r@y.example", Status.DELIVERED, 250, "2.0.0", "ok",
                                                          "hop")])
            with pytest.raises(DiskFull):
                await aspool.commit()
            assert aspool.disk_full and not aspool.space_ok
            with pytest.raises(DiskFull):
                await aspool.enqueue("a@x.example", ["r@y.example"], b"refused")
            failures = aspool.space_failures
            with trio.fail_after(10):
                while aspool.space_failures == failures:  # the committer keeps trying, with a delay
                    await aspool.disk_event()
            io.full = False
            with trio.fail_after(10):
                await aspool.wait_for_space()
            await aspool.commit()
            assert aspool.space_ok
            aspool.finish(attempt)
            await aspool.commit()
            assert list(live(aspool.core)) == []  # delivered; the refused one was cancelled
            nursery.cancel_scope.cancel()
    finally:
        aspool.core.close()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert not live(sp) and first
    finally:
        sp.close()


def make_garbage(sp: Spool, clock: Clock, count: int = 8) -> None:
    """Delivered messages of 60 KB: several segments that the next checkpoint may delete."""
    for _ in range(count):
        sp.enqueue("a@x.example", ["r@y.example"], os.urandom(60_000))
        sp.commit()
        clock.now += 10
        for a in sp.poll_due():
            sp.record_delivery(a, [Outcome("r@y.example", Status.DELIVERED, 250, "2.0.0", "ok", "h")])
            sp.commit()
            sp.finish(a)
        sp.commit()
        clock.now += 10
        sp.poll_due()


def small_config(clock: Clock) -> SpoolConfig:
    return SpoolConfig(retry_intervals=(1.0, 2.0), checkpoint_interval=math.inf, clock=clock)


def test_a_checkpoint_on_a_disk_full_to_the_last_block_deletes_segments_with_the_reserve(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """On a real 2 MiB tmpfs: the spool's own garbage and a filler take every block."""
    fs = tmp_path / "fs"
    with small_filesystem(fs, 2 << 20) as mounted:
        assert mounted, NEEDS_ROOT
        clock = Clock()
        sp = Spool.open(str(fs / "spool"), small_config(clock))
        try:
            assert sp.config.segment_size == 128 << 10 and sp.reserve.held
            assert os.path.getsize(fs / "spool" / RESERVE) == sp.reserve.size
            make_garbage(sp, clock)
            before = list_segments(sp.io, sp.log_dir)
            fill_disk(fs / "filler")
            caplog.set_level(logging.WARNING, logger="spool")
            gone = sp.checkpoint()
            assert gone and set(gone) <= set(before)
            assert "used the" in caplog.text and "reserve" in caplog.text
            assert sp.reserve.held, "the deleted segments gave room for the reserve again"
        finally:
            sp.close()


@pytest.mark.parametrize("ended", [False, True])
def test_while_records_wait_for_room_a_checkpoint_of_what_is_durable_frees_segments(
        tmp_path: Path, ended: bool) -> None:
    """A stalled log on a real full tmpfs: the checkpoint names only durable positions, deletes garbage
    with the reserve's room, and the waiting records fit afterwards; a crash instead loses nothing.

    ``ended``: the waiting records end an attempt in memory (a FINISH and a replacement envelope, as
    an admin change or a deferral writes them), so the checkpoint must still keep its START.
    """
    fs = tmp_path / "fs"
    with small_filesystem(fs, 2 << 20) as mounted:
        assert mounted, NEEDS_ROOT
        clock = Clock()
        root = str(fs / "spool")
        sp = Spool.open(root, small_config(clock))
        try:
            make_garbage(sp, clock)
            mid = sp.enqueue("a@x.example", ["r@y.example", "s@y.example"], b"in flight")
            sp.commit()
            clock.now += 10
            (attempt,) = sp.poll_due()
            sp.record_delivery(attempt, [Outcome("r@y.example", Status.DEFERRED, 451, "4.0.0", "later", "h")])
            sp.commit()
            fill_disk(fs / "filler")
            if ended:
                sp.finish(attempt)  # a replacement with both recipients, and a FINISH
            else:
                sp.record_delivery(attempt, [Outcome("s@y.example", Status.DEFERRED, 451, "4.0.0", "later", "h")])
            sp.enqueue("b@x.example", ["t@y.example"], os.urandom(8192))  # longer than the last page's slack
            with pytest.raises(DiskFull):
                sp.commit()
            gone = sp.checkpoint()  # durable only, into the reserve's room
            assert gone
            cp = sp.checkpoint_state
            assert cp is not None and cp.head == sp.writer.durable_end
            assert cp.working_start <= attempt.start_pos
        finally:
            sp.close()  # a crash: the records that waited are gone
        (fs / "filler").unlink()
        sp = Spool.open(root, small_config(clock))
        try:
            (msg,) = live(sp).values()
            assert msg.message_id == mid and set(msg.envelope.recipients) == {"r@y.example", "s@y.example"}
        finally:
            sp.close()
