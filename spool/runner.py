"""Queue runners: cursors that trail the head of the log by their retry interval.

Theory of operation (Finch's log-structured queue). A runner of class k keeps a
position in the log. Every record carries the second it was appended, and the
log is in time order, so the runner may pass every record older than
``now - interval(k)``: each live envelope of class k that it passes is due.
It stops at the first younger record and wakes when that one comes due.

The scan decides from the 16-byte header alone (type, garbage flag, class,
time): garbage records, other classes' envelopes and message bodies are passed
without decoding, and a body larger than the read window is skipped with a
seek, never read. Only a candidate envelope is checksummed and decoded.

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

import attrs

from spool.errors import CorruptRecord, CorruptSegment
from spool.fileio import FileIO, read_exact
from spool.record import (
    GARBAGE,
    HEADER,
    HEADER_SIZE,
    HELD_CLASS,
    RecordType,
    decode_frame,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.segment import SEGMENT_HEADER_SIZE, segment_path

WINDOW = 1 << 20
_ENVELOPE = int(RecordType.ENVELOPE)
_MAX_TYPE = max(int(t) for t in RecordType)
_unpack = HEADER.unpack_from


class LogBounds(Protocol):
    """What a runner needs to know of the log: how far it may read."""

    @property
    def durable_end(self) -> int: ...

    def segment_end(self, seg: int) -> int: ...


@attrs.frozen
class Candidate:
    pos: int
    klass: int
    time: int
    payload: bytes


class Runner:
    def __init__(self, io: FileIO, log_dir: str, klass: int, interval: float, pos: int, *,
                 sweeper: bool = False) -> None:
        self.io = io
        self.log_dir = log_dir
        self.klass = klass
        self.interval = interval
        self.pos = pos
        self.sweeper = sweeper
        self.wake_at: float | None = None
        # The durable end at which the last pass found nothing more to read (None: it did not reach the end).
        self._end_seen: int | None = None
        self.records_scanned = 0
        self.passes = 0
        self.bytes_read = 0
        self._fd = -1
        self._fd_seg = -1
        self._buf = b""
        self._buf_start = 0

    def close(self) -> None:
        if self._fd >= 0:
            self.io.close(self._fd)
            self._fd = -1
            self._fd_seg = -1

    def _open(self, seg: int) -> None:
        if self._fd_seg != seg:
            self.close()
            self._fd = self.io.open_read(segment_path(self.log_dir, seg))
            self._fd_seg = seg
            self._buf = b""
            self._buf_start = 0

    def _window(self, seg: int, off: int, end: int, need: int) -> None:
        """Make the buffer start at ``off`` with at least ``need`` bytes (bounded by end)."""
        self._open(seg)
        size = min(max(need, WINDOW), end - off)
        self._buf = read_exact(self.io, self._fd, size, off)
        self._buf_start = off
        self.bytes_read += len(self._buf)

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
        out: list[Candidate] = []
        self.wake_at = None
        self._end_seen = None
        while len(out) < limit:
            seg, off = pos_segment(self.pos), pos_offset(self.pos)
            end = log.segment_end(seg)
            if off >= end:
                if seg < pos_segment(durable):
                    self.pos = make_pos(seg + 1, SEGMENT_HEADER_SIZE)
                    continue
                self._end_seen = durable
                break
            if end - off < HEADER_SIZE:
                raise CorruptSegment(f"{end - off} stray bytes where a record header should be",
                                     segment_path(self.log_dir, seg), off)
            rel = off - self._buf_start
            if self._fd_seg != seg or rel < 0 or rel + HEADER_SIZE > len(self._buf):
                self._window(seg, off, end, HEADER_SIZE)
                rel = 0
            stop, off = self._scan_window(seg, off, end, cutoff, limit, skip, out)
            self.pos = make_pos(seg, off)
            if stop:
                break
        return out

    def _scan_window(self, seg: int, off: int, end: int, cutoff: float, limit: int, skip: Container[int],
                     out: list[Candidate]) -> tuple[bool, int]:
        """The hot loop. Returns (stopped for time or limit, new offset)."""
        buf = self._buf
        base = self._buf_start
        rel = off - base
        avail = min(len(buf), end - base)
        mine = self.klass
        sweeper = self.sweeper
        scanned = 0
        try:
            while rel + HEADER_SIZE <= avail:
                _crc, length, rtype, flags, klass, res, t = _unpack(buf, rel)
                if not 0 < rtype <= _MAX_TYPE or res or flags & ~GARBAGE:
                    # Zeroed or overwritten bytes: never pass them as if they were records.
                    raise CorruptSegment(f"no valid record header (type {rtype})", segment_path(self.log_dir, seg),
                                         base + rel)
                if t > cutoff:
                    self.wake_at = t + self.interval
                    return True, base + rel
                size = HEADER_SIZE + length
                if rel + size > avail:
                    if base + rel + size > end:
                        raise CorruptSegment(f"length {length} runs past the end of the log",
                                             segment_path(self.log_dir, seg), base + rel)
                    if rtype != _ENVELOPE or flags & GARBAGE:
                        rel += size  # skip a large body without reading it
                        self._buf = b""
                        return False, base + rel
                    self._window(seg, base + rel, end, size)
                    return False, base + rel
                scanned += 1
                if rtype == _ENVELOPE and not flags & GARBAGE and (
                        klass == mine or (sweeper and klass == HELD_CLASS)):
                    pos = make_pos(seg, base + rel)
                    if pos not in skip:
                        try:
                            frame = decode_frame(seg, buf[rel:rel + size], 0)
                        except CorruptRecord as exc:
                            raise CorruptSegment(str(exc).split(": ", 1)[-1], segment_path(self.log_dir, seg),
                                                 base + rel) from None
                        out.append(Candidate(pos, klass, t, frame.payload))
                        if len(out) >= limit:
                            return True, base + rel + size
                rel += size
            if base + rel < end:
                self._window(seg, base + rel, end, HEADER_SIZE)
            return False, base + rel
        finally:
            self.records_scanned += scanned
