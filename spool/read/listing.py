"""Admin reads over the log in constant memory: list with filters and cursor, count, show, shape.

These are the ``page_read`` / ``size`` / ``match`` operations of the EMQX
retained-message design, applied to a log: every live message has exactly one
live envelope, and every live envelope lies between the garbage-prefix end and
the head. A listing walks that stretch once, decoding only live envelopes, and
keeps nothing but the page it returns. A message being delivered has its
envelope marked garbage; the (bounded) set of attempts in flight says which of
those are active.

Two orders. ``page`` is log order with a position cursor: cheap (it stops at
the page's end) and what the relay's own walks use (a full flush). The log is
not arrival order, though: every retry, hold and release writes the message's
envelope again at the head. ``oldest_first`` is what an operator lists: by
arrival time, with a cursor that is a message's (arrival, id) key, so a page
walks the whole live stretch and keeps the ``limit`` oldest after the cursor
in a bounded heap (memory: one page, whatever the queue holds), counting the
totals on the way. The key of a message never changes, so a hold or release
between two pages neither repeats nor skips it (docs/design.md, "Queue
listings: oldest first in constant memory").

``outcomes`` reads one message's history: the last outcome of each recipient
that the log still holds.

Two sources: the writable ``Spool`` (inside the relay, or offline), and
``SpoolView``, a read-only look at a spool another process may be writing
(the CLI's ``spoolctl``), which never takes the lock and never repairs.

Both read through the log reader (``spool.read.reader``), every frame checked: a
listing meets the same anomalies, at the same segment and offset, as
``spoolctl verify`` does, and hands each to the source's damage reporter
(``Listable.damage_reporter``): the writable spool's quarantines and names it
and the listing goes on (an admin read never fails on damage); the read-only
view's raises the first it meets (CorruptSegment, or FormatVersionError for a
newer segment), since it may not write a quarantine.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Iterator, Mapping
from typing import Protocol

import attrs

from spool.errors import CorruptRecord, NotFound
from spool.fileio import FileIO, OsFileIO
from spool.format import checkpoint as ckpt
from spool.format.record import (
    HELD_CLASS,
    Delivery,
    Envelope,
    Finish,
    Frame,
    Outcome,
    RecordType,
    Start,
    decode_payload,
    format_id,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, list_segments, read_frame_at, segment_path
from spool.read.reader import LogReader, Reporter, bad_payload, raise_anomaly


class LogSource(Protocol):
    """Where a listing reads: the log directory, and how far its records are durable."""

    io: FileIO
    log_dir: str

    @property
    def durable_end(self) -> int: ...

    def read_frame(self, pos: int) -> Frame: ...


@attrs.frozen
class LiveMessage:
    pos: int
    klass: int
    envelope: Envelope
    state: str  # "queued", "held" or "active"
    appended: int  # seconds since the epoch when this envelope was written

    @property
    def message_id(self) -> int:
        return self.envelope.message_id

    @property
    def queue_id(self) -> str:
        return format_id(self.envelope.message_id)

    @property
    def held(self) -> bool:
        return self.klass == HELD_CLASS or self.envelope.held

    def age(self, now: float) -> float:
        return max(0.0, now - self.envelope.arrival_ms / 1000)


@attrs.frozen
class Filter:
    sender: str | None = None
    recipient: str | None = None
    domain: str | None = None
    min_age: float | None = None
    max_age: float | None = None
    held: bool | None = None
    in_doubt: bool = False

    def match(self, m: LiveMessage, now: float) -> bool:
        env = m.envelope
        if self.sender is not None and env.sender.lower() != self.sender.lower():
            return False
        if self.recipient is not None and self.recipient.lower() not in (r.lower() for r in env.recipients):
            return False
        if self.domain is not None:
            d = self.domain.lower().lstrip("@")
            if not any(r.rpartition("@")[2].lower() == d for r in env.recipients):
                return False
        age = m.age(now)
        if self.min_age is not None and age < self.min_age:
            return False
        if self.max_age is not None and age > self.max_age:
            return False
        if self.held is not None and m.held != self.held:
            return False
        return not (self.in_doubt and not env.in_doubt)


class Listable(Protocol):
    """What a listing needs: where to read, where live data begins, what is in flight."""

    def source(self) -> LogSource: ...

    def live_start(self) -> int: ...

    def active(self) -> Mapping[int, object]: ...

    def damage_reporter(self) -> Reporter: ...


def iter_live(spool: Listable, flt: Filter | None = None, cursor: int | None = None,
              now: float | None = None) -> Iterator[LiveMessage]:
    """Live messages in log order from ``cursor`` (a position) on.

    Damage goes to the source's reporter (see the module docstring).

    On a running relay the log changes under the walk: an envelope rewritten
    meanwhile (a held message carried forward by the oldest runner, an admin
    change, a retry) is garbage at its old place once its replacement is
    durable, and the replacement lies past the durable end the walk began
    with. So the walk goes on to the durable end of the moment it got there,
    until it catches up (at most ``CATCH_UP_ROUNDS`` times): every message live
    throughout is met at least once, one rewritten behind the walk maybe twice
    (``oldest_first`` keeps it once).
    """
    flt = flt or Filter()
    now = time.time() if now is None else now
    src = spool.source()
    active = spool.active()
    start = max(spool.live_start(), cursor or 0)
    # What was appended before the walk began but may not be durable yet: a replacement whose old envelope lay
    # before ``start`` (the runners had passed it) is read once it is durable, not missed.
    appended = getattr(src, "head", None)
    wait = getattr(src, "wait_durable", None)
    end = src.durable_end
    reporter = spool.damage_reporter()
    for _ in range(CATCH_UP_ROUNDS):
        for frame in LogReader(src.io, src.log_dir, durable=end).frames(start, end, reporter):
            if frame.rtype != RecordType.ENVELOPE:
                continue
            if frame.garbage and frame.pos not in active:
                continue
            path = segment_path(src.log_dir, pos_segment(frame.pos))
            try:
                msg = _message(frame, active, path)
            except CorruptRecord as exc:  # whole, but its payload does not decode: damage of that record alone
                reporter(bad_payload(frame, path, exc))
                continue
            if flt.match(msg, now):
                yield msg
        if wait is not None and appended is not None and end < appended:
            wait(appended, SETTLE_TIMEOUT)  # one commit window on a running relay; never the loop's thread
            appended = None
        start, end = end, src.durable_end
        if end <= start:
            return


# Walks past the durable end a listing began with, to what became durable meanwhile (``iter_live``): under
# steady mail each round reads only what the last one took to read, so a few are enough to catch up.
CATCH_UP_ROUNDS = 8
# How long a walk waits for what was appended before it began to become durable: a group commit's window is
# milliseconds; past this (a disk that stalls) the walk ends with what it has.
SETTLE_TIMEOUT = 5.0


def _message(frame: Frame, active: Mapping[int, object], path: str) -> LiveMessage:
    try:
        env = decode_payload(RecordType.ENVELOPE, frame.payload)
    except CorruptRecord as exc:
        raise CorruptRecord(exc.reason, path, pos_offset(frame.pos)) from None
    assert isinstance(env, Envelope)
    if frame.pos in active:
        state = "active"
    elif frame.klass == HELD_CLASS or env.held:
        state = "held"
    else:
        state = "queued"
    return LiveMessage(frame.pos, frame.klass, env, state, frame.time)


def page(spool: Listable, flt: Filter | None = None, cursor: int | None = None, limit: int = 100,
         now: float | None = None) -> tuple[list[LiveMessage], int | None]:
    """One page and the cursor of the next (None at the end)."""
    out: list[LiveMessage] = []
    for msg in iter_live(spool, flt, cursor, now):
        if len(out) == limit:
            return out, msg.pos
        out.append(msg)
    return out, None


Key = tuple[int, int]  # (arrival_ms, message_id): a message's place in ``oldest_first``, fixed for its life


def arrival_key(msg: LiveMessage) -> Key:
    return msg.envelope.arrival_ms, msg.message_id


@attrs.frozen
class OldestPage:
    """One page in arrival order, and the totals of every message the filter matches (all pages)."""

    messages: list[LiveMessage]
    more: bool  # messages after the last one of this page match too
    total: int
    total_bytes: int


def oldest_first(spool: Listable, flt: Filter | None = None, after: Key | None = None, limit: int = 100,
                 now: float | None = None) -> OldestPage:
    """The ``limit`` oldest messages whose key is above ``after`` (None: from the oldest), oldest first.

    One walk of the live log; memory: ``limit`` + 1 messages in a heap, never
    the queue. A message met twice in one walk (its envelope rewritten while
    we read) is counted as the walk meets it, and a page holds it once.
    """
    heap: list[tuple[int, int, int, LiveMessage]] = []  # max-heap of the oldest by negated key (and position)
    total = total_bytes = 0
    for msg in iter_live(spool, flt, None, now):
        total += 1
        total_bytes += msg.envelope.body_size
        key = arrival_key(msg)
        if after is not None and key <= after:
            continue
        item = (-key[0], -key[1], -msg.pos, msg)
        if len(heap) <= limit:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    ordered = [m for *_, m in sorted(heap, reverse=True)]
    unique: list[LiveMessage] = []
    for m in ordered:
        if not unique or unique[-1].message_id != m.message_id:
            unique.append(m)
    return OldestPage(unique[:limit], len(unique) > limit, total, total_bytes)


def count(spool: Listable, flt: Filter | None = None, now: float | None = None) -> int:
    return sum(1 for _ in iter_live(spool, flt, None, now))


def find(spool: Listable, message_id: int) -> LiveMessage:
    """The live message with that queue id. Raises NotFound."""
    for msg in iter_live(spool):
        if msg.message_id == message_id:
            return msg
    raise NotFound(f"no queued message with id {format_id(message_id)}")


@attrs.frozen
class Tried:
    """A recipient's last outcome in the log, and when it was recorded."""

    outcome: Outcome
    time_ms: int


