"""Queue runners: cursors that trail the head of the log by their retry interval.

Theory of operation (Finch's log-structured queue). A runner of class k keeps a
position in the log. Every record carries the second it was appended, and the
log is in time order, so the runner may pass every record older than
``now - interval(k)``: each live envelope of class k that it passes is due.
It stops at the first younger record and wakes when that one comes due.

The scan reads through the log reader's header-only walk
(``spool.read.reader.HeaderWalk``): it decides from the 16-byte header alone (type,
garbage flag, class, time), so garbage records, other classes' envelopes and
message bodies are passed without decoding, and a body larger than the read
window is skipped with a seek, never read. Only a candidate envelope is
checksummed and decoded. Damage the walk meets raises CorruptSegment naming
the segment and offset that the reader names (as ``spoolctl verify`` does).

Idle runners cost nothing. A runner remembers why its last pass stopped: at
the end of the durable log (then only a longer log can give it work), at a
record not yet due (then only time can: ``wake_at``), or at its limit (then
the next pass goes on at once). ``scan`` returns without reading anything
while neither the log nor the clock has moved past that point, so the caller
may poll it as often as it likes.

The last class is also the *sweeper*: it carries held messages forward (no
runner starts them otherwise), so that nothing live is left behind the oldest
runner and the log behind it is garbage.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

from spool.fileio import FileIO
from spool.format.record import HELD_CLASS, Frame, make_pos, pos_offset, pos_segment
from spool.format.segment import SEGMENT_HEADER_SIZE
from spool.read.reader import HeaderWalk, LogReader, Reporter, raise_anomaly


class LogBounds(Protocol):
    """What a runner needs to know of the log: how far it may read."""

    @property
    def durable_end(self) -> int: ...

    def segment_end(self, seg: int) -> int: ...


Candidate = Frame
"""A due envelope as the walk found it (position, class, time, payload), checksum verified. The walk's own
``Frame``: a pass hands its frames on as they are, with no second object built for each."""


class Runner:
    def __init__(self, io: FileIO, log_dir: str, klass: int, interval: float, pos: int, *,
                 sweeper: bool = False, reporter: Reporter = raise_anomaly) -> None:
        self.io = io
        self.log_dir = log_dir
        self.klass = klass
        self.interval = interval
        self.pos = pos
        self.sweeper = sweeper
        self.wake_at: float | None = None
        # The durable end at which the last pass found nothing more to read (None: it did not reach the end).
        self._end_seen: int | None = None
        self.passes = 0
        self._classes = frozenset((klass, HELD_CLASS) if sweeper else (klass,))
        self._walk = HeaderWalk(LogReader(io, log_dir), reporter)

    @property
    def records_scanned(self) -> int:
        return self._walk.records

    @property
    def bytes_read(self) -> int:
        return self._walk.bytes_read

    def close(self) -> None:
        self._walk.close()

    def idle(self, durable_end: int, now: float) -> bool:
        """Would a pass now find nothing? True only when neither the log nor the clock moved enough."""
        if self.wake_at is not None:
            return now < self.wake_at
        return self._end_seen == durable_end

    @property
    def has_more(self) -> bool:
        """Did the last pass stop at its limit, with more perhaps due right now?"""
        return self.wake_at is None and self._end_seen is None

    def scan(self, log: LogBounds, now: float, limit: int, skip: Container[int]) -> list[Candidate]:
        """Advance over what is due and return up to ``limit`` candidate envelopes.

        The position moves past a candidate as it is returned: the caller must
        claim it (append a START) before anything else reads the position.
        Returns at once, reading nothing, while the runner is ``idle``.
        """
        durable = log.durable_end
        if limit <= 0 or self.idle(durable, now):
            return []
        self.passes += 1
        cutoff = now - self.interval
        found: list[Frame] = []
        self.wake_at = None
        self._end_seen = None
        while len(found) < limit:
            seg, off = pos_segment(self.pos), pos_offset(self.pos)
            end = log.segment_end(seg)
            if off >= end:
                if seg < pos_segment(durable):
                    self.pos = make_pos(seg + 1, SEGMENT_HEADER_SIZE)
                    continue
                self._end_seen = durable
                break
            off, too_new = self._walk.select(seg, off, end, until=cutoff, classes=self._classes, skip=skip,
                                             limit=limit, out=found)
            self.pos = make_pos(seg, off)
            if too_new is not None:
                self.wake_at = too_new + self.interval
                break
        return found
