"""The analyses behind ``spoolctl``: read-only looks at a spool's log, free of any CLI.

Theory of operation. Everything here reads segment files with ``FrameReader``
(a 1 MiB window) and never takes the spool's lock, never truncates, never marks:
it works while the relay appends. Where the engine's open stops at the first bad
record, these functions go on: ``scan_segment`` yields a ``Damage`` for a bad
record, finds the next frame whose checksum passes and resumes there, so one
damaged byte does not hide the rest of the log. A failure at the end of the last
segment that looks like an interrupted write is a *torn tail*: the next open
(``spoolctl recover``) cuts it, and a writer that is appending right now
produces one too, so it is reported apart from damage.

Memory. Sequential passes hold one read window. On the error path only, the
rest of the damaged segment is read to find where valid records resume (at
most one segment, ``SpoolConfig.segment_size``). ``verify`` keeps the types of
the last ``recent`` frames it passed (an ordered map of at most ``recent``
entries, 65,536 by default: a few MiB) and checks older references with one
positioned read each, so its memory does not grow with the log. It also keeps
the envelopes of the attempts in flight (bounded by the engine's active limit)
and one range per damaged stretch; the problem list is capped at
``max_problems`` entries (the total is still counted).
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from spool import admin
from spool import checkpoint as ckpt
from spool.config import SpoolConfig
from spool.errors import CorruptRecord, CorruptSegment, FormatVersionError, SpoolError
from spool.fileio import FileIO, OsFileIO, read_exact
from spool.record import (
    HEADER,
    HEADER_SIZE,
    HELD_CLASS,
    Delivery,
    Envelope,
    Finish,
    Frame,
    Payload,
    RecordType,
    Start,
    decode_frame,
    decode_payload,
    format_id,
    format_pos,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.recovery import RecoveryStats
from spool.segment import (
    READ_CHUNK,
    SEGMENT_HEADER_SIZE,
    FrameReader,
    check_sealed_size,
    find_end,
    list_segments,
    read_segment_header,
    segment_path,
    valid_frame_after,
)
from spool.spool import BODY_SLACK, LOG_DIR, Spool

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

    def read_frame(self, pos: int) -> Frame:
        """The frame at ``pos``, checksum verified. Raises CorruptRecord or FileNotFoundError."""
        seg, off = pos_segment(pos), pos_offset(pos)
        fd = self.io.open_read(self.seg_path(seg))
        try:
            head = read_exact(self.io, fd, HEADER_SIZE, off)
            length = HEADER.unpack_from(head)[1] if len(head) == HEADER_SIZE else 0
            frame = decode_frame(seg, head + read_exact(self.io, fd, length, off + HEADER_SIZE), 0)
        finally:
            self.io.close(fd)
        return attrs.evolve(frame, pos=pos)


# -- scanning with damage reported, not raised -------------------------------------


@attrs.frozen
class Damage:
    """A record that failed its checks.

    ``torn``: at the end of the last segment and shaped like an interrupted write;
    the next open cuts it. ``resumes_at``: offset of the next valid frame in the
    same segment, or None when nothing valid follows.
    """

    path: str
    segment: int
    offset: int
    reason: str
    torn: bool
    size: int
    resumes_at: int | None = None

    @property
    def pos(self) -> int:
        return make_pos(self.segment, self.offset)

    @property
    def end(self) -> int:
        """Position where the damaged stretch ends."""
        return make_pos(self.segment, self.size if self.resumes_at is None else self.resumes_at)

    def describe(self) -> str:
        if self.torn:
            return (f"{self.path} at offset {self.offset}: torn tail of {self.size - self.offset} bytes "
                    f"({self.reason}); the next open cuts it (spoolctl recover)")
        follow = f"; valid records resume at offset {self.resumes_at}" if self.resumes_at is not None else ""
        return f"{self.path} at offset {self.offset}: {self.reason}{follow}"

    def as_dict(self) -> dict[str, Any]:
        return {"position": format_pos(self.pos), "file": self.path, "offset": self.offset,
                "reason": self.reason, "torn": self.torn, "bytes": self.size - self.offset,
                "resumes_at": self.resumes_at}


def scan_segment(files: LogFiles, seg: int, start: int | None = None, *,
                 head: int | None = None) -> Iterator[Frame | Damage]:
    """Frames of one segment from ``start`` (an offset), with damage yielded in place.

    ``head`` is the checkpoint's head: a failure before it is never a torn tail,
    those records were durable. Raises FileNotFoundError if the segment is gone.
    """
    path = files.seg_path(seg)
    size = files.size(seg)
    last = seg == files.last
    lone = len(files.segments) == 1 and head is not None  # the open keeps a checkpointed spool's only segment
    header = _header_damage(files, seg, path, size,
                            last=last and not lone and (head is None or pos_segment(head) < seg))
    if header is not None:
        yield header
        return
    off = SEGMENT_HEADER_SIZE if start is None else max(start, SEGMENT_HEADER_SIZE)
    while off < size:
        reader = FrameReader(files.io, path, seg, off, size)
        try:
            yield from reader.frames(verify=True)
            return
        except CorruptSegment as exc:
            bad = exc.offset
        finally:
            reader.close()
        head_off = pos_offset(head) if head is not None and pos_segment(head) == seg else None
        damage = _classify(files, seg, path, bad, size, last=last, head_off=head_off)
        yield damage
        if damage.resumes_at is None:
            return
        off = damage.resumes_at


def _header_damage(files: LogFiles, seg: int, path: str, size: int, *, last: bool) -> Damage | None:
    try:
        read_segment_header(files.io, path, seg)
        if not last:
            check_sealed_size(files.io, os.path.dirname(path), seg, size)
        return None
    except CorruptSegment as exc:
        if exc.path == path and exc.offset > 0:  # the sealed length: the header itself is fine
            return Damage(path, seg, exc.offset, exc.reason, False, size - exc.offset)
        reason = exc.reason
    except FormatVersionError as exc:
        reason = str(exc)
    # A crash while creating the last segment can leave it short or all zeros: it held
    # nothing, and the open removes it (Spool._drop_empty_last_segment).
    torn = last and (size < SEGMENT_HEADER_SIZE or _all_zero(files, path, size))
    return Damage(path, seg, 0, f"segment header: {reason}", torn, size)


def _all_zero(files: LogFiles, path: str, size: int) -> bool:
    fd = files.io.open_read(path)
    try:
        off = 0
        while off < size:
            chunk = files.io.read(fd, min(READ_CHUNK, size - off), off)
            if not chunk:
                break
            if chunk.count(0) != len(chunk):
                return False
            off += len(chunk)
        return True
    finally:
        files.io.close(fd)


def _classify(files: LogFiles, seg: int, path: str, bad: int, size: int, *, last: bool,
              head_off: int | None) -> Damage:
    """Error path: read the rest of the segment to tell torn tail, damage, and where to resume."""
    base = bad - bad % 512  # sector boundaries are counted from the start of the file
    fd = files.io.open_read(path)
    try:
        data = read_exact(files.io, fd, size - base, base)
    finally:
        files.io.close(fd)
    rel = bad - base
    reason = _first_failure(seg, data, rel)
    later = valid_frame_after(seg, data, rel)
    if later is not None:
        return Damage(path, seg, bad, reason, False, size, base + later)
    torn = False
    if last and (head_off is None or bad >= head_off):
        try:
            find_end(seg, data, rel, path, last=True)
            torn = True
        except CorruptSegment:
            torn = False
    return Damage(path, seg, bad, reason, torn, size)


def _first_failure(seg: int, data: bytes, rel: int) -> str:
    try:
        decode_frame(seg, data, rel)
    except CorruptRecord as exc:
        return exc.reason
    return "record fails its checks"


def scan_log(files: LogFiles, start: int | None = None, *, head: int | None = None) -> Iterator[Frame | Damage]:
    """Frames from ``start`` (a position; default the first record) to the end of the log.

    A segment reclaimed while we walk is skipped: it held nothing live.
    """
    begin = make_pos(files.first, SEGMENT_HEADER_SIZE) if start is None else start
    for seg in files.segments:
        if seg < pos_segment(begin):
            continue
        off = pos_offset(begin) if seg == pos_segment(begin) else None
        try:
            yield from scan_segment(files, seg, off, head=head)
        except FileNotFoundError:
            continue


def decode(frame: Frame, files: LogFiles) -> Payload:
    """The frame's payload. Raises CorruptRecord naming the file and offset."""
    return decode_payload(frame.rtype, frame.payload, path=files.seg_path(pos_segment(frame.pos)),
                          offset=pos_offset(frame.pos))


