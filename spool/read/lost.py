"""Which messages a piece of damage lost, named from the records that survive around it.

Theory of operation. A damaged byte range (or a missing segment) cannot say
what it held, but the records around it often can, because every record names
the ones it depends on (docs/format.md, "Payloads"):

- an **envelope whose body lies in the range** survives and names itself: its
  message is still queued, and will be bounced (or held) when it is delivered,
  since its data cannot be read (``body``);
- a **replacement envelope lost in the range** is named by the FINISH that
  follows it (``replacement`` points into the range): the FINISH names its
  START, the START the envelope it replaced (queue id, sender, recipients),
  and the DELIVERY records of that START say which recipients were done;
- an **attempt whose FINISH was lost in the range** (and with it, most often,
  the replacement envelope just before it) is named by its START, when the
  checkpoint says every attempt begun before its working start had ended: a
  START before it with no FINISH and no replacement to be found after it lost
  them to the damage; if its DELIVERY records left a recipient owed, the
  message went on in the lost replacement;
- a **new message's envelope lost in the range** is named by its body, when the
  DATA records just before the range survive and no surviving envelope
  references them: its queue id is the position where its envelope began (the
  end of its body), and the body's headers say who sent it to whom.

An envelope in the range is *not* lost when a surviving record shows it was
claimed (a START names it: the attempt's own records carry it on) or replaced
(an envelope's ``replaces`` names it), and not when every runner has passed
its position (``live_from``): a runner claims every live envelope it passes,
so one it passed was claimed before the damage, or the runner met the damage
then and named it.

Cost: one walk of a window of the log around the damage: from the start of
the segment before it to ``body_reach`` segments after it (no envelope lies
further from its body), never past ``end``; and one more short walk when a
lost replacement must be matched to its DELIVERY records. Memory: what the
window references into the damaged range, not the window itself.
"""

from __future__ import annotations

import email.parser
import email.policy
import re
from collections.abc import Callable, Container, Iterable
from typing import Any

import attrs

