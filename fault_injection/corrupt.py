"""Corrupted bytes: bit flips, zeroed ranges and truncations in the files of a real spool.

``python -m fault_injection corrupt [--cases N] [--seed S]``

The fixture is a spool made by the engine (the ``deliver`` workload, then one
reopen so that the checkpoint's head covers the whole log) with its ledger.
Each case copies it, damages one file, opens it (the default damage policy:
quarantine, name, go on) and delivers everything (runners claim every live
message and read every body, checksums verified). Acceptable outcomes:

- *harmless*: the open succeeds and the ledger holds;
- *repaired*: likewise, after a torn tail was cut;
- *detected*: the open and the delivery succeed, the damage is in the
  quarantine directory, and every acknowledged recipient that is gone was
  named lost there (by its queue id or, where no record gave the id, its
  address) or belongs to a message whose body read failed with DamagedBody
  (the relay bounces those). Nothing else may be lost.

Anything else fails the case: an exception from the open or the delivery
(the relay would be down, or the runner would die), or a *silent* loss: an
acknowledged recipient gone and not named, a recorded one back, a body
changed.

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
from collections.abc import Callable, Iterator

import attrs

from fault_injection import scratch_dir
from fault_injection.ledger import FAR_FUTURE, Found, Ledger, judge
from fault_injection.recording import RecordingFileIO
from fault_injection.workloads import FakeClock, commit_logged, deliver, enqueue_logged, make_config
from spool.damage.quarantine import read_entries
from spool.engine.spool import Spool
from spool.errors import DamagedBody
from spool.fileio import OsFileIO
from spool.format.record import (
    FLAGS_OFFSET,
    HEADER,
    HEADER_SIZE,
    Delivery,
    Envelope,
    Finish,
    RecordType,
    decode_payload,
    format_id,
    make_pos,
)
from spool.format.segment import SEGMENT_HEADER_SIZE
from spool.read.reader import LogReader

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
class LogMap:
    """What the fixture's log held, for telling a loss nothing could name from a silent one."""

    envelopes: dict[int, Envelope] = attrs.field(factory=dict)  # position -> envelope, in log order
    finished_by: dict[int, tuple[int, int]] = attrs.field(factory=dict)  # replacement -> (FINISH, START)
    deliveries: dict[int, list[int]] = attrs.field(factory=dict)  # START -> its DELIVERY records

    @classmethod
    def read(cls, root: str) -> LogMap:
        m = cls()
        io = OsFileIO()
        for frame in LogReader(io, os.path.join(root, "log")).frames():
            if frame.rtype == RecordType.DATA:
                continue
            payload = decode_payload(frame.rtype, frame.payload)
            if isinstance(payload, Envelope):
                m.envelopes[frame.pos] = payload
            elif isinstance(payload, Finish) and payload.replacement is not None:
                m.finished_by[payload.replacement] = (frame.pos, payload.start)
            elif isinstance(payload, Delivery):
                m.deliveries.setdefault(payload.start, []).append(frame.pos)
        return m

    def unnameable(self, mid: int, damaged: Callable[[int], bool]) -> bool:
        """Did the damage take every record that could name message ``mid`` (``spool.read.lost``'s rules)?

        Its live envelope (the last one) lies in the damage, and so does what
        would name it: for a new message, its body's first chunk; for a
        replacement, the FINISH after it and the START or DELIVERY records of
        the attempt that wrote it.
        """
        live = [(pos, env) for pos, env in self.envelopes.items() if env.message_id == mid]
        if not live:
            return False
        pos, env = live[-1]
        if not damaged(pos):
            return False
        if env.replaces is None:
            return not env.body or damaged(env.body[0])
        fin, start = self.finished_by.get(pos, (None, None))
        if fin is None or start is None or not damaged(fin):
            return False
        return damaged(start) or all(damaged(d) for d in self.deliveries.get(start, []))


