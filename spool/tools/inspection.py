"""The analyses behind ``spoolctl``: read-only looks at a spool's log, free of any CLI.

Theory of operation. Everything here reads the log through ``spool.read.reader``
(a 1 MiB window) and never takes the spool's lock, never truncates, never
marks: it works while the relay appends. Where the engine's open stops at the
first bad record, these functions go on: the reader yields an ``Anomaly`` for
a bad record, resumes at the next frame whose checksum passes, and names gaps
in the sequence, sealed sizes that disagree and torn tails, so one damaged
byte does not hide the rest of the log, and every command names the same
segment and offset as the others (and as the relay). A torn tail at the end of
the last segment is what a crash (or a writer appending right now) leaves: it
is reported apart from damage, and the next open (``spoolctl recover``) cuts it.

The verifier (``spoolctl verify``) is ``spool.tools.verify``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from spool.config.engine import RETRY_INTERVALS, SpoolConfig
from spool.config.units import parse_duration
from spool.engine.recovery import RecoveryStats, first_needed
from spool.engine.spool import BODY_SLACK, LOG_DIR, Spool
from spool.errors import ConfigError, CorruptRecord, FormatVersionError, SpoolError
from spool.fileio import FileIO, OsFileIO
from spool.format import checkpoint as ckpt
from spool.format.record import (
    HELD_CLASS,
    Delivery,
    Envelope,
    Frame,
    Payload,
    RecordType,
    Start,
    decode_payload,
    format_id,
    format_pos,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, list_segments, read_frame_at, segment_path
from spool.read import listing as admin
from spool.read.anomaly import Anomaly
from spool.read.reader import LogReader

PREVIEW = 40


class NotASpool(SpoolError, ValueError):
    """The directory is missing, is not a spool, or holds no segments."""


class BadArgument(SpoolError, ValueError):
    """An argument names something the spool does not have (a segment, a record position)."""


# -- the files of a spool --------------------------------------------------------


@attrs.frozen
class LogFiles:
    """A spool directory and the segment ids it held when it was opened."""

    path: str
    log_dir: str
    io: FileIO
    segments: tuple[int, ...]

    @classmethod
    def open(cls, path: str, io: FileIO | None = None) -> LogFiles:
        """Raises NotASpool when ``path`` is not a spool with at least one segment."""
        io = io or OsFileIO()
        if not os.path.isdir(path):
            raise NotASpool(f"{path}: no such directory")
        log_dir = os.path.join(path, LOG_DIR)
        if not os.path.isdir(log_dir):
            raise NotASpool(f"{path}: not a spool directory (no {LOG_DIR}/ inside)")
        segments = tuple(list_segments(io, log_dir))
        if not segments:
            raise NotASpool(f"{path}: the spool has no segments")
        return cls(path, log_dir, io, segments)

    @property
    def first(self) -> int:
        return self.segments[0]

    @property
    def last(self) -> int:
        return self.segments[-1]

    def seg_path(self, seg: int) -> str:
        return segment_path(self.log_dir, seg)

    def size(self, seg: int) -> int:
        """File size of a segment. Raises FileNotFoundError if it was reclaimed meanwhile."""
        fd = self.io.open_read(self.seg_path(seg))
        try:
            return self.io.size(fd)
        finally:
            self.io.close(fd)

    def load_checkpoint(self) -> ckpt.Checkpoint | None:
        """Raises CorruptCheckpoint or FormatVersionError."""
        return ckpt.load(self.io, self.path)

    def reader(self, cp: ckpt.Checkpoint | None) -> LogReader:
        """The log reader for these segments, told what the checkpoint knows: its head is durable, and
        no segment from ``first_needed(cp)`` on may be missing. (The checkpoint is loaded after the
        segments were listed: a relay that reclaims more meanwhile wrote a later checkpoint first.)"""
        return LogReader(self.io, self.log_dir, segments=self.segments, durable=cp.head if cp else None,
                         expect_first=first_needed(cp))

    def read_frame(self, pos: int) -> Frame:
        """The frame at ``pos``, checksum verified. Raises CorruptRecord or FileNotFoundError."""
        seg = pos_segment(pos)
        fd = self.io.open_read(self.seg_path(seg))
        try:
            return read_frame_at(self.io, fd, self.seg_path(seg), seg, pos_offset(pos))
        finally:
            self.io.close(fd)


def decode(frame: Frame, files: LogFiles) -> Payload:
    """The frame's payload. Raises CorruptRecord naming the file and offset."""
    return decode_payload(frame.rtype, frame.payload, path=files.seg_path(pos_segment(frame.pos)),
                          offset=pos_offset(frame.pos))


