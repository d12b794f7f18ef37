"""Disk faults: ENOSPC and EIO on write, short writes, failing fsync, through the FileIO interface.

``python -m fault_injection faults [--sweep N] [--seed S] [--no-real-fs]``

``FaultyFileIO`` wraps another FileIO and fails the n-th call of one kind of
operation (once). Each case runs a delivery workload over
``FaultyFileIO(RecordingFileIO(real files))`` on a ``RetryingSpool``, which
does what the relay does when the disk is full or a checkpoint fails: it
commits (or checkpoints) again later. Then:

1. a short write must not surface at all (``write_all`` loops over it);
2. ENOSPC never poisons the log (docs/design.md, "A full disk"): it surfaces
   as DiskFull (errno ENOSPC) to whoever waited, or is absorbed by the engine
   (a garbage mark, the reserve, a write nobody waited for, retried later);
   the workload runs to its end and the spool ends healthy: no write or mark
   still waiting, the reserve whole, no segment left behind the checkpoint;
3. EIO keeps its errno. On the log's writes and on any fsync of the log or a
   directory the engine raised (``SyncFailed`` for an fsync) and is poisoned:
   no further write or fsync reaches the disk, and a new enqueue, commit or
   checkpoint raises ``SpoolError`` (PostgreSQL's fsyncgate: never retry and
   carry on). Elsewhere (a checkpoint's temporary file, which is thrown away;
   a segment deletion) it is absorbed, retried, and the spool ends healthy;
4. every crash state the recording allows at that point (the failed fsync made
   nothing durable; the kernel may have dropped the unsynced pages) recovers,
   and the ledger holds: nothing acknowledged is lost, nothing recorded comes back.

``real_full_fs`` fills a size-limited tmpfs for real: enqueues fail with
DiskFull, the same spool goes on once the filesystem grows, reopens on a full
disk, and every acknowledged message is there and no refused one is.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import tempfile
from collections import Counter

import attrs

from fault_injection import crashstates, scratch_dir
from fault_injection.ledger import Ledger, check, listed
from fault_injection.powercut import check_state
from fault_injection.recording import RecordingFileIO
from fault_injection.workloads import FakeClock, Scenario, commit_logged, deliver_round, enqueue_logged, make_config
from spool.config.engine import SpoolConfig
from spool.engine.spool import BODY_SLACK, Spool
from spool.errors import CheckpointFailed, DiskFull, SpoolError, SyncFailed
from spool.fileio import FileIO, OsFileIO
from spool.format import checkpoint as ckpt
from spool.format.record import pos_segment
from spool.format.segment import list_segments

OPS = ("open", "write", "allocate", "fdatasync", "fsync", "fsync_dir", "rename", "unlink", "truncate")
KINDS = {"write": ("ENOSPC", "EIO", "short"), "open": ("ENOSPC",), "allocate": ("ENOSPC",), "fdatasync": ("EIO",),
         "fsync": ("EIO",), "fsync_dir": ("EIO",), "rename": ("EIO",), "unlink": ("EIO",), "truncate": ("EIO",)}
SYNC_OPS = ("fdatasync", "fsync", "fsync_dir")


@attrs.frozen
class Fault:
    op: str
    nth: int
    kind: str

    def text(self) -> str:
        return f"{self.kind} on {self.op} #{self.nth}"


class FaultyFileIO:
    """Fails the ``nth`` call of ``fault.op`` (counting only calls that change or sync the disk)."""

    def __init__(self, inner: FileIO, fault: Fault | None = None) -> None:
        self.inner = inner
        self.fault = fault
        self.counts: Counter[str] = Counter()
        self.fired = False
        self.short_pending = False
        self.failed_sync = False  # an EIO fault fired (a failed fsync above all): what follows is recorded
        self.after_sync_failure: list[str] = []

    def _hit(self, op: str) -> bool:
        if op in OPS:
            self.counts[op] += 1
            if self.failed_sync:
                self.after_sync_failure.append(op)
        f = self.fault
        if f is not None and not self.fired and f.op == op and self.counts[op] == f.nth:
            self.fired = True
            if f.kind == "EIO":
                self.failed_sync = True
            return True
        return False

    def _raise(self, path: str = "") -> None:
        assert self.fault is not None
        code = errno.ENOSPC if self.fault.kind == "ENOSPC" else errno.EIO
        raise OSError(code, os.strerror(code), path or None)

    def open(self, path: str, *, create: bool = False, truncate: bool = False) -> int:
        if create and not self.inner.exists(path) and self._hit("open"):
            self._raise(path)
        return self.inner.open(path, create=create, truncate=truncate)

    def create_new(self, path: str) -> int:
        if self._hit("open"):
            self._raise(path)
        return self.inner.create_new(path)

    def open_read(self, path: str) -> int:
        return self.inner.open_read(path)

    def close(self, fd: int) -> None:
        self.inner.close(fd)

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        if self._hit("write") or self.short_pending:
            assert self.fault is not None
            if self.fault.kind != "short":
                self._raise()
            if len(data) < 2:
                # A one-byte write cannot be short: the next longer write is (so the nth call, which the
                # dry run counted among all writes, still leads to a short write).
                self.short_pending = True
                return self.inner.write(fd, data, offset)
            self.short_pending = False
            return self.inner.write(fd, memoryview(data)[: len(data) // 2], offset)
        return self.inner.write(fd, data, offset)

    def read(self, fd: int, size: int, offset: int) -> bytes:
        return self.inner.read(fd, size, offset)

    def size(self, fd: int) -> int:
        return self.inner.size(fd)

    def fsync(self, fd: int) -> None:
        if self._hit("fsync"):
            self._raise()
        self.inner.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        if self._hit("fdatasync"):
            self._raise()
        self.inner.fdatasync(fd)

    def truncate(self, fd: int, length: int) -> None:
        if self._hit("truncate"):
            self._raise()
        self.inner.truncate(fd, length)

    def allocate(self, fd: int, length: int) -> None:
        if self._hit("allocate"):
            self._raise()
        self.inner.allocate(fd, length)

    def rename(self, src: str, dst: str) -> None:
        if self._hit("rename"):
            self._raise(src)
        self.inner.rename(src, dst)

    def unlink(self, path: str) -> None:
        if self._hit("unlink"):
            self._raise(path)
        self.inner.unlink(path)

    def fsync_dir(self, path: str) -> None:
        if self._hit("fsync_dir"):
            self._raise(path)
        self.inner.fsync_dir(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)


@attrs.define
class CaseResult:
    fault: Fault
    surfaced: str = ""
    states: int = 0
    problems: list[str] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@attrs.define
class FaultReport:
    cases: list[CaseResult] = attrs.field(factory=list)
    real_fs: str = "not run"
    real_fs_ok: bool = True

    @property
    def ok(self) -> bool:
        return self.real_fs_ok and all(c.ok for c in self.cases)

    def lines(self) -> list[str]:
        out = []
        for c in self.cases:
            status = "ok" if c.ok else "FAIL"
            out.append(f"  {status} {c.fault.text()}: surfaced as {c.surfaced or 'nothing'}; "
                       f"{c.states} crash states recovered")
            out += [f"      {p}" for p in c.problems[:5]]
        failed = sum(not c.ok for c in self.cases)
        states = sum(c.states for c in self.cases)
        out.append(f"faults: {len(self.cases)} fault cases, {len(self.cases) - failed} passed, {failed} failed; "
                   f"{states} crash states after faults recovered")
        out.append(f"faults: real full filesystem: {self.real_fs}")
        return out


class RetryingSpool(Spool):
    """The engine as the relay drives it: a commit that found no room, or a failed checkpoint, is tried again.

    (The relay waits for room, or backs off; here the fault fires once, so
    trying again at once finds the disk healthy.) What it caught is kept in
    ``caught``.
    """

    def __init__(self, path: str, config: SpoolConfig, io: FileIO) -> None:
        super().__init__(path, config, io)
        self.caught: list[BaseException] = []

    def commit(self) -> None:
        try:
            super().commit()
        except DiskFull as exc:
            self.caught.append(exc)
            super().commit()

    def checkpoint(self) -> list[int]:
        try:
            return super().checkpoint()
        except (DiskFull, CheckpointFailed) as exc:
            self.caught.append(exc)
            return super().checkpoint()


def _workload(sp: Spool, rio: RecordingFileIO, rng: random.Random, clock: FakeClock) -> None:
    for step in range(18):
        for _ in range(rng.randint(1, 2)):
            enqueue_logged(sp, rio, rng, 900)
        commit_logged(sp, rio)
        deliver_round(sp, rio, rng, clock)
        clock.advance(0.7)
        if step % 3 == 2:
            sp.checkpoint()


def dry_run_counts(seed: int = 0) -> Counter[str]:
    """How many calls of each kind the fault-free workload (open included) makes."""
    root = tempfile.mkdtemp(prefix="logspool-faults-dry-", dir=scratch_dir())
    try:
        clock = FakeClock()
        rio = RecordingFileIO(root)
        fio = FaultyFileIO(rio)
        sp = RetryingSpool.open(root, make_config(clock), io=fio)
        try:
            _workload(sp, rio, random.Random(seed), clock)
        finally:
            sp.close()
        return fio.counts
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_case(fault: Fault, seed: int = 0, per_point: int = 16) -> CaseResult:
    res = CaseResult(fault)
    workdir = tempfile.mkdtemp(prefix="logspool-faults-", dir=scratch_dir())
    root = os.path.join(workdir, "spool")
    os.makedirs(root)
    try:
        clock = FakeClock()
        rio = RecordingFileIO(root)
        fio = FaultyFileIO(rio, fault)
        exc: BaseException | None = None
        sp: RetryingSpool | None = None
        try:
            opened = RetryingSpool.open(root, make_config(clock), io=fio)  # Spool.open is typed to return a Spool
            assert isinstance(opened, RetryingSpool)
            sp = opened
            _workload(sp, rio, random.Random(seed), clock)
        except Exception as e:
            exc = e
        _judge(res, fault, fio, exc, sp)
        if sp is not None and exc is None and sp.writer.poisoned is None:
            _check_healthy(res, sp, rio)
        if sp is not None:
            sp.close()
        scn = Scenario(f"fault {fault.text()}", rio.rec, [], clock.now)
        _recover_all(res, scn, workdir, per_point, seed)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def _with_errno(exc: BaseException | None, code: int) -> bool:
    while exc is not None and not (isinstance(exc, OSError) and exc.errno == code):
        exc = exc.__cause__ or exc.__context__
    return exc is not None


def _judge(res: CaseResult, fault: Fault, fio: FaultyFileIO, exc: BaseException | None,
           sp: RetryingSpool | None) -> None:
    caught = sp.caught if sp is not None else []
    shown = exc if exc is not None else (caught[0] if caught else None)
    res.surfaced = "nothing" if shown is None else f"{type(shown).__name__}({shown})"[:120]
    if exc is None and caught:
        res.surfaced = f"{res.surfaced}, retried"
    elif shown is None and fio.fired and fault.kind != "short":
        res.surfaced = "nothing: absorbed and retried by the engine"
    if not fio.fired:
        res.problems.append("the fault never fired (the workload made fewer calls)")
        return
    if fault.kind == "short":
        if exc is not None:
            res.problems.append(f"a short write surfaced as {res.surfaced}; write_all should have finished it")
        return
    want = errno.ENOSPC if fault.kind == "ENOSPC" else errno.EIO
    if shown is not None and not _with_errno(shown, want):
        res.problems.append(f"the fault surfaced as {res.surfaced}, without the original {fault.kind}")
    if fault.kind == "ENOSPC":
        if sp is not None and sp.writer.poisoned is not None:
            res.problems.append("a full disk poisoned the log writer: ENOSPC must be retried, not fatal")
        elif exc is not None and sp is not None:
            res.problems.append(f"a full disk stopped the workload: {res.surfaced}")
        return  # a fault in the first open (no room for the first segment) may surface as it is
    if sp is None:
        return
    if sp.writer.poisoned is not None:
        if fault.op in SYNC_OPS and not isinstance(exc, SyncFailed):
            res.problems.append(f"a failed fsync surfaced as {type(exc).__name__}, not SyncFailed")
        _probe_refuses(res, fio, sp)
    elif fault.op in SYNC_OPS and (isinstance(exc, SyncFailed) or exc is not None):
        res.problems.append(f"{res.surfaced} was raised but the log writer is not poisoned")
    elif exc is not None:
        res.problems.append(f"EIO stopped the workload without poisoning the writer: {res.surfaced}")
    elif fault.op in SYNC_OPS and not any(isinstance(c, CheckpointFailed) for c in caught):
        res.problems.append("a failed fsync was absorbed, but it was not a checkpoint's temporary file")


def _check_healthy(res: CaseResult, sp: Spool, rio: RecordingFileIO) -> None:
    """After a fault the engine absorbed: nothing still waits, and a commit and a checkpoint work."""
    w = sp.writer
    if w.full is not None or w.waiting_marks:
        res.problems.append(f"still waiting at the end: full={w.full!r}, {w.waiting_marks} marks")
    try:
        commit_logged(sp, rio)
        sp.checkpoint()
    except Exception as e:
        res.problems.append(f"after the fault, commit or checkpoint raised {type(e).__name__}({e})")
        return
    if not sp.reserve.held:
        res.problems.append("the reserve is not allocated again")
    cp = ckpt.load(sp.io, sp.path)
    if cp is not None:
        limit = pos_segment(cp.garbage_end) - cp.body_span - BODY_SLACK
        left = [seg for seg in list_segments(sp.io, sp.log_dir) if seg < limit]
        if left:
            res.problems.append(f"segments {left} lie behind the checkpoint and were not deleted")


def _probe_refuses(res: CaseResult, fio: FaultyFileIO, sp: Spool) -> None:
    """After a poisoning fault (a failed fsync, EIO on a log write): enqueue, commit and checkpoint fail,
    and nothing more reaches the disk."""
    before = len(fio.after_sync_failure)
    try:
        sp.enqueue("probe@example.org", ["probe@example.org"], b"after the failed fsync")
        sp.commit()
        res.problems.append("the spool accepted and committed a message after a poisoning fault")
    except SpoolError:
        pass
    except Exception as e:
        res.problems.append(f"after a poisoning fault, enqueue raised {type(e).__name__}, not SpoolError")
    try:
        sp.checkpoint()
        res.problems.append("the spool wrote a checkpoint after a poisoning fault")
    except SpoolError:
        pass
    writes = [op for op in fio.after_sync_failure[:] if op != "open"]
    if writes:
        res.problems.append(f"after the poisoning fault the engine still called {sorted(set(writes))} "
                            f"({len(fio.after_sync_failure) - before} during the probe): a retry")


def _recover_all(res: CaseResult, scn: Scenario, workdir: str, per_point: int, seed: int) -> None:
    end = len(scn.recording.ops)
    cands = crashstates.enumerate_states(scn.recording, per_point=per_point, seed=seed, only_point=end)
    for recipe, state, events in crashstates.materialise(scn.recording, [c.recipe for c in cands]):
        out = check_state(scn, state, events, workdir)
        res.states += 1
        res.problems += [f"crash state {recipe.text()}: {v}" for v in out.violations]


def default_faults(seed: int = 0, sweep: int = 0) -> list[Fault]:
    """Every fault kind once (at the middle call of its kind), plus ``sweep`` sampled calls per kind."""
    counts = dry_run_counts(seed)
    rng = random.Random(seed)
    out: list[Fault] = []
    for op in OPS:
        total = counts[op]
        if total == 0:
            continue
        for kind in KINDS[op]:
            picks = {max(1, total // 2)}
            if sweep:
                picks |= set(rng.sample(range(1, total + 1), min(sweep, total)))
            out += [Fault(op, n, kind) for n in sorted(picks)]
    return out


def run_all(seed: int = 0, *, real_fs: bool = True, sweep: int = 0) -> FaultReport:
    report = FaultReport()
    for fault in default_faults(seed, sweep):
        report.cases.append(run_case(fault, seed))
    if real_fs:
        report.real_fs, report.real_fs_ok = real_full_fs()
    return report


# -- a real, small filesystem that fills up ----------------------------------


def _mount(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def real_full_fs(size_kib: int = 1024) -> tuple[str, bool]:
    """Fill a tmpfs of ``size_kib`` KiB with the real engine. Returns (description, passed)."""
    mnt = tempfile.mkdtemp(prefix="logspool-fullfs-")
    mounted = _mount(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", mnt])
    if mounted.returncode != 0:
        os.rmdir(mnt)
        return f"not run: mount -t tmpfs is not permitted here ({mounted.stderr.strip()})", True
    try:
        return _fill_and_recover(mnt, size_kib)
    finally:
        _mount(["umount", mnt])
        os.rmdir(mnt)


def _fill(sp: Spool, led: Ledger, rng: random.Random, refused: set[int], count: int = 10_000) -> DiskFull | None:
    """Enqueue 6 KB messages, one commit each, until one finds no room (it is cancelled, as the relay does)."""
    for _ in range(count):
        rcpts = (f"r{len(led.enqueued)}@example.org",)
        body = rng.randbytes(6000)
        msg = sp.append_message("s@example.org", rcpts, body)
        led.enqueued[msg.message_id] = (rcpts, body)
        try:
            sp.commit()
        except DiskFull as e:
            sp.cancel(msg)
            refused.add(msg.message_id)
            return e
        led.acked.add(msg.message_id)
    return None


def _grow(mnt: str, size_kib: int) -> str:
    grown = _mount(["mount", "-o", f"remount,size={size_kib}k", mnt])
    return "" if grown.returncode == 0 else f"FAILED: could not grow the tmpfs: {grown.stderr.strip()}"


def _check(sp: Spool, led: Ledger, refused: set[int], when: str) -> str:
    res = check(sp, led)
    back = sorted(refused & set(listed(sp)))
    if not res.ok:
        return f"FAILED: {when}: {res.violations[:3]}"
    if back:
        return f"FAILED: {when}: messages refused with DiskFull are live: {[f'{m:X}' for m in back[:3]]}"
    return ""


def _fill_and_recover(mnt: str, size_kib: int) -> tuple[str, bool]:
    """Fill, grow and go on in the same process; fill again, reopen on the full disk; grow, reopen."""
    root = os.path.join(mnt, "spool")
    cfg = SpoolConfig(segment_size=64 * 1024, retry_intervals=(1.0,), checkpoint_interval=float("inf"))
    led = Ledger()
    rng = random.Random(7)
    refused: set[int] = set()
    sp = Spool.open(root, cfg)
    try:
        failure = _fill(sp, led, rng, refused)
        if failure is None or failure.errno != errno.ENOSPC:
            return f"FAILED: filling the disk ended with {failure!r}, not DiskFull(ENOSPC)", False
        first = len(led.acked)
        if sp.writer.poisoned is not None:
            return "FAILED: ENOSPC poisoned the log writer", False
        problem = _grow(mnt, size_kib * 2)
        if problem:
            return problem, False
        sp.commit()  # the kept batch (with the cancelled message, marked garbage) fits now
        failure = _fill(sp, led, rng, refused)
        if failure is None:
            return "FAILED: the grown disk never filled", False
        second = len(led.acked) - first
    finally:
        sp.close()  # as a crash would: what waited for room is gone
    sp = Spool.open(root, cfg, io=OsFileIO())  # recovery on the full disk
    try:
        problem = _check(sp, led, refused, "on the full disk")
    finally:
        sp.close()
    if problem:
        return problem, False
    problem = _grow(mnt, size_kib * 4)
    if problem:
        return problem, False
    sp = Spool.open(root, cfg)
    try:
        problem = _check(sp, led, refused, "after growing the disk")
    finally:
        sp.close()
    if problem:
        return problem, False
    return (f"tmpfs of {size_kib} KiB filled: {first} messages acknowledged, then a commit found no room "
            f"(DiskFull, the writer not poisoned); grown to {size_kib * 2} KiB the same spool went on "
            f"({second} more acknowledged before it was full again); reopened on the full disk; after growing it "
            f"every acknowledged message was there and none of the {len(refused)} refused ones"), True