def type_name(rtype: int) -> str:
    try:
        return RecordType(rtype).name
    except ValueError:
        return str(rtype)


def _checkpoint_or_none(files: LogFiles) -> ckpt.Checkpoint | None:
    try:
        return files.load_checkpoint()
    except (CorruptRecord, FormatVersionError):
        return None


def live_start(files: LogFiles, cp: ckpt.Checkpoint | None) -> int:
    first = make_pos(files.first, SEGMENT_HEADER_SIZE)
    return max(first, cp.garbage_end) if cp else first


def active_envelopes(files: LogFiles, cp: ckpt.Checkpoint | None) -> dict[int, int]:
    """Envelope position -> START position of the attempts in flight (no FINISH yet).

    Only the working suffix can hold an unfinished START, so only it is read.
    Damaged records are skipped here; ``verify`` reports them.
    """
    starts: dict[int, int] = {}
    begin = max(cp.working_start, make_pos(files.first, SEGMENT_HEADER_SIZE)) if cp else None
    for item in scan_log(files, begin, head=cp.head if cp else None):
        if isinstance(item, Damage) or item.rtype not in (RecordType.START, RecordType.FINISH):
            continue
        try:
            payload = decode(item, files)
        except CorruptRecord:
            continue
        if isinstance(payload, Start):
            starts[item.pos] = payload.envelope
        elif isinstance(payload, Finish):
            starts.pop(payload.start, None)
    return {env: start for start, env in starts.items()}


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
    damage: list[Damage] = attrs.field(factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"segment": self.segment, "file": self.path, "size": self.size, "records": self.records,
                "by_type": {t.name: self.by_type.get(t.name, 0) for t in RecordType},
                "live": self.live, "garbage": self.garbage,
                "first": None if self.first is None else format_pos(self.first),
                "last": None if self.last is None else format_pos(self.last),
                "deletable": self.deletable, "damage": [d.as_dict() for d in self.damage]}


