"""A commit makes every segment it covers durable, and a segment's tail reaches the disk before the next header.

The bug this guards against (found by a power-cut test of the running relay):
a batch written without a sync ends at the tail of segment N, the next synced
batch begins with N+1's header, and only N+1 was fdatasynced while
``durable_end`` moved past N's tail. Every file operation is recorded, so the
tests look at the order of writes and syncs itself, not at a lucky crash.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fault_injection import powercut
from fault_injection.recording import Link, Op, RecordingFileIO, Sync, Write
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.horizon import NAME as HORIZON
from spool.format.record import RecordType

SEGMENT = 4096


def _open(path: Path) -> tuple[Spool, RecordingFileIO]:
    io = RecordingFileIO(str(path))
    return Spool.open(str(path), SpoolConfig(segment_size=SEGMENT, clock=lambda: 1_700_000_000.0), io), io


def _unsynced_inodes(ops: list[Op]) -> set[int]:
    """Inodes with a data write after their last sync; the durable horizon (``DIR/durable``) is never synced
    by design (``spool.format.horizon``: it only repeats what a sync already made true)."""
    dirty: set[int] = set()
    horizon = {op.ino for op in ops if isinstance(op, Link) and op.name == HORIZON}
    for op in ops:
        if isinstance(op, Write) and op.ino not in horizon:
            dirty.add(op.ino)
        elif isinstance(op, Sync):
            dirty.discard(op.ino)
    return dirty


def _links_before_older_tails_synced(ops: list[Op]) -> list[str]:
    """Segments created while an older segment still had unsynced bytes."""
    segments: dict[int, str] = {}
    dirty: set[int] = set()
    bad: list[str] = []
    for op in ops:
        if isinstance(op, Link) and op.name.endswith(".seg"):
            if dirty:
                bad.append(f"{op.name} created while {sorted(segments[i] for i in dirty)} had unsynced bytes")
            segments[op.ino] = op.name
        elif isinstance(op, Write) and op.ino in segments:
            dirty.add(op.ino)
        elif isinstance(op, Sync):
            dirty.discard(op.ino)
    return bad


def test_write_only_batch_at_a_segment_tail_is_synced_by_the_next_commit(tmp_path: Path) -> None:
    sp, io = _open(tmp_path)
    try:
        w = sp.writer
        # Fill segment 1 to just short of its end, written but not synced.
        while w.head % (1 << 32) < SEGMENT - 600:
            w.append(RecordType.DATA, b"x" * 500, now=1_700_000_000)
        w.write_batch(w.take_batch(sync=False))
        # The next record does not fit: the synced batch begins with segment 2's header.
        w.append(RecordType.DATA, b"y" * 800, now=1_700_000_000)
        batch = w.take_batch(sync=True)
        assert batch.chunks[0][1] == 0  # the batch starts with the new segment's header
        w.write_batch(batch)
        assert _unsynced_inodes(io.rec.ops) == set()
        assert _links_before_older_tails_synced(io.rec.ops) == []
        assert w.durable_end == w.written_end
    finally:
        sp.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1500), st.booleans()), min_size=1, max_size=40))
def test_every_commit_covers_every_segment_it_passed(steps: list[tuple[int, bool]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        sp, io = _open(Path(d))
        try:
            w = sp.writer
            for size, sync in steps:
                w.append(RecordType.DATA, b"z" * size, now=1_700_000_000)
                w.write_batch(w.take_batch(sync=sync))
                if sync:
                    assert _unsynced_inodes(io.rec.ops) == set()
                assert _links_before_older_tails_synced(io.rec.ops) == []
        finally:
            sp.close()


def test_powercut_with_early_body_writes_and_small_segments_loses_nothing() -> None:
    report = powercut.run("flush-rotate", 300, seed=0)
    assert report.explored == 300
    assert report.failed == 0, [f.replay_command() + " " + "; ".join(f.violations[:2]) for f in report.failures]
