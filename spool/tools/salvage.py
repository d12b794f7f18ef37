"""``spoolctl salvage``: every readable message of a damaged spool copied into a new spool, under its old queue id.

Theory of operation. The relay starts on a damaged spool by itself; salvage is
for the operator who wants the mail out of a spool they no longer trust (a
disk that lies, a restore gone wrong) and into a fresh directory, offline. It
never writes to the old spool: it reads it only through the log reader
(``spool.read.reader``, anomalies as ``spool.read.anomaly`` names them), holding its lock
shared so that a relay cannot start on it meanwhile; and it writes the new one
only through the engine (``Spool.create``, ``SpoolCore.restore_message``), so
the new spool is what the engine itself writes: fresh segments, checksums, a
checkpoint. No byte of a segment is copied raw.

Two passes.

1. **Survey**: one walk of the whole log (envelopes, STARTs, DELIVERY and
   FINISH records; bodies checked, not copied) gathers what the log says of
   each message, by queue id (an envelope's ``message_id``): its latest
   envelope and the attempt on it. A later envelope of the same message
   replaces what was known; a FINISH with no replacement, or a final outcome
   for every recipient, ends it. Garbage marks are believed only where no
   record says more: a mark is written after its START is durable, and the
   flags byte is outside the checksum. What is left is the queue:

   - an envelope that nothing started: queued (or held) as it is;
   - an attempt with no FINISH: in flight at a crash, or its end lies in the
     damage. Carried on as recovery would (``spool.engine.recovery``): the
     recipients without a final outcome, same class and attempt count, in
     doubt where a delivery attempt recorded no outcome at all;
   - a FINISH naming a replacement envelope that was never read: the
     replacement lies in the damage. Rebuilt from the envelope before it and
     the outcomes after it, with the class and attempt count a delivery
     attempt leaves (after an admin change or a held message's carry: held,
     for the operator to release);
   - an envelope marked garbage that nothing started: withdrawn (its commit
     failed and the client was told to try again) when the log after it is
     whole. When damage follows it, its START may be lost with the message's
     fate: it is copied with every recipient in doubt, and listed.

2. **Copy**, in log order, so that record times stay in order: each message's
   body read chunk by chunk at its positions (through the same reader,
   checksums verified), then its envelope appended with its class and the
   time its envelope was appended (the new spool's clock replays the old
   times), so a deferred message is due when it was due and a held one stays
   held. A body that cannot be read whole loses its message, named with
   queue id, sender, recipients and the damaged range that took it.

Queue ids: a message keeps its ``message_id``. The new log begins at a segment
past every position the old spool used, so no id the new spool hands out can
equal a salvaged one (docs/design.md, "Salvage").

Memory: the survey keeps one entry per message still queued (its envelope's
payload, and the outcomes of its attempt): it grows with the queue, unlike the
relay; salvage is an offline, one-off tool. The copy holds one body at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from typing import Any, Final

import attrs

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.errors import CorruptRecord, FormatVersionError, SpoolLocked
from spool.fileio import FileIO, OsFileIO
from spool.format import checkpoint as ckpt
from spool.format.record import (
    HELD_CLASS,
    Delivery,
    Envelope,
    Finish,
    Frame,
    RecordType,
    Start,
    StartKind,
    Status,
    decode_payload,
    format_id,
    format_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import LogReader, bad_payload
from spool.tools.inspection import BadArgument, LogFiles

SURVEYED: Final = frozenset({RecordType.ENVELOPE, RecordType.START, RecordType.DELIVERY, RecordType.FINISH})
# Reads of one record at a known position (body chunks) read this much at least: a small window, since
# most reads are one small frame.
POINT_WINDOW: Final = 16 * 1024
MAX_OLDER: Final = 4  # earlier copies of a body kept as a fallback, per message


class TargetNotUsable(BadArgument):
    """NEWDIR cannot receive a salvaged spool: not empty, not a directory, or inside DIR."""


# -- the report -----------------------------------------------------------------------------


@attrs.frozen
class Loss:
    """A message that could not be copied whole: lost, or copied with what could be rebuilt (``saved``)."""

    queue_id: str
    sender: str
    recipients: tuple[str, ...]
    saved: bool
    reason: str
    damage: tuple[Anomaly, ...] = ()

    def describe(self) -> str:
        what = "partly lost" if self.saved else "lost"
        to = ", ".join(self.recipients) or "(no recipient left)"
        where = "".join(f"; {_range(a)}" for a in self.damage)
        return f"{what:<12} {self.queue_id} from <{self.sender}> to {to}: {self.reason}{where}"

    def as_dict(self) -> dict[str, Any]:
        return {"queue_id": self.queue_id, "sender": self.sender, "recipients": list(self.recipients),
                "saved": self.saved, "reason": self.reason, "damage": [a.as_dict() for a in self.damage]}


def _range(a: Anomaly) -> str:
    if a.kind is Kind.MISSING_SEGMENT:
        return f"{a.path}: missing"
    return f"{a.path} bytes {a.offset}..{a.offset + a.length - 1}" if a.length else f"{a.path} at {a.offset}"


@attrs.define
class SalvageReport:
    """What a salvage copied, what it could not, and the damage it met."""

    source: str
    into: str
    first_segment: int = 0  # the new log's first segment: ids the new spool hands out begin there
    copied: int = 0  # messages in the new spool (whole, rebuilt, or uncertain)
    in_doubt: int = 0  # recipients copied in doubt
    withdrawn: int = 0  # envelopes withdrawn before they were acknowledged (not copied)
    lost: list[Loss] = attrs.field(factory=list)
    damage: list[Anomaly] = attrs.field(factory=list)  # every anomaly that may have held records
    notes: list[str] = attrs.field(factory=list)  # a torn tail, a damaged header, a damaged checkpoint: no loss

    @property
    def complete(self) -> bool:
        """Everything saved: no message lost or rebuilt, and no damaged range that may have held one."""
        return not self.lost and not self.damage

    def lines(self) -> list[str]:
        out = [loss.describe() for loss in self.lost]
        out += [f"{'damage':<12} {_range(a)}: {a.kind.value}: {a.message()}" for a in self.damage]
        out += [f"{'note':<12} {n}" for n in self.notes]
        whole = sum(1 for loss in self.lost if not loss.saved)
        ranges = f"{len(self.damage)} damaged range" + ("" if len(self.damage) == 1 else "s")
        out.append(f"salvaged {self.source} into {self.into}: {self.copied} messages copied "
                   f"({len(self.lost) - whole} of them partly lost), {whole} lost, {ranges}; {self.in_doubt} "
                   f"recipients in doubt; {self.withdrawn} withdrawn messages left out; "
                   f"queue ids kept, new ones begin at segment {self.first_segment}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "into": self.into, "complete": self.complete,
                "first_segment": self.first_segment, "copied": self.copied, "in_doubt": self.in_doubt,
                "withdrawn": self.withdrawn, "lost": [loss.as_dict() for loss in self.lost],
                "damage": [a.as_dict() for a in self.damage], "notes": self.notes}


# -- pass 1: the survey -------------------------------------------------------------------------


@attrs.define(slots=True)
class _Trail:
    """What the log says of one message so far: its latest envelope and the attempt on it."""

    env_pos: int  # position of its latest envelope (for a rebuilt one: where the lost one lay)
    klass: int
    time: int  # seconds: when that envelope was appended
    garbage: bool
    payload: bytes  # the latest envelope that could be read
    start: int | None = None
    kind: StartKind = StartKind.DELIVERY
    outcomes: dict[str, Status] = attrs.field(factory=dict)
    rebuilt: Envelope | None = None  # past a replacement that was never read
    rebuilt_from: int = 0
    older: tuple[tuple[int, ...], ...] = ()  # earlier copies of its body, newest first (a fallback)

    def envelope(self) -> Envelope:
        if self.rebuilt is not None:
            return self.rebuilt
        env = decode_payload(RecordType.ENVELOPE, self.payload)
        assert isinstance(env, Envelope)
        return env

    def remaining(self, env: Envelope) -> list[str]:
        """Recipients without a final outcome in the attempt on it."""
        return [r for r in env.recipients if r not in self.outcomes or not self.outcomes[r].final]


@attrs.frozen
class _Entry:
    """One message to copy: its envelope as it goes on, class and time; and its line if not whole."""

    pos: int
    envelope: Envelope
    klass: int
    time: int
    loss: Loss | None = None
    older: tuple[tuple[int, ...], ...] = ()  # earlier copies of the body


class _Survey:
    def __init__(self, reader: LogReader, config: SpoolConfig) -> None:
        self.reader = reader
        self.config = config
        self.trails: dict[int, _Trail] = {}
        self.by_envelope: dict[int, int] = {}  # position of a message's latest envelope -> message id
        self.by_start: dict[int, int] = {}  # position of the START on it -> message id
        self.damage: list[Anomaly] = []
        self.notes: list[str] = []
        self.max_pos = 0
        self.withdrawn = 0  # envelopes withdrawn before they were acknowledged (``queue``)

    def run(self) -> None:
        for item in self.reader.read(types=SURVEYED):
            if isinstance(item, Anomaly):
                self.anomaly(item)
                continue
            self.max_pos = max(self.max_pos, item.pos)
            try:
                payload = decode_payload(item.rtype, item.payload)
            except CorruptRecord as exc:
                self.damage.append(bad_payload(item, self.reader.path(pos_segment(item.pos)), exc))
                continue
            if isinstance(payload, Envelope):
                self.envelope(item, payload)
            elif isinstance(payload, Start):
                self.start(item.pos, payload)
            elif isinstance(payload, Delivery):
                self.delivery(payload)
            elif isinstance(payload, Finish):
                self.finish(item, payload)

    def anomaly(self, a: Anomaly) -> None:
        if a.kind is Kind.TORN_TAIL:
            self.notes.append(f"{a.path} bytes {a.offset}..{a.offset + a.length - 1}: torn tail of an interrupted "
                              "write (never acknowledged): not copied")
        elif a.kind is Kind.BAD_HEADER and a.length == SEGMENT_HEADER_SIZE:  # (shorter: nothing follows it)
            self.notes.append(f"{a.path}: damaged segment header ({a.reason}); its records were read")
        elif a.kind is Kind.SIZE_MISMATCH and not self._truncated(a):
            self.notes.append(f"{a.path}: {a.reason}; the bytes past its sealed size are not part of the log")
        else:
            self.damage.append(a)

    def _truncated(self, a: Anomaly) -> bool:
        try:
            return self.reader.size(a.segment) <= a.offset
        except FileNotFoundError:
            return True

    def _forget(self, t: _Trail) -> None:
        self.by_envelope.pop(t.env_pos, None)
        if t.start is not None:
            self.by_start.pop(t.start, None)

    def envelope(self, frame: Frame, env: Envelope) -> None:
        mid = env.message_id
        old = self.trails.get(mid)
        older: tuple[tuple[int, ...], ...] = ()
        if old is not None:
            self._forget(old)
            # A replacement may have copied the body forward (``SpoolCore._localise``): the earlier copy,
            # while its segment is kept, can stand in for a damaged one.
            older = tuple(b for b in (old.envelope().body, *old.older) if b != env.body)[:MAX_OLDER]
        self.trails[mid] = _Trail(frame.pos, frame.klass, frame.time, frame.garbage, frame.payload, older=older)
        self.by_envelope[frame.pos] = mid

    def start(self, pos: int, start: Start) -> None:
        # An envelope that was not read: damaged (the damage list names it), or in a segment reclaimed
        # behind the garbage prefix (its message ended, or goes on in a later envelope).
        mid = self.by_envelope.get(start.envelope)
        if mid is None:
            return
        t = self.trails[mid]
        if t.start is not None:
            self.by_start.pop(t.start, None)
        t.start, t.kind, t.outcomes = pos, start.kind, {}
        self.by_start[pos] = mid

    def delivery(self, d: Delivery) -> None:
        mid = self.by_start.get(d.start)
        if mid is not None:
            outcomes = self.trails[mid].outcomes
            for o in d.outcomes:
                outcomes[o.recipient] = o.status

    def finish(self, frame: Frame, fin: Finish) -> None:
        # A FINISH whose replacement was read finds no entry: the replacement took its place before it.
        mid = self.by_start.get(fin.start)
        if mid is None:
            return
        t = self.trails.pop(mid)
        self._forget(t)
        env = t.envelope()
        remaining = t.remaining(env)
        if fin.replacement is None or not remaining:
            return  # the message is done
        # Its replacement envelope was never read: rebuild it from this one and the attempt's outcomes.
        if t.kind is StartKind.DELIVERY and t.klass != HELD_CLASS:
            klass, attempts, held = self.config.next_class(t.klass), env.attempts + 1, False
        elif t.kind is StartKind.RECOVERY:
            klass, attempts, held = t.klass, env.attempts, env.held
        else:  # an admin change (hold, release, flush: which one is lost) or a held message carried forward
            klass, attempts, held = HELD_CLASS, env.attempts, True
        rebuilt = attrs.evolve(env, recipients=tuple(remaining), attempts=attempts, held=held,
                               in_doubt=tuple(r for r in env.in_doubt if r in remaining))
        self.trails[mid] = _Trail(fin.replacement, klass, frame.time, False, t.payload, rebuilt=rebuilt,
                                  rebuilt_from=t.rebuilt_from or t.env_pos, older=t.older)
        self.by_envelope[fin.replacement] = mid

    # -- what is left: the queue ----------------------------------------------------------------------

    def covering(self, pos: int) -> tuple[Anomaly, ...]:
        """The damaged ranges that hold ``pos``."""
        seg, off = pos_segment(pos), pos_offset(pos)
        return tuple(a for a in self.damage if a.segment == seg and (
            a.kind is Kind.MISSING_SEGMENT or a.offset <= off < a.offset + max(a.length, 1)))

    def after(self, pos: int) -> tuple[Anomaly, ...]:
        """The damaged ranges that begin after ``pos``: where a message's later records may have been."""
        return tuple(a for a in self.damage if a.pos > pos)

    def queue(self, garbage_end: int) -> Iterator[_Entry]:
        """The messages to copy, in log order (each entry leaves the survey as it is handed out, so memory
        falls as the copy goes on); ``withdrawn`` counts those left out."""
        for _pos, mid in sorted((t.env_pos, mid) for mid, t in self.trails.items()):
            t = self.trails.pop(mid)
            entry = self._entry(mid, t, t.envelope(), garbage_end)
            if entry is not None:
                yield entry
            elif t.start is None:
                self.withdrawn += 1

    def _entry(self, mid: int, t: _Trail, env: Envelope, garbage_end: int) -> _Entry | None:
        qid = format_id(mid)
        loss: Loss | None = None
        if t.start is not None:
            remaining = t.remaining(env)
            if not remaining:
                return None  # every recipient has its final outcome; only the FINISH is missing
            doubt = [r for r in env.recipients if r not in t.outcomes] if t.kind is StartKind.DELIVERY else []
            env = attrs.evolve(env, recipients=tuple(remaining),
                               in_doubt=tuple(r for r in dict.fromkeys(env.in_doubt + tuple(doubt)) if r in remaining))
            later = self.after(t.start)
            if later:
                loss = Loss(qid, env.sender, env.recipients, True,
                            f"an attempt on it began at {format_pos(t.start)} and its end is not in the log (it may "
                            "lie in the damage): copied as recovery would carry it on, recipients without an outcome "
                            "in doubt", later[:1])
        elif t.rebuilt is None and (t.garbage or t.env_pos < garbage_end):
            later = self.after(t.env_pos)
            if not later:
                return None  # withdrawn before it was acknowledged
            env = attrs.evolve(env, in_doubt=env.recipients)
            loss = Loss(qid, env.sender, env.recipients, True,
                        f"its envelope at {format_pos(t.env_pos)} is marked as taken up (for delivery or by an admin "
                        "change) but no record of what followed is in the log (it may lie in the damage): copied as "
                        "it was before, every recipient in doubt",
                        later[:1])
        if t.rebuilt is not None:
            loss = Loss(qid, env.sender, env.recipients, True,
                        f"its envelope at {format_pos(t.env_pos)} is damaged: rebuilt from the envelope at "
                        f"{format_pos(t.rebuilt_from)} and the outcomes recorded after it (class {t.klass}, "
                        f"{env.attempts} attempts{', held' if env.held else ''}: what the lost one most likely said)",
                        self.covering(t.env_pos))
        return _Entry(t.env_pos, env, t.klass, t.time, loss, t.older)


