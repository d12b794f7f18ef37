"""The syncs a start makes: none after a clean stop, the ones crash safety needs after a crash.

Every file operation of the open is recorded (``RecordingFileIO``, the power-cut
harness's recorder), so the tests see each fdatasync, directory fsync and
rename, and in which order they came relative to recovery's own writes.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from spool_support import spool_config

from fault_injection.recording import ROOT_INO, Op, RecordingFileIO, Rename, Sync, SyncDir, Write
from fault_injection.workloads import FakeClock as Clock
from spool.engine.spool import Spool
from spool.format.checkpoint import NAME as CHECKPOINT
from spool.format.record import Outcome, Status

RCPT = "r@dest.example"


# Deferred classes of ten minutes and an hour.
config = functools.partial(spool_config, retry_intervals=(600.0, 3600.0))


def deferred_spool(path: Path, clock: Clock, n: int = 50) -> None:
    """n messages attempted once and deferred, checkpointed, nothing in flight: a clean stop."""
    sp = Spool.open(str(path), config(clock))
    try:
        sp.enqueue_many([("s@src.example", [RCPT], b"body %d" % i) for i in range(n)])
        got = sp.poll_due()
        sp.commit()
        for a in got:
            sp.record_delivery(a, [Outcome(RCPT, Status.DEFERRED, 451, "4.4.1", "later")])
        sp.commit()
        for a in got:
            sp.finish(a)
        sp.checkpoint()
    finally:
        sp.close()


def recorded_open(path: Path, clock: Clock, **kw: object) -> tuple[Spool, RecordingFileIO]:
    io = RecordingFileIO(str(path))
    return Spool.open(str(path), config(clock, **kw), io), io


def syncs(ops: list[Op]) -> list[Op]:
    return [op for op in ops if isinstance(op, Sync | SyncDir)]


def first_index(ops: list[Op], kind: type) -> int:
    return next(i for i, op in enumerate(ops) if isinstance(op, kind))


def test_open_after_a_clean_stop_syncs_nothing_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    clock = Clock()
    deferred_spool(tmp_path, clock)
    before = (tmp_path / CHECKPOINT).read_bytes()
    for _ in range(2):
        clock.now += 5
        sp, io = recorded_open(tmp_path, clock)
        sp.close()
        assert io.rec.ops == []  # no sync, no rename, no write at all
        assert sp.recovery_stats.syncs == 0
        assert (tmp_path / CHECKPOINT).read_bytes() == before


def test_idle_checkpoint_is_not_rewritten_but_a_moved_one_is(tmp_path: Path) -> None:
    clock = Clock()
    deferred_spool(tmp_path, clock)
    sp, io = recorded_open(tmp_path, clock)
    try:
        seq = sp.checkpoint_state.sequence if sp.checkpoint_state else -1
        sp.checkpoint()
        assert io.rec.ops == []
        sp.enqueue("s@src.example", [RCPT], b"new")
        sp.checkpoint()
        assert any(isinstance(op, Rename) for op in io.rec.ops)
        assert sp.checkpoint_state is not None and sp.checkpoint_state.sequence == seq + 1
    finally:
        sp.close()


def test_records_past_the_checkpoint_are_synced_before_recovery_acts(tmp_path: Path) -> None:
    clock = Clock()
    deferred_spool(tmp_path, clock)
    sp = Spool.open(str(tmp_path), config(clock))
    sp.enqueue("s@src.example", [RCPT], b"in flight")
    sp.commit()
    sp.poll_due()
    sp.writer.write_batch(sp.writer.take_batch(sync=False))  # the START reaches the file, unsynced
    sp.close()  # = kill -9: no checkpoint covers the new records

    sp, io = recorded_open(tmp_path, clock)
    try:
        ops = io.rec.ops
        assert sp.recovery_stats.in_flight == 1 and sp.recovery_stats.syncs == 1
        # The tail is made durable before recovery writes a mark or a record that depends on it.
        assert first_index(ops, Sync) < first_index(ops, Write)
        # ... and the recovered state is checkpointed, so the next start scans none of this again.
        assert any(isinstance(op, Rename) for op in ops)
    finally:
        sp.close()
    sp, io = recorded_open(tmp_path, clock)
    sp.close()
    assert syncs(io.rec.ops) == [] and sp.recovery_stats.records_read == 0


def test_a_segment_created_after_the_checkpoint_gets_its_directory_entry_synced(tmp_path: Path) -> None:
    clock = Clock()
    seg_size = 64 * 1024
    sp = Spool.open(str(tmp_path), config(clock, segment_size=seg_size))
    sp.checkpoint()
    first_seg = sp.writer.segment_id
    while sp.writer.segment_id == first_seg:
        sp.enqueue("s@src.example", [RCPT], os.urandom(4096))
    # Written, not synced: the new segment's directory entry is not durable (a kill -9 now).
    sp.writer.write_batch(sp.writer.take_batch(sync=False))
    sp.close()

    sp, io = recorded_open(tmp_path, clock, segment_size=seg_size)
    try:
        log_ino = io.entries[ROOT_INO]["log"]
        ops = io.rec.ops
        dir_sync = next(i for i, op in enumerate(ops) if op == SyncDir(log_ino))
        # Before the checkpoint that names a head inside the new segment is renamed into place.
        assert dir_sync < first_index(ops, Rename)
        assert sp.recovery_stats.syncs == 3  # both segments past the head, and the directory
    finally:
        sp.close()