def outcomes(spool: Listable, msg: LiveMessage) -> dict[str, Tried]:
    """The last outcome of each recipient of ``msg`` that the log still holds (delivered ones included).

    One walk from the message's id (its first envelope's position, or for
    mail received over SMTP its first DATA record's, the first envelope with
    that id coming after it) or from the oldest segment left, following the
    message from envelope to
    START, to its DELIVERY records, and through each FINISH to the envelope
    that replaced it. Memory: the message's own attempts and recipients.
    The history is what is still on disk: segments reclaimed behind the
    oldest runner took older attempts with them, and damage is passed over
    here (the listing that found ``msg`` reports it).
    """
    src = spool.source()
    reader = LogReader(src.io, src.log_dir, durable=src.durable_end)
    if not reader.segments:
        return {}
    start = max(msg.message_id, make_pos(reader.segments[0], SEGMENT_HEADER_SIZE))
    envelopes = {msg.message_id, msg.pos}
    first_found = False  # mail received over SMTP: the id is its first DATA record, the envelope comes after it
    starts: set[int] = set()
    last: dict[str, Tried] = {}
    wanted = (RecordType.ENVELOPE, RecordType.START, RecordType.DELIVERY, RecordType.FINISH)
    for frame in reader.frames(start, src.durable_end, _pass_over, types=wanted):
        if frame.rtype == RecordType.ENVELOPE and (first_found or frame.pos in envelopes):
            first_found = True  # later envelopes of the message are found through its FINISH records
            continue
        try:
            record = decode_payload(frame.rtype, frame.payload)
        except CorruptRecord:
            continue
        if isinstance(record, Envelope):
            if record.message_id == msg.message_id:
                envelopes.add(frame.pos)
                first_found = True
        elif isinstance(record, Start) and record.envelope in envelopes:
            starts.add(frame.pos)
        elif isinstance(record, Delivery) and record.start in starts:
            for o in record.outcomes:
                last[o.recipient] = Tried(o, record.time_ms)
        elif isinstance(record, Finish) and record.start in starts and record.replacement is not None:
            envelopes.add(record.replacement)
    return last


