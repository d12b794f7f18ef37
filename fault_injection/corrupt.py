"""Corrupted bytes: bit flips, zeroed ranges and truncations in the files of a real spool.

``python -m fault_injection corrupt [--cases N] [--seed S]``

The fixture is a spool made by the engine (the ``deliver`` workload, then one
reopen so that the checkpoint's head covers the whole log) with its ledger.
Each case copies it, damages one file, opens it and delivers everything
(runners claim every live message and read every body, checksums verified).
Acceptable outcomes:

- *repaired*: the open succeeds and the ledger holds;
- *detected*: the open or the delivery raises a ``SpoolError`` subclass whose
  message names the file (and, for a ``CorruptRecord``, an offset).

Anything else fails the case: another exception type (a traceback), or a
*silent* loss — the open and delivery succeed but the ledger does not hold (an
acknowledged recipient missing, a recorded one back, a body changed).

Bit 0 of a frame's flags byte (the garbage mark) is outside the checksum by
design (it is set in place without fsync); flips of that bit are not
generated, and docs/reliability.md says what they do.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator

import attrs

from fault_injection import scratch_dir
from fault_injection.ledger import Ledger, claimed, judge
from fault_injection.recording import RecordingFileIO
from fault_injection.workloads import FakeClock, commit_logged, deliver, enqueue_logged, make_config
from spool.errors import CorruptRecord, SpoolError
from spool.record import FLAGS_OFFSET, HEADER, HEADER_SIZE
from spool.segment import SEGMENT_HEADER_SIZE
from spool.spool import Spool

KINDS = ("bitflip", "zero", "truncate")
CASE_SECONDS = 5.0


class Hang(Exception):
    """A case ran past its deadline: the engine looped on the damaged bytes."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise Hang in this (main) thread after ``seconds``; a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise Hang(f"no answer within {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@attrs.frozen
class Mutation:
    path: str  # relative to the spool directory
    kind: str
    offset: int
    length: int = 0  # zero: bytes zeroed; truncate: unused
    bit: int = 0

    def text(self) -> str:
        if self.kind == "bitflip":
            return f"flip bit {self.bit} of {self.path} at {self.offset}"
        if self.kind == "zero":
            return f"zero {self.length} bytes of {self.path} at {self.offset}"
        return f"truncate {self.path} to {self.offset} bytes"

    def apply(self, root: str) -> None:
        path = os.path.join(root, self.path)
        with open(path, "r+b") as fh:
            if self.kind == "truncate":
                fh.truncate(self.offset)
                return
            fh.seek(self.offset)
            if self.kind == "zero":
                fh.write(bytes(self.length))
            else:
                b = fh.read(1)
                fh.seek(self.offset)
                fh.write(bytes([b[0] ^ (1 << self.bit)]))


@attrs.define
class Fixture:
    root: str
    ledger: Ledger
    end_time: float
    files: dict[str, bytes]
    flag_offsets: dict[str, set[int]]

    @classmethod
    def build(cls, workdir: str, seed: int = 0) -> Fixture:
        root = os.path.join(workdir, "fixture")
        os.makedirs(root)
        clock = FakeClock()
        rec = deliver(root, seed, clock, steps=24)
        clock.advance(5)
        # then a backlog of queued mail, so that damage mostly lands on live records
        rio = RecordingFileIO(root, rec)
        sp = Spool.open(root, make_config(clock), io=rio)
        try:
            rng = random.Random(seed)
            for _ in range(12):
                enqueue_logged(sp, rio, rng, 700)
                enqueue_logged(sp, rio, rng, 300)
                commit_logged(sp, rio)
        finally:
            sp.close()
        Spool.open(root, make_config(clock)).close()  # the recovery's checkpoint covers the whole log
        os.remove(os.path.join(root, "lock"))
        files: dict[str, bytes] = {}
        for dirpath, _, names in os.walk(root):
            for name in names:
                full = os.path.join(dirpath, name)
                with open(full, "rb") as fh:
                    files[os.path.relpath(full, root)] = fh.read()
        flags = {p: _flag_offsets(data) for p, data in files.items() if p.endswith(".seg")}
        return cls(root, Ledger.from_events(rec.events()), clock.now, files, flags)

    def copy(self, dst: str) -> None:
        shutil.copytree(self.root, dst)


def _flag_offsets(data: bytes) -> set[int]:
    out = set()
    off = SEGMENT_HEADER_SIZE
    while off + HEADER_SIZE <= len(data):
        length = HEADER.unpack_from(data, off)[1]
        out.add(off + FLAGS_OFFSET)
        off += HEADER_SIZE + length
    return out


def random_mutation(fx: Fixture, rng: random.Random) -> Mutation:
    paths = sorted(fx.files)
    path = rng.choices(paths, weights=[max(64, len(fx.files[p])) for p in paths])[0]
    size = len(fx.files[path])
    kind = rng.choice(KINDS)
    if kind == "truncate":
        bounds = sorted(o - FLAGS_OFFSET for o in fx.flag_offsets.get(path, set()))
        if bounds and rng.random() < 0.5:
            return Mutation(path, kind, rng.choice(bounds))  # at a record boundary: looks like a clean end
        return Mutation(path, kind, rng.randrange(size))
    offset = rng.randrange(size)
    if kind == "zero":
        return Mutation(path, kind, offset, min(size - offset, rng.randint(1, 600)))
    bit = rng.randrange(8)
    if bit == 0 and offset in fx.flag_offsets.get(path, set()):
        bit = rng.randrange(1, 8)  # the garbage mark is outside the checksum by design
    return Mutation(path, kind, offset, 0, bit)


@attrs.define
class CaseOutcome:
    mutation: Mutation
    verdict: str  # "unchanged", "repaired", "detected" or "FAIL"
    detail: str = ""


def _names_file(exc: BaseException, root: str) -> bool:
    text = str(exc)
    if root not in text:
        return False
    if isinstance(exc, CorruptRecord):
        return bool(exc.path) and exc.offset >= 0
    return True


def try_mutation(fx: Fixture, mutations: list[Mutation], workdir: str) -> CaseOutcome:
    root = tempfile.mkdtemp(prefix="corrupt-", dir=workdir)
    os.rmdir(root)
    fx.copy(root)
    try:
        for m in mutations:
            m.apply(root)
        first = mutations[0]
        sp: Spool | None = None
        try:
            with deadline(CASE_SECONDS):
                sp = Spool.open(root, make_config(FakeClock(fx.end_time + 5)))
                res = judge(claimed(sp), fx.ledger)
        except Hang as exc:
            return CaseOutcome(first, "FAIL", f"hang: {exc} (open, or runners claiming everything)")
        except SpoolError as exc:
            if _names_file(exc, root):
                return CaseOutcome(first, "detected", f"{type(exc).__name__}: {exc}".replace(root + "/", ""))
            return CaseOutcome(first, "FAIL", f"{type(exc).__name__} does not name file and offset: {exc}")
        except Exception as exc:
            return CaseOutcome(first, "FAIL", f"{type(exc).__name__} (not a SpoolError): {exc}")
        finally:
            if sp is not None:
                sp.close()
        if not res.ok:
            return CaseOutcome(first, "FAIL", "silently lost or changed: " + "; ".join(res.violations[:3]))
        stats = sp.recovery_stats
        return CaseOutcome(first, "repaired" if stats.tail_cut_bytes else "unchanged",
                           f"tail cut {stats.tail_cut_bytes} bytes" if stats.tail_cut_bytes else "")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@attrs.define
class CorruptReport:
    outcomes: list[CaseOutcome] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return all(o.verdict != "FAIL" for o in self.outcomes)

    def lines(self) -> list[str]:
        out = [f"  FAIL {o.mutation.text()}: {o.detail}" for o in self.outcomes if o.verdict == "FAIL"]
        counts = Counter(o.verdict for o in self.outcomes)
        kinds = Counter(o.mutation.kind for o in self.outcomes)
        out.append(f"corrupt: {len(self.outcomes)} cases ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}): "
                   f"detected {counts['detected']}, repaired {counts['repaired']}, harmless {counts['unchanged']}, "
                   f"failed {counts['FAIL']}")
        return out


def run(cases: int = 40, seed: int = 0) -> CorruptReport:
    workdir = tempfile.mkdtemp(prefix="logspool-corrupt-", dir=scratch_dir())
    report = CorruptReport()
    try:
        fx = Fixture.build(workdir, seed)
        rng = random.Random(seed)
        for _ in range(cases):
            report.outcomes.append(try_mutation(fx, [random_mutation(fx, rng)], workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report
