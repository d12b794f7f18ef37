"""Disk faults through the FileIO interface, and a real filesystem that fills up."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from spool_support import tiny_config

from fault_injection import faults
from fault_injection.ledger import Ledger, check
from spool.engine.spool import Spool
from spool.errors import DiskFull, SpoolError, SyncFailed
from spool.fileio import OsFileIO


def _enqueue(sp: Spool, led: Ledger, i: int) -> int:
    rcpts = (f"r{i}@example.org",)
    body = os.urandom(200)
    mid = sp.enqueue("s@example.org", rcpts, body)
    led.enqueued[mid] = (rcpts, body)
    return mid


def test_failed_fsync_poisons_the_spool_and_reopen_keeps_what_was_acknowledged(tmp_path: Path) -> None:
    fio = faults.FaultyFileIO(OsFileIO())
    sp = Spool.open(str(tmp_path), tiny_config(), io=fio)
    led = Ledger()
    try:
        for i in range(5):
            mid = _enqueue(sp, led, i)
            sp.commit()
            led.acked.add(mid)
        fio.fault = faults.Fault("fdatasync", fio.counts["fdatasync"] + 1, "EIO")
        _enqueue(sp, led, 99)
        with pytest.raises(SyncFailed):
            sp.commit()
        calls = sum(fio.counts.values())
        with pytest.raises(SpoolError):
            _enqueue(sp, led, 100)
        assert sum(fio.counts.values()) == calls, "the engine touched the disk after a failed fsync"
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), tiny_config())
    try:
        res = check(sp, led)
        assert res.ok, res.violations
    finally:
        sp.close()


def test_enospc_fails_the_commit_keeps_earlier_messages_and_does_not_poison(tmp_path: Path) -> None:
    fio = faults.FaultyFileIO(OsFileIO())
    sp = Spool.open(str(tmp_path), tiny_config(), io=fio)
    led = Ledger()
    try:
        mid = _enqueue(sp, led, 1)
        sp.commit()
        led.acked.add(mid)
        fio.fault = faults.Fault("write", fio.counts["write"] + 1, "ENOSPC")
        mid = _enqueue(sp, led, 2)
        with pytest.raises(DiskFull) as info:
            sp.commit()
        assert info.value.errno == errno.ENOSPC
        assert sp.writer.poisoned is None
        sp.commit()  # the fault fired once: the same records fit now
        led.acked.add(mid)
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), tiny_config())
    try:
        res = check(sp, led)
        assert res.ok, res.violations
    finally:
        sp.close()


def test_every_fault_kind_once_then_every_crash_state_recovers() -> None:
    report = faults.run_all(seed=0, real_fs=False)
    kinds = {(c.fault.op, c.fault.kind) for c in report.cases}
    assert {("write", "ENOSPC"), ("write", "EIO"), ("write", "short"), ("fdatasync", "EIO"), ("allocate", "ENOSPC"),
            ("fsync", "EIO"), ("fsync_dir", "EIO"), ("rename", "EIO"), ("unlink", "EIO")} <= kinds
    assert report.ok, [line for line in report.lines() if "FAIL" in line or line.startswith("      ")]


def test_a_real_tmpfs_that_fills_up() -> None:
    text, ok = faults.real_full_fs()
    assert ok, text
    assert not text.startswith("not run"), text