def segment_table(files: LogFiles) -> tuple[ckpt.Checkpoint | None, list[SegmentInfo]]:
    """One row per segment. Deletable: wholly behind the checkpoint's garbage end minus BODY_SLACK,
    the rule the engine applies (spool/spool.py) after its next checkpoint."""
    cp = files.load_checkpoint()
    active = active_envelopes(files, cp)
    start = live_start(files, cp)
    limit = pos_segment(cp.garbage_end) - BODY_SLACK - cp.body_span if cp else None
    rows: list[SegmentInfo] = []
    for seg in files.segments:
        try:
            row = SegmentInfo(seg, files.seg_path(seg), files.size(seg))
            for item in scan_segment(files, seg, head=cp.head if cp else None):
                if isinstance(item, Damage):
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
        except FileNotFoundError:
            continue  # reclaimed by the relay while we looked
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
        end_pos, end_time = _log_end(files, None)
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
    for item in scan_log(files, max(origin, min(p for _, p, _ in named)), head=cp.head):
        if isinstance(item, Damage):
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


def _log_end(files: LogFiles, head: int | None) -> tuple[int, int | None]:
    """End of the valid records of the last segment, and the time of the last record."""
    end = make_pos(files.last, SEGMENT_HEADER_SIZE)
    t = None
    for item in scan_segment(files, files.last, head=head):
        if isinstance(item, Damage):
            break
        end, t = item.pos + item.size, item.time
    return end, t


# -- spoolctl dump ------------------------------------------------------------------


def dump(files: LogFiles, *, segment: int | None = None, start: int | None = None,
         types: Iterable[int] | None = None, limit: int | None = None) -> Iterator[Frame | Damage]:
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
          limit: int | None) -> Iterator[Frame | Damage]:
    cp = _checkpoint_or_none(files)
    shown = 0
    for item in scan_log(files, start, head=cp.head if cp else None):
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


# -- spoolctl verify ------------------------------------------------------------------


@attrs.frozen
class Problem:
    kind: str  # "damage", "payload", "reference", "segment", "checkpoint"
    message: str
    pos: int | None = None
    path: str = ""
    offset: int | None = None

    def describe(self) -> str:
        where = f"{self.path} at offset {self.offset}: " if self.path and self.offset is not None else (
            f"{self.path}: " if self.path else "")
        at = f"{format_pos(self.pos)} " if self.pos is not None else ""
        return f"{self.kind:<10} {at}{where}{self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": None if self.pos is None else format_pos(self.pos),
                "file": self.path or None, "offset": self.offset, "message": self.message}