def _pass_over(_anomaly: object) -> None:
    """A history is best effort: damage is reported by the listing and by ``spoolctl verify``."""


AGE_BUCKETS = (300, 600, 1200, 2400, 4800, 9600, 19200, 38400, 76800, float("inf"))


def shape(spool: Listable, now: float | None = None, top: int = 20) -> list[tuple[str, int, list[int]]]:
    """Queued messages by recipient domain and age bucket (minutes), as Postfix's qshape.

    Memory grows with the number of distinct domains, not messages.
    """
    now = time.time() if now is None else now
    table: dict[str, list[int]] = {}
    for msg in iter_live(spool, None, None, now):
        age = msg.age(now)
        bucket = next(i for i, b in enumerate(AGE_BUCKETS) if age < b)
        for domain in {r.rpartition("@")[2].lower() for r in msg.envelope.recipients}:
            table.setdefault(domain, [0] * len(AGE_BUCKETS))[bucket] += 1
    rows = sorted(table.items(), key=lambda kv: -sum(kv[1]))
    head = rows[:top]
    result = [(d, sum(c), c) for d, c in head]
    if len(rows) > top:
        rest = [sum(c[i] for _, c in rows[top:]) for i in range(len(AGE_BUCKETS))]
        result.append(("(others)", sum(rest), rest))
    return result


