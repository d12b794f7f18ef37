"""The event stream: the log's durable records, read as delivery events.

Theory of operation. Every transition a consumer cares about (a message
received, each recipient's outcome, a retry scheduled, held, released, in
doubt after a crash) is already a record in the log, at a position that only
grows and is never given twice. So the stream is the log itself, read
through the one reader (``spool.read.reader``), and an event's id is its
record's position, with the recipient's index for an outcome: stable across
restarts, unique over the life of the spool, with no second store to keep
in step.

Two parts:

- ``Derivation`` turns records into events: a pure function of the records
  in log order, plus a ``lookup`` for the few older records an event must
  name (a DELIVERY names its START, a START its envelope, a replacement the
  envelope it replaces). A record read in this walk is remembered (bounded);
  an older one is read at its position, in the log or the archive.
- ``EventStream`` reads records only up to the durable horizon the writer
  publishes (``spool.format.horizon``): nothing past it is shown, because a
  crash may take it back and the next record may be given its position.
  Everything before the horizon is on disk, and recovery never cuts what is
  on disk, so an event once shown is never undone.

A consumer's cursor is the position of the last record it has taken
(``after``); the next read begins after it. When the segment it points into
has been reclaimed, the read resumes at the oldest segment left (the log or
the archive) and says so (``EventBatch.lagged``, with the gap).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from spool.errors import CorruptRecord, SpoolError
from spool.fileio import FileIO, OsFileIO
from spool.format.horizon import read_horizon
from spool.format.record import (
    Delivery,
    Envelope,
    Frame,
    Payload,
    RecordType,
    Start,
    Status,
    decode_payload,
    format_id,
    format_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, list_segments, read_frame_at, segment_path, segment_size
from spool.read.anomaly import Anomaly
from spool.read.reader import LogReader

LOG_DIR: Final = "log"
QUIET_RECORDS: Final = 16  # records without an event (STARTs) a read may pass per record it may give
REMEMBERED: Final = 16384  # envelopes and starts kept from the walk, so most lookups read nothing
STATUS_KINDS: Final = {Status.DELIVERED: "delivered", Status.DEFERRED: "deferred", Status.BOUNCED: "bounced",
                       Status.EXPIRED: "expired", Status.DELETED: "deleted"}
# Every kind an event may have, as the docs list them.
KINDS: Final = ("received", "delivered", "deferred", "bounced", "expired", "deleted", "retry_scheduled", "held",
                "released", "requeued", "in_doubt", "damage")

Lookup = Callable[[int], Payload | None]


@attrs.frozen
class Event:
    """One event: ``pos`` its record's position, ``index`` the recipient's index in an outcome record."""

    pos: int
    kind: str
    time_ms: int
    queue_id: str | None
    fields: dict[str, Any] = attrs.field(factory=dict, hash=False)
    index: int | None = None

    @property
    def id(self) -> str:
        """``segment:offset``, and ``/index`` for one recipient's outcome: what receivers deduplicate on."""
        return format_pos(self.pos) if self.index is None else f"{format_pos(self.pos)}/{self.index}"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "pos": self.pos, "kind": self.kind, "time_ms": self.time_ms,
                "queue_id": self.queue_id, **self.fields}


class _Remembered(OrderedDict[int, Any]):
    """A bounded map, oldest out first."""

    def put(self, key: int, value: Any) -> None:
        self[key] = value
        if len(self) > REMEMBERED:
            self.popitem(last=False)


class NotARecord(SpoolError, ValueError):
    """A position given to read from where no record of the log begins."""


