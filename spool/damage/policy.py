"""What the spool does with damage: the one policy every reader of the log hands its anomalies to.

Theory of operation. ``spool.read.reader`` names damage; this module decides what
it means, once, for recovery, the runners, the admin reads and the body reads
alike (docs/design.md, "Recovery"; docs/operations.md, "When the disk lies"):

- ``quarantine`` (the default): the damaged byte range is copied to
  ``DIR/quarantine`` with its segment and offsets (``spool.damage.quarantine``), the
  messages it lost are named from the surviving records (``spool.read.lost``), one
  log line says what and where, one more line per lost message names it, and
  the reader goes on at the next valid record. The segment itself is not
  touched: its bytes stay where they were until it is reclaimed.
- ``refuse``: a *start* that meets damage stops, with a message that says what
  to run (``spoolctl verify``, ``spoolctl salvage``). Damage met later, while
  the relay runs, is quarantined all the same: a relay that died on it would
  start again (the damage lies behind the checkpoint) and die again when a
  runner reached it, a crash loop.

Damage is recognised when it is met again (the next runner, the next start):
in memory by (kind, segment, offset), and across starts by its note in the
quarantine directory. It is copied and named once.

Counters (read by the relay's metrics at scrape time): anomalies met by kind,
bytes quarantined, messages named lost, bodies found damaged, since the
start; and what the quarantine directory holds.

Cost. Quarantining copies the damaged range (at most a segment) and names the
lost messages with one walk of a few segments around it (``spool.read.lost``). It
runs where the damage was met, in the thread that met it (a runner's scan
runs on the relay's event loop: a stall of that walk, once per piece of
damage).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

from spool.damage.quarantine import CUT, SLUGS, Quarantine, anomaly_note, entry_name
from spool.errors import CorruptSegment, FormatVersionError, SpoolError
from spool.fileio import FileIO
from spool.format.record import format_pos
from spool.read.anomaly import Anomaly, Kind
from spool.read.lost import LogContext, LostMessage, find_lost
from spool.read.reader import Reporter

log = logging.getLogger("spool.read.anomaly")

QUARANTINE: Final = "quarantine"
REFUSE: Final = "refuse"
MODES: Final = (QUARANTINE, REFUSE)
RECENT = 100  # lost messages kept in memory for whoever asks (the metrics, a test); the notes keep them all


class DamageRefused(CorruptSegment):
    """``on_damage = "refuse"``: the start met damage and stops, saying what to run."""


def refusal(anomaly: Anomaly | None, spool_dir: str, what: str = "") -> SpoolError:
    """The error of a start that refuses: the damage, and what to run."""
    hint = (f'on_damage = "refuse" stops the start here: run `spoolctl verify {spool_dir}` to see what is damaged '
            f'and what would be lost; then start with on_damage = "quarantine" (the damaged bytes go to '
            f"{os.path.join(spool_dir, 'quarantine')}, the rest is kept) or copy every readable message into a "
            f"fresh spool with `spoolctl salvage {spool_dir} --into NEWDIR`")
    if anomaly is None:
        return DamageRefused(f"{what}; {hint}", os.path.join(spool_dir, "checkpoint"), 0)
    if anomaly.kind is Kind.NEWER_FORMAT:
        return FormatVersionError(f"{anomaly.path}: {anomaly.reason}")
    return DamageRefused(f"{what or anomaly.message()}; {hint}", anomaly.path, anomaly.offset)


class DamagePolicy:
    """One spool's answer to damage (module docstring). ``context`` says what the finder of lost messages
    needs of the spool now (``spool.read.lost.LogContext``); without it nothing is named."""

    def __init__(self, io: FileIO, spool_dir: str, mode: str = QUARANTINE,
                 context: Callable[[], LogContext | None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"on_damage must be one of {', '.join(MODES)}, got {mode!r}")
        self.io = io
        self.spool_dir = spool_dir
        self.mode = mode
        self.context = context
        self.quarantine = Quarantine(io, spool_dir)
        self._lock = threading.RLock()
        self._seen: dict[tuple[Kind, int, int], list[LostMessage]] = {}
        self.found: Counter[str] = Counter()  # anomalies met (each once), by kind (Kind.name, lower case)
        self.known_met = 0  # met again after a restart: quarantined before
        self.bytes_quarantined = 0
        self.bytes_cut = 0
        self.lost_named = 0
        self.damaged_bodies = 0
        self.lost_recent: deque[LostMessage] = deque(maxlen=RECENT)
        # True while recovery runs (``recovering``): then ``refuse`` refuses (and a segment of a newer format
        # always does).
        self.starting = False

    @contextmanager
    def recovering(self, context: Callable[[], LogContext | None]) -> Iterator[None]:
        """While recovery runs: a start that may refuse, and the finder of lost messages told how far the log
        reaches by recovery itself (``context``), which knows it before the spool has a writer."""
        saved = self.context
        self.starting, self.context = True, context
        try:
            yield
        finally:
            self.starting, self.context = False, saved

    # -- the reporters readers are given ---------------------------------------------------

    def reporter(self, who: str) -> Reporter:
        """The reporter of a reader that must go on: ``who`` is named in the log line (a runner, an admin read)."""
        def report(anomaly: Anomaly) -> None:
            self.report(anomaly, who)
        return report

    # -- damage ---------------------------------------------------------------------------

    def report(self, anomaly: Anomaly, who: str) -> list[LostMessage]:
        """Quarantine ``anomaly`` and name what it lost (once; the names of the first meeting are returned
        again). A reader goes on after it returns. Raises only while ``starting``: the refusal of
        ``refuse`` (DamageRefused), or FormatVersionError for a segment of a newer format."""
        if anomaly.torn:
            return []  # a torn tail is a crash's, not damage: recovery cuts it (``cut``)
        if self.starting and (self.mode == REFUSE or anomaly.kind is Kind.NEWER_FORMAT):
            raise refusal(anomaly, self.spool_dir)
        key = (anomaly.kind, anomaly.segment, anomaly.offset)
        with self._lock:
            if key in self._seen:
                return self._seen[key]
            self._seen[key] = []
            self.found[anomaly.kind.name.lower()] += 1
            name = entry_name(anomaly.segment, anomaly.offset, SLUGS[anomaly.kind])
            if self.quarantine.known(name):
                self.known_met += 1
                log.warning("%s at offset %d (segment %d): %s, met by %s; quarantined before: see %s.json",
                            anomaly.path, anomaly.offset, anomaly.segment, anomaly.kind.value, who,
                            os.path.join(self.quarantine.path, name))
                return []
            lost = self._find_lost(anomaly)
            self._seen[key] = lost
            action = "quarantined; the records around it are kept"
            source = (anomaly.path, anomaly.offset, anomaly.length) if anomaly.kind is not Kind.MISSING_SEGMENT \
                else None
            note = self.quarantine.keep(name, anomaly_note(anomaly, self.spool_dir, found_by=who, action=action,
                                                           lost=[m.as_dict() for m in lost]), source)
            self.bytes_quarantined += note["bytes_kept"]
            kept = f"{note['bytes_kept']} bytes kept in {os.path.join(self.quarantine.path, name)}.bin" \
                if note["bytes_kept"] else f"note in {os.path.join(self.quarantine.path, name)}.json"
            log.error("damage in %s at offset %d (segment %d, %d bytes): %s; met by %s; %s; %s; %d messages lost",
                      anomaly.path, anomaly.offset, anomaly.segment, anomaly.length, anomaly.message(), who,
                      "quarantined, the records around it are kept", kept, len(lost))
            self._name(lost, anomaly)
            return lost

    def name_more(self, anomaly: Anomaly, lost: Sequence[LostMessage]) -> None:
        """Messages a reader found lost to ``anomaly`` beyond what the finder named (an in-flight attempt whose
        envelope is gone): logged and counted, and added to the note."""
        with self._lock:
            key = (anomaly.kind, anomaly.segment, anomaly.offset)
            known = {(m.queue_id, m.position, m.recipients) for m in self._seen.get(key, [])}
            fresh = [m for m in lost if (m.queue_id, m.position, m.recipients) not in known]
            if not fresh:
                return
            self._seen.setdefault(key, []).extend(fresh)
            self.quarantine.add_lost(entry_name(anomaly.segment, anomaly.offset, SLUGS[anomaly.kind]),
                                     [m.as_dict() for m in fresh])
            self._name(fresh, anomaly)

    def body_damaged(self) -> None:
        """A delivery found its message's data damaged (the message is bounced or held by the relay)."""
        with self._lock:
            self.damaged_bodies += 1

    def _name(self, lost: Iterable[LostMessage], anomaly: Anomaly) -> None:
        for m in lost:
            self.lost_named += 1
            self.lost_recent.append(m)
            log.error("lost message: %s; damage at %s (%s)", m.describe(), format_pos(anomaly.pos), anomaly.path)

    def _find_lost(self, anomaly: Anomaly) -> list[LostMessage]:
        ctx = self.context() if self.context is not None else None
        if ctx is None:
            return []
        try:
            return find_lost(ctx, anomaly)
        except OSError as exc:  # the files changed under the walk: name what cannot be named, go on
            log.warning("naming what %s at offset %d lost failed: %s", anomaly.path, anomaly.offset, exc)
            return []

    # -- cuts: bytes that were never acknowledged -----------------------------------------------

    def cut(self, anomaly: Anomaly, why: str, unacknowledged: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """Keep the bytes recovery is about to cut from the end of the log (a torn tail, or an unacknowledged
        tail: docs/design.md, "Recovery") in the quarantine directory, and say so in one line.

        ``unacknowledged``: the envelopes among the cut bytes (as ``spool.read.lost.LostMessage.as_dict``), for
        the note: under the crash model none was acknowledged; if the disk, not a crash, damaged the
        bytes, they are the messages to salvage from the quarantined file.
        """
        if not anomaly.torn and self.starting and self.mode == REFUSE:
            raise refusal(anomaly, self.spool_dir, f"{anomaly.message()}: {why}")
        with self._lock:
            slug = SLUGS[Kind.TORN_TAIL] if anomaly.torn else CUT
            name = entry_name(anomaly.segment, anomaly.offset, slug)
            note = anomaly_note(anomaly, self.spool_dir, found_by="recovery", action=why)
            note["kind"] = anomaly.kind.value if anomaly.torn else "unacknowledged tail"
            note["damage"] = None if anomaly.torn else anomaly.kind.value
            note["unacknowledged"] = list(unacknowledged)
            note = self.quarantine.keep(name, note, (anomaly.path, anomaly.offset, anomaly.length))
            self.bytes_cut += anomaly.length
            if not anomaly.torn:
                self.found["cut"] += 1
            return note

    # -- whole files: the checkpoint, the workers' marks ------------------------------------------------

    def marks_damaged(self, path: str, reason: str, now_ms: int) -> None:
        """A delivery worker's marks file that fails its checks: refused, or moved to the quarantine. Either way
        the recovery that found it holds every recipient of every attempt in flight without an outcome in doubt
        (it cannot tell which final dots went). Raises the refusal in ``refuse`` mode, OSError when it cannot be
        moved."""
        self._file_damaged(path, reason, f"marks-{now_ms:013d}-{os.path.basename(path)}", "marks",
                           "damaged marks file", "every attempt in flight held in doubt",
                           "every attempt in flight is held in doubt")

    def checkpoint_damaged(self, path: str, reason: str, now_ms: int) -> None:
        """A checkpoint that fails its checks: refused, or moved to the quarantine (the start scans the
        whole log). Raises the refusal in ``refuse`` mode, OSError when it cannot be moved."""
        self._file_damaged(path, reason, f"checkpoint-{now_ms:013d}", "checkpoint", "damaged checkpoint",
                           "the start scanned the whole log", "scanning the whole log")

    def _file_damaged(self, path: str, reason: str, name: str, found: str, kind: str, action: str,
                      then: str) -> None:
        """A whole file that recovery cannot use: refused, or moved to the quarantine as ``name`` with its note
        (``action``: what the start did), counted under ``found`` and said in one line (``then``)."""
        if self.mode == REFUSE:
            raise refusal(None, self.spool_dir, f"{path}: {reason}")
        with self._lock:
            self.quarantine.move_in(path, name, {"kind": kind, "file": os.path.basename(path), "reason": reason,
                                                 "found_by": "recovery", "action": f"moved here; {action}"})
            self.found[found] += 1
            log.error("%s %s (%s): moved to %s.bin; %s", kind, path, reason, os.path.join(self.quarantine.path, name),
                      then)
