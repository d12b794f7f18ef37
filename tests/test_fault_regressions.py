"""Engine bugs found by the fault-injection harnesses, each pinned by a minimal failing test.

Each stays ``xfail(strict=True)`` until the engine fix lands; a fix turns it into
an XPASS, which fails the suite, and then the marker comes off.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spool import admin
from spool.config import SpoolConfig
from spool.errors import SpoolError, SyncFailed
from spool.fileio import OsFileIO
from spool.spool import Spool


def _config() -> SpoolConfig:
    return SpoolConfig(segment_size=4096, retry_intervals=(1.0,), checkpoint_interval=float("inf"))


def test_power_cut_during_the_first_start_recovers(tmp_path: Path) -> None:
    # powercut --workload enqueue-only --replay 'S=0;K=2;D0=1;D1=1': the directory
    # entries of log/ and of segment 1 survived, the header write did not.
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "0000000000000001.seg").write_bytes(b"")
    sp = Spool.open(str(tmp_path), _config())
    try:
        mid = sp.enqueue("a@example.org", ["b@example.org"], b"hello")
        sp.commit()
        assert [m.message_id for m in admin.iter_live(sp)] == [mid]
    finally:
        sp.close()


def test_first_segment_that_holds_records_is_not_recreated(tmp_path: Path) -> None:
    """The guard for the fix above: only an empty first segment may be recreated."""
    sp = Spool.open(str(tmp_path), _config())
    sp.enqueue("a@example.org", ["b@example.org"], b"hello")
    sp.commit()
    sp.close()
    seg = tmp_path / "log" / "0000000000000001.seg"
    data = seg.read_bytes()
    seg.write_bytes(bytes(32) + data[32:])
    os.remove(tmp_path / "checkpoint")
    with pytest.raises(SpoolError):
        Spool.open(str(tmp_path), _config())


@pytest.mark.xfail(strict=True, reason="engine bug: after SyncFailed from LogWriter.sync_all (the checkpoint's "
                   "fdatasync), a later Spool.checkpoint() retries fdatasync on the same segments and stores a "
                   "checkpoint: LogWriter.sync_all and Spool.checkpoint_write ignore writer.poisoned (fsyncgate)")
def test_checkpoint_after_a_failed_checkpoint_fsync_is_refused(tmp_path: Path) -> None:
    # faults --sweep 6: 'EIO on fdatasync #28' (the fdatasync inside sync_all).
    from fault_injection.faults import Fault, FaultyFileIO

    fio = FaultyFileIO(OsFileIO())
    sp = Spool.open(str(tmp_path), _config(), io=fio)
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