class Derivation:
    """Records in, events out, in log order. ``retry_intervals``: the deferred classes' intervals in
    seconds, for a retry's due time (none given: the event names the class only)."""

    def __init__(self, lookup: Lookup | None = None, retry_intervals: Sequence[float] = ()) -> None:
        self._lookup = lookup
        self._intervals = tuple(retry_intervals)
        self._envelopes = _Remembered()  # envelope position -> Envelope
        self._starts = _Remembered()  # start position -> Start

    def events(self, frame: Frame, payload: Payload) -> list[Event]:
        if isinstance(payload, Envelope):
            self._envelopes.put(frame.pos, payload)
            return self._envelope(frame, payload)
        if isinstance(payload, Start):
            self._starts.put(frame.pos, payload)
            return []
        if isinstance(payload, Delivery):
            return self._delivery(frame, payload)
        return []  # FINISH and DATA: no transition of their own

    def damage(self, anomaly: Anomaly) -> Event:
        """Damage met inside the durable log: an event too, so a consumer knows what it cannot be told."""
        return Event(anomaly.pos, "damage", 0, None, anomaly.as_dict())

    # -- the records ----------------------------------------------------------------

    def _envelope(self, frame: Frame, env: Envelope) -> list[Event]:
        qid = format_id(env.message_id)
        t = frame.time * 1000
        if env.replaces is None:
            fields: dict[str, Any] = {"sender": env.sender, "recipients": list(env.recipients),
                                      "size": env.body_size, "arrival_ms": env.arrival_ms}
            for key in ("client", "message_id", "auth", "dsn_for"):
                if isinstance(env.extra.get(key), str):
                    fields[key] = env.extra[key]
            return [Event(frame.pos, "received", env.arrival_ms, qid, fields)]
        # Decided from the two envelopes alone (never from this walk's memory), so every reader, from any
        # cursor, gives the record the same kind. Only when the replaced envelope is gone from the log and
        # the archive does the new one's class decide alone.
        old = self._find(env.replaces, Envelope)
        doubt = [r for r in env.in_doubt if old is None or r not in old.in_doubt]
        common = {"recipients": list(env.recipients), "attempts": env.attempts}
        if doubt:
            return [Event(frame.pos, "in_doubt", t, qid, {**common, "in_doubt": doubt, "held": env.held})]
        if env.held:
            if old is not None and old.held:
                return []  # the oldest runner carrying a held message forward: nothing changed for anyone
            return [Event(frame.pos, "held", t, qid, common)]
        if old is not None and old.held:
            return [Event(frame.pos, "released", t, qid, common)]
        if frame.klass == 0:
            return [Event(frame.pos, "requeued", t, qid, common)]  # a flush, or recovery after a crash
        fields = {**common, "retry_class": frame.klass}
        if 1 <= frame.klass <= len(self._intervals):
            fields["next_retry_ms"] = t + int(self._intervals[frame.klass - 1] * 1000)
        if isinstance(env.extra.get("last_error"), str):
            fields["last_error"] = env.extra["last_error"]
        return [Event(frame.pos, "retry_scheduled", t, qid, fields)]

    def _delivery(self, frame: Frame, d: Delivery) -> list[Event]:
        if not d.outcomes:
            return []  # the point of no return: the relay's own bookkeeping, not a transition
        start = self._find(d.start, Start)
        env = self._find(start.envelope, Envelope) if start is not None else None
        qid = format_id(env.message_id) if env is not None else None
        attempt = env.attempts + 1 if env is not None else None
        events = []
        for i, o in enumerate(d.outcomes):
            fields: dict[str, Any] = {"recipient": o.recipient, "code": o.code, "enhanced": o.enhanced,
                                      "reply": o.reply, "next_hop": o.next_hop, "duration_ms": d.duration_ms}
            if attempt is not None:
                fields["attempt"] = attempt
            if d.source:
                fields["source"] = d.source
            events.append(Event(frame.pos, STATUS_KINDS[o.status], d.time_ms, qid, fields, i))
        return events

    def _find(self, pos: int, want: type[Any]) -> Any:
        table = self._envelopes if want is Envelope else self._starts
        found = table.get(pos)
        if found is None and self._lookup is not None:
            found = self._lookup(pos)
            if isinstance(found, want):
                table.put(pos, found)
        return found if isinstance(found, want) else None


@attrs.frozen
class EventBatch:
    """What one read gave: ``events`` in order; ``after`` the cursor to read on from (the last record read,
    or the one given when nothing was); ``horizon`` the durable position read up to; ``lagged``: the cursor's
    segment was gone, and ``gap`` (from, to) the positions no longer anywhere; ``records``: records read that
    made events."""

    events: list[Event]
    after: int | None
    horizon: int | None
    lagged: bool = False
    gap: tuple[int, int] | None = None
    records: int = 0