# -- pass 2: the copy ---------------------------------------------------------------------------


class ReplayClock:
    """The new spool's clock while records are copied: the time each was first appended (then real time)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def read_at(reader: LogReader, pos: int) -> Frame | Anomaly | None:
    """The record at ``pos`` through the log reader: the frame, or the anomaly that stands where it should
    begin, or None when its segment is gone (reclaimed)."""
    walk = iter(reader.segment(pos_segment(pos), pos_offset(pos)))
    try:
        for item in walk:
            if isinstance(item, Anomaly):
                if item.kind is Kind.BAD_HEADER:
                    continue  # the header alone: the frames of the segment are still read
                return item
            return item if item.pos == pos else None
        return None
    finally:
        close = getattr(walk, "close", None)
        if close is not None:
            close()


class _Copier:
    def __init__(self, survey: _Survey, point: LogReader, sp: Spool, clock: ReplayClock,
                 report: SalvageReport) -> None:
        self.survey = survey
        self.point = point
        self.sp = sp
        self.clock = clock
        self.report = report
        self.damage_at: tuple[Anomaly, ...] = ()  # where the last body that could not be read is damaged

    def copy(self, entry: _Entry) -> None:
        env = entry.envelope
        body = self.body(env.body, env.body_size)
        if isinstance(body, str):
            for chunks in entry.older:
                earlier = self.body(chunks, env.body_size)
                if not isinstance(earlier, str):
                    self.report.notes.append(f"{format_id(env.message_id)}: {body}; copied from an earlier copy of "
                                             f"its body at {format_pos(chunks[0])}")
                    body = earlier
                    break
            else:
                self._lose(entry, body, self.damage_at)
                return
        self.clock.now = max(self.clock.now, entry.time)
        self.sp.restore_message(env, entry.klass, body)
        self.report.copied += 1
        self.report.in_doubt += len(env.in_doubt)
        if entry.loss is not None:
            self.report.lost.append(entry.loss)

    def body(self, chunks: tuple[int, ...], size: int) -> list[bytes] | str:
        """The body at ``chunks``, every chunk checked; or why it cannot be read (``damage_at`` names where)."""
        body: list[bytes] = []
        self.damage_at = ()
        for p in chunks:
            item = read_at(self.point, p)
            if isinstance(item, Frame) and item.rtype == RecordType.DATA:
                body.append(item.payload)
                continue
            covering = self.survey.covering(p)
            if covering:
                why, self.damage_at = "damaged", covering
            elif isinstance(item, Anomaly):
                why, self.damage_at = "damaged", (item,)
            elif item is None:
                why = f"gone (segment {pos_segment(p)} was reclaimed)"
            else:
                why = "not a body chunk"
            return f"its body chunk at {format_pos(p)} is {why}"
        got = sum(len(c) for c in body)
        return body if got == size else f"its body is {got} bytes, its envelope says {size}"

    def _lose(self, entry: _Entry, reason: str, damage: tuple[Anomaly, ...]) -> None:
        env = entry.envelope
        self.report.lost.append(Loss(format_id(env.message_id), env.sender, env.recipients, False, reason,
                                     damage))


# -- the command --------------------------------------------------------------------------------


@contextlib.contextmanager
def shared_lock(path: str) -> Iterator[None]:
    """Hold ``path``'s spool lock shared for the salvage: a relay that starts meanwhile is refused, and a
    running one refuses us. Never creates the lock file (the source is not written).

    Raises SpoolLocked.
    """
    try:
        fd = os.open(os.path.join(path, "lock"), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield  # no process ever opened it for writing
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SpoolLocked(f"{path}: a relay (or another process) has this spool open; stop it first: "
                              "salvage reads a spool offline") from None
        yield
    finally:
        os.close(fd)


def check_target(source: str, into: str) -> None:
    """Raises TargetNotUsable unless ``into`` is a new or empty directory outside ``source``."""
    real_src, real_into = os.path.realpath(source), os.path.realpath(into)
    if real_into == real_src or real_into.startswith(real_src + os.sep):
        raise TargetNotUsable(f"{into}: the new spool must lie outside {source} (salvage never writes there)")
    if os.path.exists(into):
        if not os.path.isdir(into):
            raise TargetNotUsable(f"{into}: not a directory")
        if os.listdir(into):
            raise TargetNotUsable(f"{into}: not empty; salvage writes only into a new or empty directory")


def salvage(source: str, into: str, config: SpoolConfig | None = None, io: FileIO | None = None) -> SalvageReport:
    """Copy every readable message of the spool ``source`` into a new spool ``into``. See the module docstring.

    ``config``: the new spool's settings (its segment size) and the retry classes
    (a rebuilt envelope's class). Never writes to ``source``.

    Raises TargetNotUsable, SpoolLocked, NotASpool (``spool.tools.inspection``), OSError.
    """
    config = config or SpoolConfig()
    io = io or OsFileIO()
    check_target(source, into)
    with shared_lock(source):
        files = LogFiles.open(source, io)
        report = SalvageReport(source, into)
        cp = _checkpoint(files, report)
        survey = _Survey(files.reader(cp), config)
        survey.run()
        report.damage = survey.damage
        report.notes += survey.notes
        report.first_segment = 1 + max(files.last, pos_segment(survey.max_pos),
                                       pos_segment(cp.head) if cp is not None else 0,
                                       pos_segment(max(survey.trails, default=0)))
        clock = ReplayClock(min((t.time for t in survey.trails.values()), default=time.time()))
        point = LogReader(io, files.log_dir, segments=files.segments, durable=cp.head if cp is not None else None,
                          window=POINT_WINDOW)
        os.makedirs(into, exist_ok=True)
        sp = Spool.create(into, attrs.evolve(config, clock=clock), io, first_segment=report.first_segment)
        try:
            copier = _Copier(survey, point, sp, clock, report)
            for entry in survey.queue(cp.garbage_end if cp is not None else 0):
                copier.copy(entry)
            clock.now = max(clock.now, time.time())
            sp.checkpoint()  # commits everything copied, then the restart positions
        finally:
            sp.close()
        report.withdrawn = survey.withdrawn
    report.lost.sort(key=lambda loss: (loss.saved, loss.queue_id))
    return report


def _checkpoint(files: LogFiles, report: SalvageReport) -> ckpt.Checkpoint | None:
    try:
        return files.load_checkpoint()
    except (CorruptRecord, FormatVersionError) as exc:
        report.notes.append(f"{os.path.join(files.path, ckpt.NAME)}: {getattr(exc, 'reason', exc)}; "
                            "ignored: the whole log was read")
        return None

