"""``spoolctl verify``: every checksum, every payload, every cross-reference, the checkpoint's positions.

Theory of operation. The log is walked once through ``spool.read.reader``, which
names every anomaly (damaged records, damaged headers, missing segments,
sealed sizes that disagree, segments shorter than the checkpoint's head, a
torn tail) exactly as every other reader of the log names it; the verifier
turns them into problems and adds what only it checks: payloads that pass
their checksum but do not decode, references between records, and the
checkpoint's positions against the end of the log.

Memory. ``verify`` keeps the types of the last ``recent`` frames it passed
(an ordered map of at most ``recent`` entries, 65,536 by default: a few MiB)
and checks older references with one positioned read each, so its memory does
not grow with the log. It also keeps the envelopes of the attempts in flight
(bounded by the engine's active limit) and one range per damaged stretch; the
problem list is capped at ``max_problems`` entries (the total is still
counted).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable

from spool.errors import CorruptRecord, FormatVersionError
from spool.format import checkpoint as ckpt
from spool.format.record import (
    Delivery,
    Envelope,
    Finish,
    Frame,
    Payload,
    RecordType,
    Start,
    format_pos,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import bad_payload
from spool.tools.inspection import LogFiles, active_envelopes, decode, live_start, type_name
from spool.tools.start_plan import plan
from spool.tools.verify_report import Problem, VerifyReport


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
        cp = report.checkpoint = self._checkpoint()
        self.live_from = live_start(files, cp)
        self.active = active_envelopes(files, cp)
        reader = files.reader(cp)
        for seg in reader.segment_ids():
            walk = reader.segment(seg)
            self._segment(seg, walk)
            if not walk.found and seg in self.present:
                self.first = max(self.first, seg + 1)  # reclaimed by a running relay while we read
        if cp is not None:
            self._check_positions(cp)
        return report

    def _checkpoint(self) -> ckpt.Checkpoint | None:
        try:
            return self.files.load_checkpoint()
        except (CorruptRecord, FormatVersionError) as exc:
            self.report.checkpoint_error = str(getattr(exc, "reason", None) or exc)
            path = getattr(exc, "path", "") or os.path.join(self.files.path, ckpt.NAME)
            self.problem(Problem("checkpoint", f"{getattr(exc, 'reason', exc)}; removing it makes the next "
                                               "open scan the whole log", path=path,
                                 offset=getattr(exc, "offset", None)))
            return None

    def _segment(self, seg: int, items: Iterable[Frame | Anomaly]) -> None:
        report = self.report
        if seg in self.present:
            report.segments += 1
        before = report.log_end
        if seg in self.present:
            report.log_end = make_pos(seg, SEGMENT_HEADER_SIZE)
        for item in items:
            if isinstance(item, Anomaly):
                self._anomaly(item, before)
                continue
            report.records += 1
            report.by_type[type_name(item.rtype)] += 1
            report.log_end = item.pos + item.size
            if item.garbage and item.rtype == RecordType.ENVELOPE:
                report.marked_end[seg] = pos_offset(item.pos) + item.size
            try:
                payload = decode(item, self.files)
            except CorruptRecord as exc:
                self._anomaly(bad_payload(item, self.files.seg_path(seg), exc), before)
                self.remember(item.pos, item.rtype)
                continue
            live = isinstance(payload, Envelope) and item.pos >= self.live_from and (
                not item.garbage or item.pos in self.active)
            for target, want, field in _references(payload):
                self.check_ref(item, target, want, field, item.pos, needed=live and want is RecordType.DATA)
            self.remember(item.pos, item.rtype)

    def _anomaly(self, a: Anomaly, before: int) -> None:
        report = self.report
        if len(report.anomalies) < self.max_problems:
            report.anomalies.append(a)
        if a.kind is Kind.MISSING_SEGMENT:
            self.problem(Problem.of(a))
            return
        if a.offset == 0:
            report.log_end = before  # no usable header: the log ends in the segment before, unless records follow
        self.damaged.append((a.pos, a.end))
        if a.torn:
            report.torn_tail = a
        else:
            self.problem(Problem.of(a))

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
    ``report.plan`` says what the relay will do with the damage at its next
    start, and later (``spool.tools.start_plan``).
    """
    report = _Verifier(files, recent, max_problems).run()
    report.plan = plan(files, report)
    return report