def type_name(rtype: int) -> str:
    try:
        return RecordType(rtype).name
    except ValueError:
        return str(rtype)


def checkpoint_or_none(files: LogFiles) -> ckpt.Checkpoint | None:
    try:
        return files.load_checkpoint()
    except (CorruptRecord, FormatVersionError):
        return None


def live_start(files: LogFiles, cp: ckpt.Checkpoint | None) -> int:
    first = make_pos(files.first, SEGMENT_HEADER_SIZE)
    return max(first, cp.garbage_end) if cp else first


def active_envelopes(files: LogFiles, cp: ckpt.Checkpoint | None) -> dict[int, int]:
    """Envelope position -> START position of the attempts in flight (``admin.active_attempts``)."""
    begin = max(cp.working_start, make_pos(files.first, SEGMENT_HEADER_SIZE)) if cp else None
    return admin.active_attempts(files.reader(cp), begin, None)


# -- spoolctl segments ---------------------------------------------------------------


@attrs.define
class SegmentInfo:
    segment: int
    path: str
    size: int
    records: int = 0
    by_type: Counter[str] = attrs.field(factory=Counter)
    live: int = 0  # live envelopes: messages still queued (or in flight) in this segment
    garbage: int = 0  # records with the garbage flag set
    first: int | None = None
    last: int | None = None
    deletable: bool = False
    damage: list[Anomaly] = attrs.field(factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"segment": self.segment, "file": self.path, "size": self.size, "records": self.records,
                "by_type": {t.name: self.by_type.get(t.name, 0) for t in RecordType},
                "live": self.live, "garbage": self.garbage,
                "first": None if self.first is None else format_pos(self.first),
                "last": None if self.last is None else format_pos(self.last),
                "deletable": self.deletable, "damage": [d.as_dict() for d in self.damage]}


def segment_table(files: LogFiles) -> tuple[ckpt.Checkpoint | None, list[SegmentInfo]]:
    """One row per segment. Deletable: wholly behind the checkpoint's garbage end minus BODY_SLACK,
    the rule the engine applies (spool/engine/reclaim.py) after its next checkpoint."""
    cp = files.load_checkpoint()
    active = active_envelopes(files, cp)
    start = live_start(files, cp)
    limit = pos_segment(cp.garbage_end) - BODY_SLACK - cp.body_span if cp else None
    reader = files.reader(cp)
    rows: list[SegmentInfo] = []
    for seg in files.segments:
        try:
            row = SegmentInfo(seg, files.seg_path(seg), files.size(seg))
        except FileNotFoundError:
            continue  # reclaimed by the relay while we looked
        for item in reader.segment(seg):
            if isinstance(item, Anomaly):
                row.damage.append(item)
                continue
            row.records += 1
            row.by_type[type_name(item.rtype)] += 1
            row.first = item.pos if row.first is None else row.first
            row.last = item.pos
            if item.garbage:
                row.garbage += 1
            if item.rtype == RecordType.ENVELOPE and item.pos >= start and (
                    not item.garbage or item.pos in active):
                row.live += 1
        row.deletable = limit is not None and seg < limit
        rows.append(row)
    return cp, rows


# -- spoolctl checkpoint --------------------------------------------------------------


