"""What the relay will do with a damaged spool: at its next start, and later, when a runner or a read gets there.

``spoolctl verify`` walks the whole log; recovery reads only what it must (the
checkpoint, the listing, the last segment, the working suffix, and one header
per sealed segment the runners will read: docs/design.md, "Recovery"). This
module applies recovery's rules to what verify found, so that an operator
reads, before starting anything, the same decisions the relay will make:

- a torn tail, and damage in the last segment past the last position
  recovery can prove durable (an unacknowledged tail), are **cut**, the bytes
  kept in the quarantine (``spool.engine.recovery.Recovery.find_log_end``, with
  ``proven_by_checkpoint`` and the garbage marks verify saw);
- damage that recovery meets (missing segments, the last segment, the working
  suffix, a sealed size the runners' check reads, the envelope of an attempt
  that was in flight) is **quarantined at start**,
  with the messages it lost named (``spool.read.lost``, as the spool names them);
- damage elsewhere is quarantined **later**, by the first runner or read that
  reaches it, with the same names;
- damage already in the quarantine (a note of the same segment, offset and
  kind) is only met again;
- a damaged checkpoint is moved to the quarantine and the whole log scanned;
  a log that ends before the checkpoint's head goes on in a new segment.

With ``on_damage = "refuse"`` the start stops at the first damage it meets
instead; the plan says so.
"""

from __future__ import annotations

import os

from spool.damage.quarantine import CUT, DIRNAME, SLUGS, entry_name
from spool.engine.core import BODY_SLACK
from spool.engine.recovery import proven_by_checkpoint, working_start
from spool.format.record import RecordType, format_id, format_pos, pos_segment
from spool.read.anomaly import Anomaly, Kind
from spool.read.lost import LogContext, LostMessage, find_lost, outcomes_of
from spool.read.lost import in_flight as in_flight_lost
from spool.tools.inspection import LogFiles, active_envelopes
from spool.tools.verify_report import Action, VerifyReport


def plan(files: LogFiles, report: VerifyReport) -> list[Action]:
    """The relay's decisions about the damage ``report`` found (module docstring): those of its start, then
    those of later, each in log order."""
    cp = report.checkpoint
    actions: list[Action] = []
    if report.checkpoint_error is not None:
        actions.append(Action("start", "checkpoint", f"move the damaged checkpoint to {DIRNAME}/ "
                                                      f"({report.checkpoint_error}) and scan the whole log"))
    elif cp is None:
        actions.append(Action("start", "scan", "no checkpoint: scan the whole log (and say so in its log)"))
    last = files.last
    proven = max(proven_by_checkpoint(cp, last), report.marked_end.get(last, 0))
    cut = next((a for a in report.anomalies if a.segment == last and a.kind is Kind.DAMAGED_RECORD
                and a.offset >= proven), None)
    start = working_start(cp, files.first)
    runners_from = min(cp.runners) if cp is not None and cp.runners else None
    ctx = LogContext(files.reader(cp), report.log_end, runners_from or 0, frozenset(active_envelopes(files, cp)),
                     BODY_SLACK + (cp.body_span if cp is not None else 0), format_id,
                     cp.working_start if cp is not None else 0)
    quarantined = _quarantined(files)
    in_flight = active_envelopes(files, cp)  # envelope -> START: recovery reads each of these envelopes
    for a in report.anomalies:
        if a.torn:
            actions.append(_cut(files, a, "a torn tail: a write the crash interrupted, never acknowledged",
                                quarantined))
        elif cut is not None and a.segment == last and a.offset >= cut.offset:
            if a is cut:
                actions.append(_cut(files, a, f"damage past the last position it can prove durable (offset "
                                              f"{proven}): pages written after the last fsync reached the disk "
                                              "out of order, so nothing from there on was acknowledged",
                                    quarantined))
        else:
            hit = sorted((s, e) for e, s in in_flight.items() if a.pos <= e < a.end or
                         (a.kind is Kind.MISSING_SEGMENT and pos_segment(e) == a.segment))
            extra = tuple(in_flight_lost(s, e, outcomes_of(ctx, s)) for s, e in hit)
            at_start = bool(hit) or _met_at_start(a, last, start, runners_from)
            actions.append(_quarantine(ctx, a, at_start, quarantined, extra))
    if cp is not None and _log_end(report, cut) < cp.head:
        actions.append(Action("start", "new segment", f"go on in a new segment {max(pos_segment(cp.head), last) + 1}"
                                                      f": the log ends at {format_pos(_log_end(report, cut))}, before "
                                                      f"the checkpoint's head {format_pos(cp.head)}, and no queue "
                                                      "id is given twice"))
    actions.sort(key=lambda a: a.when != "start")  # what the start does first, then what comes later
    if any(a.when == "start" and a.what in ("cut", "quarantine", "checkpoint", "new segment") for a in actions):
        actions.append(Action("start", "refuse", 'with on_damage = "refuse" the relay does not start: it names the '
                                                 "first damage it meets and says what to run"))
    return actions


def _log_end(report: VerifyReport, cut: Anomaly | None) -> int:
    return min(report.log_end, cut.pos) if cut is not None else report.log_end


def _met_at_start(a: Anomaly, last: int, start: int, runners_from: int | None) -> bool:
    """Does recovery meet this anomaly (or does it wait for a runner or a read)?"""
    if a.kind is Kind.MISSING_SEGMENT or a.segment == last or a.end > start:
        return True
    return a.kind is Kind.SIZE_MISMATCH and runners_from is not None and a.segment >= pos_segment(runners_from)


def _quarantined(files: LogFiles) -> set[str]:
    try:
        return {n.removesuffix(".json") for n in os.listdir(os.path.join(files.path, DIRNAME)) if n.endswith(".json")}
    except OSError:
        return set()


def _quarantine(ctx: LogContext, a: Anomaly, at_start: bool, quarantined: set[str],
                in_flight: tuple[LostMessage, ...] = ()) -> Action:
    when = "start" if at_start else "later"
    where = f"segment {a.segment} at {a.offset}"
    name = entry_name(a.segment, a.offset, SLUGS[a.kind])
    if name in quarantined:
        return Action(when, "known", f"meet the {a.kind.value} in {where} again: already quarantined "
                                     f"({DIRNAME}/{name}.json)", a)
    lost = tuple(find_lost(ctx, a)) + in_flight
    size = "no bytes (the file is gone)" if a.kind is Kind.MISSING_SEGMENT else f"{a.length} bytes"
    then = "and start" if at_start else "when a runner or a read reaches it, and go on"
    return Action(when, "quarantine", f"quarantine {size} of {where} ({a.kind.value}: {a.message()}) {then}; "
                                      f"{len(lost)} messages lost", a, lost)


def _cut(files: LogFiles, a: Anomaly, why: str, quarantined: set[str]) -> Action:
    try:
        size = files.size(a.segment)
    except OSError:
        size = a.offset + a.length
    slug = SLUGS[Kind.TORN_TAIL] if a.torn else CUT
    envelopes = sum(1 for f in files.reader(None).segment(a.segment, a.offset, types=(RecordType.ENVELOPE,))
                    if not isinstance(f, Anomaly))
    among = f"; {envelopes} envelopes among them" if envelopes else ""
    known = " (kept before)" if entry_name(a.segment, a.offset, slug) in quarantined else ""
    return Action("start", "cut", f"cut {size - a.offset} bytes of segment {a.segment} at {a.offset} and keep them "
                                  f"in {DIRNAME}/{known}: {why}{among}", a)