class EventStream:
    """The durable events of the spool in ``spool_dir`` (read-only; takes no lock: the relay may run).

    ``archive_dir``: where reclaimed segments went, read when the log no
    longer holds them.
    """

    def __init__(self, spool_dir: str, *, archive_dir: str | None = None, io: FileIO | None = None,
                 retry_intervals: Sequence[float] = ()) -> None:
        self.spool_dir = spool_dir
        self.log_dir = os.path.join(spool_dir, LOG_DIR)
        self.archive_dir = archive_dir
        self.io = io or OsFileIO()
        self.derivation = Derivation(self._lookup, retry_intervals)

    def horizon(self) -> int | None:
        return read_horizon(self.io, self.spool_dir)

    def _paths(self) -> tuple[list[int], dict[int, str]]:
        """The segments there are, in the log and in the archive, and the archived ones' files."""
        here = list_segments(self.io, self.log_dir) if self.io.exists(self.log_dir) else []
        paths: dict[int, str] = {}
        if self.archive_dir and self.io.exists(self.archive_dir):
            present = set(here)
            for seg in list_segments(self.io, self.archive_dir):
                if seg not in present:
                    paths[seg] = segment_path(self.archive_dir, seg)
        return sorted({*here, *paths}), paths

    def _lookup(self, pos: int) -> Payload | None:
        seg = pos_segment(pos)
        for directory in (self.log_dir, self.archive_dir):
            if not directory:
                continue
            path = segment_path(directory, seg)
            try:
                fd = self.io.open_read(path)
            except FileNotFoundError:
                continue
            try:
                frame = read_frame_at(self.io, fd, path, seg, pos_offset(pos))
                return decode_payload(frame.rtype, frame.payload)
            except (CorruptRecord, OSError):
                return None
            finally:
                self.io.close(fd)
        return None

    def read(self, after: int | None = None, *, since: int | None = None,
             max_records: int | None = None) -> EventBatch:
        """The events of the records after ``after`` (None: from the oldest record there is; ``since``:
        from the record at that position on) up to the durable horizon, at most ``max_records`` records
        (whole records: a record's events are never split)."""
        horizon = self.horizon()
        if horizon is None:
            return EventBatch([], after, None)
        segments, paths = self._paths()
        if not segments:
            return EventBatch([], after, horizon)
        begin = since if since is not None and after is None else after
        start, lagged, gap = self._start(begin, segments)
        if begin is not None and not lagged and begin < horizon and self._lookup(begin) is None:
            raise NotARecord(f"no record starts at position {format_pos(begin)}")
        if start is not None and start >= horizon:
            return EventBatch([], after, horizon, lagged, gap)
        reader = LogReader(self.io, self.log_dir, segments=segments, durable=horizon, paths=paths)
        events: list[Event] = []
        last, records, read = after, 0, 0
        for item in reader.read(start, horizon, types=_EVENT_TYPES):
            if after is not None and item.pos <= after:
                continue
            if isinstance(item, Anomaly):
                if item.torn or item.pos >= horizon:
                    break
                # Shown, but the cursor stays on the last record: a cursor is always a record's position.
                events.append(self.derivation.damage(item))
                continue
            try:
                payload = decode_payload(item.rtype, item.payload)
            except CorruptRecord as exc:
                made = [Event(item.pos, "damage", item.time * 1000, None, {"reason": str(exc)})]
            else:
                made = self.derivation.events(item, payload)
            events.extend(made)
            last, records, read = item.pos, records + bool(made), read + 1
            if max_records is not None and (records >= max_records or read >= max_records * QUIET_RECORDS):
                break
        return EventBatch(events, last, horizon, lagged, gap, records)

    def lag(self, after: int | None) -> tuple[int, bool]:
        """How far a consumer whose cursor is ``after`` trails the durable horizon: (bytes of log, whether its
        cursor's segment has left the log, reclaimed: archived or gone)."""
        horizon = self.horizon()
        here = list_segments(self.io, self.log_dir) if self.io.exists(self.log_dir) else []
        if horizon is None or not here:
            return 0, False
        first = here[0]
        begin = after if after is not None else (first << 32) | SEGMENT_HEADER_SIZE
        lagged = pos_segment(begin) < first
        if lagged:
            begin = (first << 32) | SEGMENT_HEADER_SIZE
        if begin >= horizon:
            return 0, lagged
        end_seg, total = pos_segment(horizon), 0
        for seg in (s for s in here if pos_segment(begin) <= s <= end_seg):
            lo = pos_offset(begin) if seg == pos_segment(begin) else 0
            hi = pos_offset(horizon) if seg == end_seg else segment_size(self.io, self.log_dir, seg)
            total += max(0, hi - lo)
        return total, lagged

    def _start(self, after: int | None, segments: list[int]) -> tuple[int | None, bool, tuple[int, int] | None]:
        """Where a read after ``after`` begins, and whether the cursor lost records to reclaim."""
        first = segments[0]
        if after is None:
            return None, False, None
        if pos_segment(after) >= first:
            return after, False, None
        begin = (first << 32) | SEGMENT_HEADER_SIZE
        return begin, True, (after, begin)


_EVENT_TYPES: Final = frozenset({int(RecordType.ENVELOPE), int(RecordType.START), int(RecordType.DELIVERY)})