# -- a read-only view for processes that do not own the spool ----------------


def active_attempts(reader: LogReader, begin: int | None, end: int | None) -> dict[int, int]:
    """Envelope position -> START position of the attempts in flight (a START without a FINISH).

    Only the working suffix (from ``begin``, the checkpoint's working start;
    None: the whole log) can hold an unfinished START, so only it is read. Damaged records are
    passed over here: the listing or ``spoolctl verify`` reports them.
    """
    starts: dict[int, int] = {}
    for item in reader.read(begin, end):
        if not isinstance(item, Frame) or item.rtype not in (RecordType.START, RecordType.FINISH):
            continue
        try:
            payload = decode_payload(item.rtype, item.payload)
        except CorruptRecord:
            continue
        if isinstance(payload, Start):
            starts[item.pos] = payload.envelope
        elif isinstance(payload, Finish):
            starts.pop(payload.start, None)
    return {env: start for start, env in starts.items()}


class SpoolView:
    """Read a spool without its lock: no recovery, no repair, no writes.

    The end of the log is where the reader says it is (``LogReader.log_end``):
    the end of the last segment, or the start of its torn tail (a writer may be
    appending right now). Damaged records before it are not an end: a listing
    walks into them and reports them. In-flight attempts are the STARTs
    without a FINISH in the working suffix.
    """

    def __init__(self, path: str, io: FileIO | None = None) -> None:
        self.path = path
        self.io = io or OsFileIO()
        self.log_dir = os.path.join(path, "log")
        if not os.path.isdir(self.log_dir):
            raise NotFound(f"{path}: not a spool directory (no log/ inside)")
        self.checkpoint = ckpt.load(self.io, path)
        self.segments = list_segments(self.io, self.log_dir)
        if not self.segments:
            raise NotFound(f"{path}: the spool has no segments")
        head = self.checkpoint.head if self.checkpoint else None
        self.reader = LogReader(self.io, self.log_dir, segments=self.segments, durable=head)
        self.durable_end, _anomalies = self.reader.log_end(head)
        begin = self.checkpoint.working_start if self.checkpoint else 0
        begin = max(begin, make_pos(self.segments[0], SEGMENT_HEADER_SIZE))
        self._active = active_attempts(self.reader, begin, self.durable_end)

    def read_frame(self, pos: int) -> Frame:
        seg = pos_segment(pos)
        path = segment_path(self.log_dir, seg)
        fd = self.io.open_read(path)
        try:
            return read_frame_at(self.io, fd, path, seg, pos_offset(pos))
        finally:
            self.io.close(fd)

    def read_body(self, envelope: Envelope) -> Iterator[bytes]:
        for pos in envelope.body:
            yield self.read_frame(pos).payload

    # Listable
    def source(self) -> LogSource:
        return self

    def live_start(self) -> int:
        first = make_pos(self.segments[0], SEGMENT_HEADER_SIZE)
        return max(first, self.checkpoint.garbage_end) if self.checkpoint else first

    def active(self) -> Mapping[int, object]:
        return self._active

    def damage_reporter(self) -> Reporter:
        """A read-only view writes no quarantine: it stops at the first damage, naming it."""
        return raise_anomaly


def envelopes_since(spool: Listable, start: int) -> Iterator[Envelope]:
    """Every envelope from ``start`` (a position; before the oldest segment: from there) to the durable end,
    live or garbage: what was written, whatever became of it since. For the relay's own indexes rebuilt at
    start (the injection API's idempotency keys); the walk is as long as the log after ``start``.
    """
    src = spool.source()
    end = src.durable_end
    reader = LogReader(src.io, src.log_dir, durable=end)
    segments = reader.segments
    if not segments:
        return
    start = max(start, make_pos(segments[0], SEGMENT_HEADER_SIZE))
    reporter = spool.damage_reporter()
    for frame in reader.frames(start, end, reporter):
        if frame.rtype != RecordType.ENVELOPE:
            continue
        try:
            env = decode_payload(RecordType.ENVELOPE, frame.payload)
        except CorruptRecord:
            continue  # reported by the reader's consumers that own it; an index only skips it
        assert isinstance(env, Envelope)
        yield env