from spool.errors import CorruptRecord
from spool.format.record import (
    Delivery,
    Envelope,
    Finish,
    Frame,
    RecordType,
    Start,
    StartKind,
    Status,
    decode_payload,
    format_pos,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, read_frame_at
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import LogReader

HEAD_BYTES = 2048  # what is read of an orphan body's first chunk to name it by its headers
_NAMED_HEADERS = ("From", "To", "Subject", "Message-ID", "Date")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def printable(text: str, limit: int = 80) -> str:
    """Text from a message for a log line: printable ASCII, at most ``limit`` characters."""
    text = _UNPRINTABLE.sub("?", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@attrs.frozen
class LostMessage:
    """A message the damage took (``what``: its "envelope" is gone, or its "body"), as far as records tell.

    ``queue_id``, ``sender``: None when no surviving record says. ``recipients``:
    those still owed delivery, as far as known. ``evidence``: which records
    named it. ``headers``: from its body, when that is what named it.
    """

    what: str
    queue_id: str | None
    sender: str | None
    recipients: tuple[str, ...]
    evidence: str
    position: int | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        qid = f"queue id {self.queue_id}" if self.queue_id else "queue id unknown"
        sender = f" from <{printable(self.sender)}>" if self.sender is not None else ""
        rcpts = f" to {', '.join('<' + printable(r) + '>' for r in self.recipients[:10])}" if self.recipients else ""
        more = f" and {len(self.recipients) - 10} more" if len(self.recipients) > 10 else ""
        heads = "; " + ", ".join(f"{k}: {printable(v, 60)}" for k, v in self.headers) if self.headers else ""
        if self.what == "body":
            fate = "its data lies in the damaged range: it is bounced (or held) when it comes due"
        else:
            fate = "its envelope lay in the damaged range: it is no longer queued"
        return f"{qid}{sender}{rcpts}{more}: {fate} (named from {self.evidence}){heads}"

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "queue_id": self.queue_id, "sender": self.sender,
                "recipients": list(self.recipients), "evidence": self.evidence,
                "position": None if self.position is None else format_pos(self.position),
                "headers": dict(self.headers)}


@attrs.frozen
class LogContext:
    """What the finder needs to know of the spool besides its files.

    ``end``: read no further (the durable end). ``live_from``: the oldest
    runner's position; envelopes before it were claimed or carried.
    ``active``: envelopes being delivered (their attempt holds them in memory).
    ``body_reach``: the most segments an envelope lies after its body
    (``BODY_SLACK + body_span``). ``queue_id``: how the spool names a message.
    ``settled``: every attempt whose START lies before this position had
    ended (the checkpoint's working start; 0: unknown).
    """

    reader: LogReader
    end: int
    live_from: int
    active: Container[int]
    body_reach: int
    queue_id: Callable[[int], str]
    settled: int = 0


def damaged_range(anomaly: Anomaly, reader: LogReader) -> tuple[int, int] | None:
    """The positions [lo, hi) whose records the anomaly took, or None when it took none.

    A damaged segment header takes no record (the records after it are read);
    a segment longer than its successor recorded holds extra bytes, not fewer
    records; a torn tail was never acknowledged.
    """
    seg = anomaly.segment
    if anomaly.kind is Kind.MISSING_SEGMENT:
        return make_pos(seg, 0), make_pos(seg + 1, 0)
    if anomaly.kind in (Kind.BAD_HEADER, Kind.NEWER_FORMAT, Kind.TORN_TAIL):
        return None
    if anomaly.kind is Kind.SIZE_MISMATCH:
        try:
            if reader.size(seg) > anomaly.offset:
                return None  # extended: the records up to the sealed size are all there
        except OSError:
            pass
    if anomaly.length <= 0:
        return None
    return anomaly.pos, anomaly.end


@attrs.define
class _Window:
    """What one walk of the window collects (all of it references into the range, or small)."""

    lo: int
    hi: int
    stop: int  # where the walk ended
    body_hits: list[tuple[Frame, Envelope]] = attrs.field(factory=list)
    refs: set[int] = attrs.field(factory=set)  # DATA positions before ``hi`` referenced by an envelope
    replaced: set[int] = attrs.field(factory=set)  # envelopes some envelope replaces (all, in the window)
    claims: dict[int, int] = attrs.field(factory=dict)  # START position -> envelope in the range
    ends: dict[int, int | None] = attrs.field(factory=dict)  # FINISH of a claim: START -> replacement
    # STARTs before the range (and before ``settled``) whose FINISH has not been met yet: START -> envelope.
    open_starts: dict[int, int] = attrs.field(factory=dict)
    lost_replacements: dict[int, tuple[int, int]] = attrs.field(factory=dict)  # replacement -> (START, FINISH)
    # Runs of DATA records before lo: (first, end, head of the first chunk, whether the run ended its segment).
    runs: list[tuple[int, int, bytes, bool]] = attrs.field(factory=list)
    _run: list[Any] = attrs.field(factory=list)

    def inside(self, pos: int) -> bool:
        return self.lo <= pos < self.hi

    def abuts(self, end: int, ended_segment: bool) -> bool:
        """Does a run ending at ``end`` end where the range begins? (Its envelope lay in the range.)

        A run that ended its segment abuts a range that begins with the next
        segment's first record: the envelope did not fit, so it began the next
        segment (its queue id is still ``end``, the head when it was appended).
        """
        if self.inside(end):
            return True
        nxt = pos_segment(end) + 1
        return ended_segment and pos_segment(self.lo) == nxt and self.lo <= make_pos(nxt, SEGMENT_HEADER_SIZE)


def find_lost(ctx: LogContext, anomaly: Anomaly) -> list[LostMessage]:
    """The messages ``anomaly`` lost, named as far as the surviving records allow (module docstring)."""
    rng = damaged_range(anomaly, ctx.reader)
    if rng is None:
        return []
    lo, hi = rng
    win = _walk(ctx, lo, hi)
    lost: list[LostMessage] = []
    for frame, env in win.body_hits:
        if frame.pos in win.replaced:
            continue  # replaced since (its mark was lost): the replacement is named, if live
        lost.append(LostMessage("body", ctx.queue_id(env.message_id), env.sender, env.recipients,
                                f"its envelope at {format_pos(frame.pos)}", frame.pos))
    claimed = set(win.claims.values())
    for repl, (start, fin) in sorted(win.lost_replacements.items()):
        if repl in win.replaced or repl in claimed or repl < ctx.live_from:
            continue
        lost.append(_named_by_finish(ctx, repl, start, fin))
    for start_pos, env_pos in sorted(win.open_starts.items()):
        if env_pos in win.replaced or env_pos in ctx.active:
            continue  # its replacement survives, or the attempt is being delivered right now
        named = _named_by_start(ctx, start_pos, env_pos, win.stop)
        if named is not None:
            lost.append(named)
    for first, end, head, ended_segment in win.runs:
        if not win.abuts(end, ended_segment) or end in claimed or end in win.replaced or end in win.lost_replacements \
                or end < ctx.live_from:
            continue
        if any(first <= r < end for r in win.refs):
            continue
        lost.append(LostMessage("envelope", ctx.queue_id(end), None, (), f"its body at {format_pos(first)}",
                                end, _headers(head)))
    return lost


def _walk(ctx: LogContext, lo: int, hi: int) -> _Window:
    reader = ctx.reader
    seg = pos_segment(lo)
    first = max(seg - 1, reader.segments[0] if reader.segments else seg)
    start = make_pos(first, SEGMENT_HEADER_SIZE)
    stop = min(ctx.end, make_pos(pos_segment(hi) + ctx.body_reach + 1, 0))
    win = _Window(lo, hi, stop)
    if stop <= start:
        return win
    for item in reader.read(start, stop):
        if win._run and pos_segment(item.pos) != pos_segment(win._run[0]):
            _end_run(win, ended_segment=True)
        if isinstance(item, Anomaly):
            _end_run(win)
            continue
        _note(ctx, win, item)
    _end_run(win, ended_segment=pos_segment(stop) > pos_segment(lo))
    return win


def _end_run(win: _Window, *, ended_segment: bool = False) -> None:
    if win._run:
        first, end, head = win._run
        win.runs.append((first, end, head, ended_segment))
        win._run = []


def _note(ctx: LogContext, win: _Window, frame: Frame) -> None:
    rtype, pos = frame.rtype, frame.pos
    if rtype == RecordType.DATA:
        if pos >= win.lo:
            _end_run(win)
        elif win._run and win._run[1] == pos:
            win._run[1] = pos + frame.size
        else:
            _end_run(win)
            win._run = [pos, pos + frame.size, frame.payload[:HEAD_BYTES]]
        return
    _end_run(win)
    if rtype not in (RecordType.ENVELOPE, RecordType.START, RecordType.FINISH):
        return
    try:
        payload = decode_payload(rtype, frame.payload)
    except CorruptRecord:
        return
    if isinstance(payload, Envelope):
        if payload.replaces is not None:
            win.replaced.add(payload.replaces)
        for p in payload.body:
            if p < win.hi:
                win.refs.add(p)
        live = not frame.garbage or pos in ctx.active
        if live and any(win.inside(p) for p in payload.body):
            win.body_hits.append((frame, payload))
    elif isinstance(payload, Start):
        if win.inside(payload.envelope):
            win.claims[pos] = payload.envelope
        elif pos < win.lo and pos < ctx.settled:
            win.open_starts[pos] = payload.envelope
    elif isinstance(payload, Finish):
        win.open_starts.pop(payload.start, None)
        if payload.start in win.claims:
            win.ends[payload.start] = payload.replacement
        if payload.replacement is not None and win.inside(payload.replacement):
            win.lost_replacements[payload.replacement] = (payload.start, pos)


def _named_by_finish(ctx: LogContext, repl: int, start_pos: int, fin_pos: int) -> LostMessage:
    """A replacement envelope lost at ``repl``: its START, the envelope that START claimed, and its outcomes."""
    evidence = f"the FINISH at {format_pos(fin_pos)}"
    start = _read(ctx.reader, start_pos, RecordType.START)
    env = None
    if isinstance(start, Start):
        evidence += f", the START at {format_pos(start_pos)}"
        env = _read(ctx.reader, start.envelope, RecordType.ENVELOPE)
    done, owed = _outcomes(ctx, start_pos, fin_pos)
    if isinstance(env, Envelope):
        evidence += f" and the envelope at {format_pos(start.envelope)}"
        rcpts = tuple(r for r in env.recipients if r not in done)
        return LostMessage("envelope", ctx.queue_id(env.message_id), env.sender, rcpts, evidence, repl)
    if owed:
        evidence += " and its DELIVERY records"
    return LostMessage("envelope", None, None, tuple(owed), evidence, repl)


def _named_by_start(ctx: LogContext, start_pos: int, env_pos: int, stop: int) -> LostMessage | None:
    """An attempt that had ended (by the checkpoint) but whose FINISH is nowhere after its START: lost in the
    range, with the replacement written before it. Lost only if its DELIVERY records left a recipient owed."""
    env = _read(ctx.reader, env_pos, RecordType.ENVELOPE)
    done, owed = _outcomes(ctx, start_pos, stop)
    if not isinstance(env, Envelope):
        return None if not owed else LostMessage(
            "envelope", None, None, tuple(owed), f"the START at {format_pos(start_pos)} (its FINISH and replacement "
            "are gone) and its DELIVERY records")
    rcpts = tuple(r for r in env.recipients if r not in done)
    if not rcpts or not (owed or _admin_or_carry(ctx, start_pos)):
        return None
    return LostMessage("envelope", ctx.queue_id(env.message_id), env.sender, rcpts,
                       f"the START at {format_pos(start_pos)} (its FINISH and replacement are gone) and the envelope "
                       f"at {format_pos(env_pos)}")


def _admin_or_carry(ctx: LogContext, start_pos: int) -> bool:
    """Did the START claim its message for an admin change or to carry it held (which always replace it)?"""
    start = _read(ctx.reader, start_pos, RecordType.START)
    return isinstance(start, Start) and start.kind is not StartKind.DELIVERY


def _outcomes(ctx: LogContext, start_pos: int, fin_pos: int) -> tuple[set[str], list[str]]:
    """Recipients with a final outcome in the START's DELIVERY records, and those it deferred."""
    done: set[str] = set()
    owed: dict[str, None] = {}
    if start_pos >= fin_pos:
        return done, []
    for item in ctx.reader.read(start_pos, fin_pos, types=(RecordType.DELIVERY,)):
        if isinstance(item, Anomaly):
            continue
        try:
            payload = decode_payload(item.rtype, item.payload)
        except CorruptRecord:
            continue
        if isinstance(payload, Delivery) and payload.start == start_pos:
            for o in payload.outcomes:
                if Status(o.status).final:
                    done.add(o.recipient)
                    owed.pop(o.recipient, None)
                else:
                    owed[o.recipient] = None
    return done, list(owed)


def _read(reader: LogReader, pos: int, rtype: RecordType) -> Any:
    """The payload at ``pos`` if a valid record of that type is there, else None."""
    seg = pos_segment(pos)
    path = reader.path(seg)
    try:
        fd = reader.io.open_read(path)
    except OSError:
        return None
    try:
        frame = read_frame_at(reader.io, fd, path, seg, pos_offset(pos))
        if frame.rtype != rtype:
            return None
        return decode_payload(frame.rtype, frame.payload)
    except (CorruptRecord, OSError):
        return None
    finally:
        reader.io.close(fd)


def _headers(head: bytes) -> tuple[tuple[str, str], ...]:
    """The naming headers of a message's first bytes (From, To, Subject, Message-ID, Date), as text."""
    try:
        msg = email.parser.BytesHeaderParser(policy=email.policy.compat32).parsebytes(head)
    except Exception:  # a header block the parser cannot read names nothing
        return ()
    out = []
    for name in _NAMED_HEADERS:
        value = msg.get(name)
        if value is not None:
            out.append((name, printable(" ".join(str(value).split()), 120)))
    return tuple(out)


def in_flight(start_pos: int, env_pos: int, outcomes: dict[str, int]) -> LostMessage:
    """An attempt in flight at the crash whose envelope the damage took: named by its START and its DELIVERY
    records (``outcomes``: recipient -> status), which are all that is left of it."""
    owed = tuple(r for r, status in outcomes.items() if not Status(status).final)
    records = " and its DELIVERY records" if outcomes else ""
    return LostMessage("envelope", None, None, owed,
                       f"the START at {format_pos(start_pos)} of an attempt in flight at the crash{records}", env_pos)


def outcomes_of(ctx: LogContext, start_pos: int) -> dict[str, int]:
    """The last outcome each recipient got in the DELIVERY records of the START at ``start_pos``."""
    out: dict[str, int] = {}
    for item in ctx.reader.read(start_pos, ctx.end, types=(RecordType.DELIVERY,)):
        if isinstance(item, Anomaly):
            continue
        try:
            payload = decode_payload(item.rtype, item.payload)
        except CorruptRecord:
            continue
        if isinstance(payload, Delivery) and payload.start == start_pos:
            for o in payload.outcomes:
                out[o.recipient] = int(o.status)
    return out


def describe_all(lost: Iterable[LostMessage]) -> list[dict[str, Any]]:
    return [m.as_dict() for m in lost]