@attrs.define
class VerifyReport:
    segments: int = 0
    records: int = 0
    by_type: Counter[str] = attrs.field(factory=Counter)
    references: int = 0
    reclaimed_references: int = 0
    problems: list[Problem] = attrs.field(factory=list)
    problems_total: int = 0
    torn_tail: Damage | None = None
    log_end: int = 0

    @property
    def clean(self) -> bool:
        return self.problems_total == 0

    def as_dict(self) -> dict[str, Any]:
        return {"clean": self.clean, "segments": self.segments, "records": self.records,
                "by_type": {t.name: self.by_type.get(t.name, 0) for t in RecordType},
                "references": self.references, "reclaimed_references": self.reclaimed_references,
                "log_end": format_pos(self.log_end),
                "torn_tail": None if self.torn_tail is None else self.torn_tail.as_dict(),
                "problems_total": self.problems_total, "problems": [p.as_dict() for p in self.problems]}


# Which references each payload makes: (target, expected type, field name).
def _references(payload: Payload) -> list[tuple[int, RecordType, str]]:
    if isinstance(payload, Envelope):
        refs = [(p, RecordType.DATA, "body chunk") for p in payload.body]
        if payload.replaces is not None:
            refs.append((payload.replaces, RecordType.ENVELOPE, "replaces"))
        return refs
    if isinstance(payload, Start):
        return [(payload.envelope, RecordType.ENVELOPE, "envelope")]
    if isinstance(payload, Delivery):
        return [(payload.start, RecordType.START, "start")]
    if isinstance(payload, Finish):
        refs = [(payload.start, RecordType.START, "start")]
        if payload.replacement is not None:
            refs.append((payload.replacement, RecordType.ENVELOPE, "replacement"))
        return refs
    return []


