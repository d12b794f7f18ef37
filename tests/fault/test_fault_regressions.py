"""Engine bugs found by the fault-injection harnesses, each pinned by a minimal failing test.

Each stays ``xfail(strict=True)`` until the engine fix lands; a fix turns it into
an XPASS, which fails the suite, and then the marker comes off.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
from spool_support import tiny_config

from fault_injection.corrupt import Fixture, Mutation, try_mutation
from spool.engine.spool import Spool
from spool.errors import CorruptSegment, SpoolError, SyncFailed
from spool.fileio import OsFileIO
from spool.read import listing as admin


def test_power_cut_during_the_first_start_recovers(tmp_path: Path) -> None:
    # powercut --workload enqueue-only --replay 'S=0;K=2;D0=1;D1=1': the directory
    # entries of log/ and of segment 1 survived, the header write did not.
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "0000000000000001.seg").write_bytes(b"")
    sp = Spool.open(str(tmp_path), tiny_config())
    try:
        mid = sp.enqueue("a@example.org", ["b@example.org"], b"hello")
        sp.commit()
        assert [m.message_id for m in admin.iter_live(sp)] == [mid]
    finally:
        sp.close()


def test_first_segment_that_holds_records_is_not_recreated(tmp_path: Path) -> None:
    """The guard for the fix above: only an empty first segment may be recreated. One whose header is
    damaged keeps its records (each frame is salted with the id in its file name); the header is damage."""
    sp = Spool.open(str(tmp_path), tiny_config())
    mid = sp.enqueue("a@example.org", ["b@example.org"], b"hello")
    sp.commit()
    sp.close()
    seg = tmp_path / "log" / "0000000000000001.seg"
    data = seg.read_bytes()
    seg.write_bytes(bytes(32) + data[32:])
    os.remove(tmp_path / "checkpoint")
    sp = Spool.open(str(tmp_path), tiny_config())
    try:
        assert [m.message_id for m in admin.iter_live(sp)] == [mid]
        assert (tmp_path / "quarantine" / f"{1:016x}-{0:010d}-bad-header.bin").read_bytes() == bytes(32)
    finally:
        sp.close()


def test_checkpoint_after_a_failed_checkpoint_fsync_is_refused(tmp_path: Path) -> None:
    # faults --sweep 6: 'EIO on fdatasync #28' (the fdatasync inside sync_all).
    from fault_injection.faults import Fault, FaultyFileIO

    fio = FaultyFileIO(OsFileIO())
    sp = Spool.open(str(tmp_path), tiny_config(), io=fio)
    try:
        sp.enqueue("a@example.org", ["b@example.org"], b"hello")
        sp.commit()
        [attempt] = sp.poll_due(now=4e9)
        sp.commit()  # the START is durable; its envelope's garbage mark is written, not yet synced
        fio.fault = Fault("fdatasync", fio.counts["fdatasync"] + 1, "EIO")
        with pytest.raises(SyncFailed):
            sp.checkpoint()
        syncs = fio.counts["fdatasync"] + fio.counts["fsync"]
        with pytest.raises(SpoolError):
            sp.checkpoint()
        assert fio.counts["fdatasync"] + fio.counts["fsync"] == syncs, "a failed fsync was retried"
        del attempt
    finally:
        sp.close()


def test_last_segment_truncated_below_the_checkpoint_head_is_reported(tmp_path: Path) -> None:
    # corrupt --cases 60: 'truncate log/0000000000000007.seg to 601 bytes' (head at 7:2228) hung the runners.
    sp = Spool.open(str(tmp_path), tiny_config())
    for i in range(6):
        sp.enqueue("a@example.org", [f"b{i}@example.org"], b"x" * 300)
    sp.commit()
    sp.close()
    Spool.open(str(tmp_path), tiny_config()).close()  # its checkpoint's head and working start: the end of the log
    seg = tmp_path / "log" / "0000000000000001.seg"
    size = seg.stat().st_size
    with open(seg, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CorruptSegment) as info:
        Spool.open(str(tmp_path), attrs.evolve(tiny_config(), on_damage="refuse"))
    assert info.value.path.endswith("0000000000000001.seg")
    sp = Spool.open(str(tmp_path), tiny_config())  # quarantined, named, and the log goes on in a new segment
    try:
        assert any(n.endswith("-ends-early.json") for n in os.listdir(tmp_path / "quarantine"))
        assert sp.writer.segment_id == 2
        assert len(list(admin.iter_live(sp))) < 6
    finally:
        sp.close()


# -- found by `python -m fault_injection corrupt --cases 80 --seed 0` -----------------------------------------


@pytest.fixture(scope="module")
def damaged_spool(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    return Fixture.build(str(tmp_path_factory.mktemp("corrupt")), seed=0)


def _verdict(fx: Fixture, mutation: Mutation, tmp_path: Path) -> str:
    out = try_mutation(fx, [mutation], str(tmp_path))
    return f"{out.verdict}: {out.detail}"


def test_zeroed_range_in_a_sealed_segment_is_reported(damaged_spool: Fixture, tmp_path: Path) -> None:
    verdict = _verdict(damaged_spool, Mutation("log/0000000000000007.seg", "zero", 165, 266), tmp_path)
    assert not verdict.startswith("FAIL"), verdict


def test_runner_does_not_spin_on_a_short_fragment_at_a_segment_end(damaged_spool: Fixture, tmp_path: Path) -> None:
    verdict = _verdict(damaged_spool, Mutation("log/0000000000000006.seg", "zero", 3726, 149), tmp_path)
    assert not verdict.startswith("FAIL"), verdict


def test_sealed_segment_truncated_at_a_record_boundary_is_reported(damaged_spool: Fixture, tmp_path: Path) -> None:
    verdict = _verdict(damaged_spool, Mutation("log/0000000000000005.seg", "truncate", 2512), tmp_path)
    assert not verdict.startswith("FAIL"), verdict