@attrs.frozen
class Lag:
    name: str
    pos: int
    records: int
    bytes: int
    seconds: int
    interval: float | None = None
    reclaimed: bool = False  # the position lies in a segment already deleted

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "position": format_pos(self.pos), "lag_records": self.records,
                "lag_bytes": self.bytes, "lag_seconds": self.seconds, "interval": self.interval,
                "reclaimed": self.reclaimed}


@attrs.frozen
class CheckpointReport:
    checkpoint: ckpt.Checkpoint | None
    log_end: int
    last_time: int | None
    lags: tuple[Lag, ...]

    def as_dict(self) -> dict[str, Any]:
        cp = self.checkpoint
        return {
            "checkpoint": None if cp is None else {
                "sequence": cp.sequence, "time_ms": cp.time_ms, "head": format_pos(cp.head),
                "working_start": format_pos(cp.working_start), "garbage_end": format_pos(cp.garbage_end),
                "runners": [format_pos(r) for r in cp.runners]},
            "log_end": format_pos(self.log_end),
            "last_record_time": self.last_time,
            "positions": [lag.as_dict() for lag in self.lags],
        }


def checkpoint_report(files: LogFiles, retry_intervals: Iterable[float] | None = None) -> CheckpointReport:
    """The restart positions and how far each lags the end of the log: records, bytes of
    records, and seconds between the record at the position and the last record
    (header times). One pass from the oldest position to the end."""
    cp = files.load_checkpoint()
    intervals = SpoolConfig().retry_intervals if retry_intervals is None else tuple(retry_intervals)
    if cp is None:
        end_pos, end_time = _log_end(files)
        return CheckpointReport(None, end_pos, end_time, ())
    named: list[tuple[str, int, float | None]] = [
        ("head", cp.head, None), ("working_start", cp.working_start, None), ("garbage_end", cp.garbage_end, None)]
    for k, pos in enumerate(cp.runners):
        interval = 0.0 if k == 0 else (intervals[k - 1] if k - 1 < len(intervals) else None)
        named.append((f"runner {k}", pos, interval))
    origin = make_pos(files.first, SEGMENT_HEADER_SIZE)
    order = sorted(range(len(named)), key=lambda i: named[i][1])
    seen: list[tuple[int, int, int | None]] = [(0, 0, None)] * len(named)
    records = nbytes = 0
    last_time: int | None = None
    end = origin
    j = 0
    for item in files.reader(cp).read(max(origin, min(p for _, p, _ in named))):
        if isinstance(item, Anomaly):
            if item.torn:
                break
            continue
        while j < len(order) and named[order[j]][1] <= item.pos:
            seen[order[j]] = (records, nbytes, item.time)
            j += 1
        records += 1
        nbytes += item.size
        last_time = item.time
        end = item.pos + item.size
    for i in order[j:]:
        seen[i] = (records, nbytes, None)
    lags = []
    for (name, pos, interval), (rec, nb, t) in zip(named, seen):
        seconds = 0 if t is None or last_time is None else last_time - t
        lags.append(Lag(name, pos, records - rec, nbytes - nb, seconds, interval, pos < origin))
    return CheckpointReport(cp, end, last_time, tuple(lags))


def _log_end(files: LogFiles) -> tuple[int, int | None]:
    """End of the valid records of the last segment (a spool without a checkpoint), and the time of the
    last record."""
    end = make_pos(files.last, SEGMENT_HEADER_SIZE)
    t = None
    for item in files.reader(None).segment(files.last):
        if isinstance(item, Anomaly):
            if item.torn:
                break
            continue
        end, t = item.pos + item.size, item.time
    return end, t


# -- spoolctl dump ------------------------------------------------------------------