@attrs.define
class Fixture:
    root: str
    ledger: Ledger
    end_time: float
    files: dict[str, bytes]
    flag_offsets: dict[str, set[int]]
    log: LogMap = attrs.field(factory=LogMap)

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
        return cls(root, Ledger.from_events(rec.events()), clock.now, files, flags, LogMap.read(root))

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
    named: int = 0  # messages lost and named
    unnameable: int = 0  # messages lost with every record that could name them
    bodies: int = 0  # messages whose body read failed (the relay bounces them)


def claimed_or_damaged(sp: Spool) -> tuple[Found, set[int]]:
    """``ledger.claimed``, where a body that cannot be read (DamagedBody: quarantined and named by the spool,
    bounced by the relay) marks its message instead of stopping the drain."""
    found: Found = {}
    damaged: set[int] = set()
    for _ in range(10_000):
        batch = sp.poll_due(now=FAR_FUTURE, limit=1000)
        if not batch:
            break
        for a in batch:
            try:
                body = b"".join(sp.read_body(a.envelope))
            except DamagedBody:
                damaged.add(a.message_id)
                continue
            if a.envelope.extra.get("damaged_body"):
                damaged.add(a.message_id)
                continue
            found.setdefault(a.message_id, []).append((a.envelope.recipients, body))
    return found, damaged


@attrs.define
class Named:
    """What the quarantine notes say: messages named lost, and the damaged ranges."""

    ids: set[str] = attrs.field(factory=set)
    rcpts: set[str] = attrs.field(factory=set)  # where no record gave the queue id
    notes: int = 0  # notes other than torn tails
    ranges: list[tuple[int, int]] = attrs.field(factory=list)  # positions [lo, hi) the damage took

    def damaged(self, pos: int) -> bool:
        return any(lo <= pos < hi for lo, hi in self.ranges)


def named_lost(root: str) -> Named:
    named = Named()
    for entry in read_entries(OsFileIO(), root):
        note = entry.note
        if not entry.name.endswith("torn-tail"):
            named.notes += 1
        seg = note.get("segment")
        if isinstance(seg, int):
            if note.get("kind") == "missing segment":
                named.ranges.append((make_pos(seg, 0), make_pos(seg + 1, 0)))
            else:
                off = int(note.get("offset") or 0)
                named.ranges.append((make_pos(seg, off), make_pos(seg, off + int(note.get("length") or 0))))
        for m in entry.lost:
            if m.get("queue_id"):
                named.ids.add(str(m["queue_id"]))
            else:
                named.rcpts.update(str(r) for r in m.get("recipients") or [])
    return named


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
                found, damaged = claimed_or_damaged(sp)
                res = judge(found, fx.ledger)
        except Hang as exc:
            return CaseOutcome(first, "FAIL", f"hang: {exc} (open, or runners claiming everything)")
        except Exception as exc:
            return CaseOutcome(first, "FAIL", f"{type(exc).__name__} (the relay would stop): {exc}".replace(
                root + "/", ""))
        finally:
            if sp is not None:
                sp.close()
        named = named_lost(root)
        unnamed = [(mid, r) for mid, r in res.lost
                   if format_id(mid) not in named.ids and r not in named.rcpts and mid not in damaged]
        gone = {mid for mid, _ in unnamed if fx.log.unnameable(mid, named.damaged)}
        silent = [(mid, r) for mid, r in unnamed if mid not in gone]
        others = [v for v in res.violations if " was lost" not in v]
        if silent or others:
            unnamed_lines = [f"acknowledged message {mid:X} recipient {r} was lost, not named" for mid, r in silent]
            return CaseOutcome(first, "FAIL", "silently lost or changed: " + "; ".join((unnamed_lines + others)[:3]))
        if named.notes or damaged:
            lost = len({m for m, _ in res.lost} - damaged) - len(gone)
            return CaseOutcome(first, "detected", f"{named.notes} quarantined; lost: {lost} messages named, "
                                                  f"{len(gone)} with every record in the damage; "
                                                  f"{len(damaged)} damaged bodies", lost, len(gone), len(damaged))
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
                   f"failed {counts['FAIL']}; messages lost and named {sum(o.named for o in self.outcomes)}, lost "
                   f"with every record that could name them {sum(o.unnameable for o in self.outcomes)}, damaged "
                   f"bodies {sum(o.bodies for o in self.outcomes)}")
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