class _Verifier:
    def __init__(self, files: LogFiles, recent: int, max_problems: int) -> None:
        self.files = files
        self.report = VerifyReport()
        self.max_problems = max_problems
        self.recent: OrderedDict[int, int] = OrderedDict()
        self.recent_cap = recent
        self.damaged: list[tuple[int, int]] = []
        self.present = set(files.segments)
        self.first = files.first
        self.live_from = 0
        self.active: dict[int, int] = {}

    def problem(self, p: Problem) -> None:
        self.report.problems_total += 1
        if len(self.report.problems) < self.max_problems:
            self.report.problems.append(p)

    def remember(self, pos: int, rtype: int) -> None:
        self.recent[pos] = rtype
        while len(self.recent) > self.recent_cap:
            self.recent.popitem(last=False)

    def type_at(self, pos: int, scanned_to: int) -> int | str:
        """The type of the record at ``pos``, or why there is none."""
        # Every frame scanned from the oldest remembered one on is remembered.
        in_window = bool(self.recent) and next(iter(self.recent)) <= pos < scanned_to
        if in_window:
            t = self.recent.get(pos)
            if t is not None:
                return t
        if any(a <= pos < b for a, b in self.damaged):
            return "the record there is damaged"
        if in_window:
            return "no record starts there"
        try:
            return self.files.read_frame(pos).rtype
        except FileNotFoundError:
            return "its segment is gone"
        except CorruptRecord:
            return "no valid record starts there"

    def check_ref(self, src: Frame, target: int, want: RecordType, field: str, scanned_to: int, *,
                  needed: bool = False) -> None:
        """``needed``: the target must still exist (the body of a live message)."""
        self.report.references += 1
        seg = pos_segment(target)
        what = f"{type_name(src.rtype)} {field} -> {format_pos(target)}"
        if seg < self.first:
            if needed:
                self.problem(Problem("reference", f"{what}: a live message's data lies in segment {seg}, "
                                                  "which was already reclaimed", src.pos))
            else:
                self.report.reclaimed_references += 1
            return
        if seg not in self.present:
            self.problem(Problem("reference", f"{what}: segment {seg} does not exist", src.pos))
            return
        got = self.type_at(target, scanned_to)
        if isinstance(got, str):
            self.problem(Problem("reference", f"{what}: {got}", src.pos))
        elif got != want:
            self.problem(Problem("reference", f"{what} holds a {type_name(got)}, not a {want.name}", src.pos))

    def run(self) -> VerifyReport:
        files, report = self.files, self.report
        for a, b in zip(files.segments, files.segments[1:]):
            if b != a + 1:
                self.problem(Problem("segment", f"segments {a + 1}..{b - 1} are missing between {a} and {b}",
                                     path=files.seg_path(a + 1)))
        cp = self._checkpoint()
        self.live_from = live_start(files, cp)
        self.active = active_envelopes(files, cp)
        for seg in files.segments:
            try:
                self._segment(seg, cp)
            except FileNotFoundError:
                self.first = max(self.first, seg + 1)  # reclaimed by a running relay while we read
        if cp is not None:
            self._check_positions(cp)
        return report

    def _checkpoint(self) -> ckpt.Checkpoint | None:
        try:
            return self.files.load_checkpoint()
        except (CorruptRecord, FormatVersionError) as exc:
            path = getattr(exc, "path", "") or os.path.join(self.files.path, ckpt.NAME)
            self.problem(Problem("checkpoint", f"{getattr(exc, 'reason', exc)}; removing it makes the next "
                                               "open scan the whole log", path=path,
                                 offset=getattr(exc, "offset", None)))
            return None

    def _segment(self, seg: int, cp: ckpt.Checkpoint | None) -> None:
        report = self.report
        report.segments += 1
        before = report.log_end
        report.log_end = make_pos(seg, SEGMENT_HEADER_SIZE)
        for item in scan_segment(self.files, seg, head=cp.head if cp else None):
            if isinstance(item, Damage):
                if item.offset == 0:
                    report.log_end = before  # no usable header: the log ends in the segment before
                self.damaged.append((item.pos, item.end))
                if item.torn:
                    report.torn_tail = item
                else:
                    self.problem(Problem("damage", item.reason + (
                        f"; valid records resume at offset {item.resumes_at}" if item.resumes_at is not None
                        else "; nothing valid follows in this segment"), item.pos, item.path, item.offset))
                continue
            report.records += 1
            report.by_type[type_name(item.rtype)] += 1
            report.log_end = item.pos + item.size
            try:
                payload = decode(item, self.files)
            except CorruptRecord as exc:
                self.problem(Problem("payload", exc.reason, item.pos, exc.path, exc.offset))
                self.remember(item.pos, item.rtype)
                continue
            live = isinstance(payload, Envelope) and item.pos >= self.live_from and (
                not item.garbage or item.pos in self.active)
            for target, want, field in _references(payload):
                self.check_ref(item, target, want, field, item.pos, needed=live and want is RecordType.DATA)
            self.remember(item.pos, item.rtype)

    def _check_positions(self, cp: ckpt.Checkpoint) -> None:
        end = self.report.log_end
        named = [("head", cp.head), ("working start", cp.working_start), ("garbage end", cp.garbage_end),
                 *((f"runner {k}", p) for k, p in enumerate(cp.runners))]
        for name, pos in named:
            if pos > end:
                self.problem(Problem("checkpoint", f"checkpoint {name} {format_pos(pos)} lies past the end of the "
                                                   f"valid log ({format_pos(end)}): durable records are missing",
                                     pos, os.path.join(self.files.path, ckpt.NAME)))
        if not cp.garbage_end <= cp.working_start <= cp.head:
            self.problem(Problem("checkpoint", "positions out of order: want garbage end <= working start <= head",
                                 path=os.path.join(self.files.path, ckpt.NAME)))


def verify(files: LogFiles, *, recent: int = 1 << 16, max_problems: int = 1000) -> VerifyReport:
    """Every checksum, every payload, every cross-reference, the checkpoint's positions.

    References into segments already reclaimed are counted, not problems.
    """
    return _Verifier(files, recent, max_problems).run()


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

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")


def parse_duration(text: str) -> float:
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (want e.g. 90, 90s, 5m, 1h, 2d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_intervals(text: str) -> tuple[float, ...]:
    """``1m,5m,15m`` -> retry intervals in seconds, checked as SpoolConfig checks them."""
    values = tuple(parse_duration(p) for p in text.split(","))
    return SpoolConfig(retry_intervals=values).retry_intervals


def format_duration(seconds: float) -> str:
    """Whole units where they fit (``5m``, ``1h``), else the two largest units (``3d 4h``)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    if seconds < 60:
        return f"{seconds:g}s"
    parts = []
    rest = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return " ".join(parts[:2])