def dump(files: LogFiles, *, segment: int | None = None, start: int | None = None,
         types: Iterable[int] | None = None, limit: int | None = None) -> Iterator[Frame | Anomaly]:
    """Records in log order, from ``start`` or the beginning of ``segment``, filtered by type.

    Raises BadArgument at once (not on first iteration) when the segment does
    not exist or no record starts at ``start``.
    """
    if segment is not None and segment not in files.segments:
        raise BadArgument(f"no segment {segment} in {files.log_dir} (segments {files.first}..{files.last})")
    if start is not None:
        if pos_segment(start) not in files.segments or (segment is not None and pos_segment(start) != segment):
            where = f"segment {segment}" if segment is not None else "the log"
            raise BadArgument(f"position {format_pos(start)} is not in {where}")
        try:
            files.read_frame(start)
        except (CorruptRecord, OSError):
            raise BadArgument(f"no valid record starts at position {format_pos(start)}") from None
    elif segment is not None:
        start = make_pos(segment, SEGMENT_HEADER_SIZE)
    wanted = None if types is None else frozenset(types)
    return _dump(files, segment, start, wanted, limit)


def _dump(files: LogFiles, segment: int | None, start: int | None, wanted: frozenset[int] | None,
          limit: int | None) -> Iterator[Frame | Anomaly]:
    shown = 0
    for item in files.reader(checkpoint_or_none(files)).read(start):
        if segment is not None and pos_segment(item.pos) != segment:
            break
        if isinstance(item, Frame) and wanted is not None and item.rtype not in wanted:
            continue
        if limit is not None and shown >= limit:
            break
        shown += 1
        yield item


def parse_type(text: str) -> int:
    """A record type by name (any case) or number."""
    try:
        return int(RecordType[text.strip().upper()])
    except KeyError:
        pass
    try:
        return int(RecordType(int(text)))
    except ValueError:
        names = ", ".join(t.name for t in RecordType)
        raise ValueError(f"unknown record type {text!r} (one of {names})") from None


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def payload_fields(payload: Payload) -> dict[str, Any]:
    """A payload as JSON-ready fields (positions as ``segment:offset``)."""
    if isinstance(payload, bytes):
        return {"length": len(payload), "preview": payload[:PREVIEW].decode("utf-8", "backslashreplace")}
    if isinstance(payload, Envelope):
        d: dict[str, Any] = {
            "queue_id": format_id(payload.message_id), "sender": payload.sender,
            "recipients": list(payload.recipients), "body": [format_pos(p) for p in payload.body],
            "body_size": payload.body_size, "arrival_ms": payload.arrival_ms, "attempts": payload.attempts,
            "replaces": None if payload.replaces is None else format_pos(payload.replaces), "held": payload.held}
        if payload.in_doubt:
            d["in_doubt"] = list(payload.in_doubt)
        if payload.extra:
            d["extra"] = payload.extra
        return d
    if isinstance(payload, Start):
        return {"envelope": format_pos(payload.envelope), "time_ms": payload.time_ms, "kind": payload.kind.name}
    if isinstance(payload, Delivery):
        return {"start": format_pos(payload.start), "time_ms": payload.time_ms, "duration_ms": payload.duration_ms,
                "outcomes": [{"recipient": o.recipient, "status": o.status.name, "code": o.code,
                              "enhanced": o.enhanced, "reply": o.reply, "next_hop": o.next_hop}
                             for o in payload.outcomes]}
    return {"start": format_pos(payload.start), "time_ms": payload.time_ms,
            "replacement": None if payload.replacement is None else format_pos(payload.replacement)}


def frame_fields(frame: Frame, files: LogFiles) -> dict[str, Any]:
    """One record for ``dump --json``. A payload that does not decode gets an ``error`` field."""
    d: dict[str, Any] = {"position": format_pos(frame.pos), "type": type_name(frame.rtype), "flags": frame.flags,
                         "garbage": frame.garbage, "class": frame.klass, "time": frame.time}
    try:
        d["payload"] = payload_fields(decode(frame, files))
    except CorruptRecord as exc:
        d["error"] = str(exc)
    return d


def frame_line(fields: Mapping[str, Any]) -> str:
    """The human one-line form of ``frame_fields``."""
    flags = "G" if fields["garbage"] else "-"
    klass = "held" if fields["class"] == HELD_CLASS else str(fields["class"])
    head = f"{fields['position']:>14} {fields['type']:<8} {flags} c={klass:<4} {_iso(fields['time'])}"
    if "error" in fields:
        return f"{head}  !! {fields['error']}"
    p = fields["payload"]
    rtype = fields["type"]
    if rtype == "DATA":
        text = f"len={p['length']} {p['preview']!r}"
    elif rtype == "ENVELOPE":
        text = (f"id={p['queue_id']} from=<{p['sender']}> to={','.join(p['recipients'])} "
                f"body={len(p['body'])}x/{p['body_size']}B arrival={_iso(p['arrival_ms'] / 1000)} "
                f"attempts={p['attempts']}")
        if p["replaces"]:
            text += f" replaces={p['replaces']}"
        if p["held"]:
            text += " held"
        if p.get("in_doubt"):
            text += f" in_doubt={','.join(p['in_doubt'])}"
    elif rtype == "START":
        text = f"envelope={p['envelope']} kind={p['kind']}"
    elif rtype == "DELIVERY":
        outs = "; ".join(f"{o['recipient']} {o['status']} {o['code']} {o['enhanced']} {o['reply']!r}".replace(
            "  ", " ") for o in p["outcomes"])
        text = f"start={p['start']} {outs}"
    else:
        text = f"start={p['start']}" + (f" replacement={p['replacement']}" if p["replacement"] else "")
    return f"{head}  {text}"


# -- spoolctl stats -------------------------------------------------------------------


@attrs.frozen
class Stats:
    live: int
    by_class: dict[int, int]  # queued (not held, not in flight) per runner class
    held: int
    active: int
    oldest_arrival_ms: int | None
    oldest_age_s: float | None
    segments: int
    bytes_on_disk: int

    def as_dict(self) -> dict[str, Any]:
        return {"live": self.live, "by_class": {str(k): v for k, v in sorted(self.by_class.items())},
                "held": self.held, "active": self.active, "oldest_arrival_ms": self.oldest_arrival_ms,
                "oldest_age_s": self.oldest_age_s, "segments": self.segments, "bytes_on_disk": self.bytes_on_disk}


def stats(files: LogFiles, now: float | None = None) -> Stats:
    """Live messages by state and class, oldest age, space used; one pass over the live stretch."""
    now = time.time() if now is None else now
    view = admin.SpoolView(files.path, files.io)
    by_class: Counter[int] = Counter()
    held = active = live = 0
    oldest: int | None = None
    for msg in admin.iter_live(view, now=now):
        live += 1
        if msg.state == "active":
            active += 1
        elif msg.state == "held":
            held += 1
        else:
            by_class[msg.klass] += 1
        oldest = msg.envelope.arrival_ms if oldest is None else min(oldest, msg.envelope.arrival_ms)
    sizes = 0
    count = 0
    for seg in list_segments(files.io, files.log_dir):
        try:
            sizes += files.size(seg)
            count += 1
        except FileNotFoundError:
            continue
    return Stats(live, dict(by_class), held, active, oldest,
                 None if oldest is None else max(0.0, now - oldest / 1000), count, sizes)


# -- spoolctl recover ------------------------------------------------------------------


def recover(files: LogFiles, config: SpoolConfig | None = None) -> RecoveryStats:
    """Open the spool for writing (takes the lock, runs recovery, cuts a torn tail), then close.

    Raises SpoolLocked while the relay runs, CorruptSegment for damage before the tail.
    """
    sp = Spool.open(files.path, config or SpoolConfig(), files.io)
    try:
        return attrs.evolve(sp.recovery_stats)
    finally:
        sp.close()


# -- arguments -----------------------------------------------------------------------


def parse_intervals(text: str) -> tuple[float, ...]:
    """``1m,5m,15m`` -> retry intervals in seconds, in the config file's grammar and checked by its definition.

    Raises:
        ConfigError (a ValueError): one line.
    """
    values = text.split(",")
    intervals = []
    for i, value in enumerate(values):
        try:
            intervals.append(parse_duration(value))
        except ConfigError as e:
            raise (e.at(f"[{i}]") if len(values) > 1 else e) from None
    RETRY_INTERVALS.check(tuple(intervals))
    return tuple(intervals)
