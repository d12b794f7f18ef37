"""What counts as damage: the one classification of a frame that fails, and the anomaly record.

Theory of operation. A reader walks frames until one fails its checks (a short
header, a length past the end, a checksum mismatch, reserved bits, an unknown
type). What that failure *is* is decided here and nowhere else:

- if a later frame of the same segment passes its checksum (every frame
  carries its own length and a CRC salted with the segment id, so a stale or
  misaligned frame cannot pass by accident), the failure is a **damaged
  record** and reading resumes at that frame;
- otherwise, in the last segment of the log and past every position known to
  be durable, a failure shaped like an interrupted write is a **torn tail**;
- anything else is a damaged record that runs to the end of the segment.

The functions read through a ``Source`` (a file through ``FileIO``, or a
buffer already in memory) in windows, so the error path too runs in bounded
memory: one window plus at most one frame (``MAX_PAYLOAD``).

docs/format.md, "Reading the log", is the same rules in prose.
"""

from __future__ import annotations

import enum
import re
from typing import Final, Protocol

import attrs

from spool.errors import CorruptRecord, CorruptSegment, FormatVersionError, SpoolError
from spool.fileio import FileIO, read_exact
from spool.format.record import GARBAGE, HEADER, HEADER_SIZE, MAX_PAYLOAD, RecordType, check_frame, format_pos, make_pos
from spool.format.segment import SECTOR

WINDOW: Final = 1 << 20

# A frame header can start where byte 8 is a known type, byte 9 holds no flag but
# GARBAGE, and byte 11 (reserved) is zero: the regular expression finds such
# places in C, so a resynchronisation scans a damaged megabyte at memory speed
# and checks a checksum only where a frame could begin.
_TYPE_BYTES = b"".join(re.escape(bytes([int(t)])) for t in RecordType)
_CANDIDATE = re.compile(b"(?=.{8}[" + _TYPE_BYTES + b"][\\x00" + re.escape(bytes([GARBAGE])) + b"].\\x00)",
                        re.DOTALL)


class Kind(enum.Enum):
    """Every anomaly a reader of the log can meet. The value is how a person reads it."""

    TORN_TAIL = "torn tail"  # the end of the last segment, cut by a crash during a write: not damage
    DAMAGED_RECORD = "damaged record"  # bad checksum, impossible length or type, reserved bits set
    # The checksum passes, so the record was written whole: damage of that record alone, never a torn write.
    BAD_PAYLOAD = "record whose payload does not decode"  # bad CBOR, or fields its type does not allow
    UNKNOWN_TYPE = "record of an unknown type"  # a type this version does not know
    BAD_HEADER = "damaged segment header"  # the 32-byte header fails its checks; the records may be fine
    NEWER_FORMAT = "unknown segment format"  # a valid header of a format version this code does not read
    MISSING_SEGMENT = "missing segment"  # a gap in the ids, or fewer segments than the checkpoint needs
    SIZE_MISMATCH = "sealed size mismatch"  # a sealed segment's size is not what its successor recorded
    ENDS_EARLY = "ends before durable data"  # the segment ends before a position known durable

    @property
    def damage(self) -> bool:
        """Is it damage (something the log promised is gone), rather than a crash's torn tail?"""
        return self is not Kind.TORN_TAIL


@attrs.frozen
class Anomaly:
    """One anomaly: what, where (segment, file, byte range), why, and where valid records resume.

    ``offset`` and ``length`` are the byte range the anomaly covers in the
    segment file (length 0 for a missing segment or a range that is not
    there). ``resume`` is the offset of the next valid frame in the same
    segment, for a damaged record that has one.
    """

    kind: Kind
    segment: int
    path: str
    offset: int
    length: int
    reason: str
    resume: int | None = None

    @property
    def pos(self) -> int:
        return make_pos(self.segment, self.offset)

    @property
    def end(self) -> int:
        """Position where the anomaly's byte range ends."""
        return make_pos(self.segment, self.offset + self.length)

    @property
    def torn(self) -> bool:
        return self.kind is Kind.TORN_TAIL

    @property
    def whole(self) -> bool:
        """Did the damaged record pass its checksum (written whole, so never a torn or unsynced write)?"""
        return self.kind in (Kind.BAD_PAYLOAD, Kind.UNKNOWN_TYPE)

    def message(self) -> str:
        """The reason, with where reading resumes when it does."""
        if self.kind is Kind.DAMAGED_RECORD and self.resume is not None:
            return f"{self.reason}; valid records follow at offset {self.resume}, so this is not a torn tail"
        return self.reason

    def error(self) -> SpoolError:
        """The exception a consumer that stops at this anomaly raises (the engine's, as before the reader)."""
        if self.kind is Kind.NEWER_FORMAT:
            return FormatVersionError(f"{self.path}: {self.reason}")
        return CorruptSegment(self.message(), self.path, self.offset)

    def describe(self) -> str:
        """One line for people: file, offset, kind, reason."""
        if self.torn:
            return (f"{self.path} at offset {self.offset}: torn tail of {self.length} bytes ({self.reason}); "
                    "the next open cuts it (spoolctl recover)")
        follow = f"; valid records resume at offset {self.resume}" if self.resume is not None else ""
        return f"{self.path} at offset {self.offset}: {self.kind.value}: {self.reason}{follow}"

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind.name.lower(), "position": format_pos(self.pos), "file": self.path,
                "segment": self.segment, "offset": self.offset, "bytes": self.length, "reason": self.reason,
                "torn": self.torn, "resumes_at": self.resume}


# -- sources: where the bytes come from -------------------------------------------------


class Source(Protocol):
    """Bytes of one segment up to ``size``: positioned reads, and a window for walking."""

    @property
    def size(self) -> int: ...

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at ``size``)."""
        ...

    def window(self, offset: int, need: int) -> tuple[bytes, int]:
        """A buffer holding at least ``need`` bytes from ``offset`` (unless ``size`` comes first),
        and the offset of its first byte."""
        ...


class BufferSource:
    """A segment (or the part of one) already in memory. Offsets are offsets into ``data``."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data if isinstance(data, bytes) else bytes(data)
        self.size = len(self.data)

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]

    def window(self, offset: int, need: int) -> tuple[bytes, int]:
        return self.data, 0


class FileSource:
    """A segment file read through ``FileIO``, a window at a time. Counts the bytes it reads."""

    def __init__(self, io: FileIO, fd: int, size: int, window: int = WINDOW) -> None:
        self.io = io
        self.fd = fd
        self.size = size
        self.window_size = window
        self.bytes_read = 0

    def read(self, offset: int, n: int) -> bytes:
        data = read_exact(self.io, self.fd, max(0, min(n, self.size - offset)), offset)
        self.bytes_read += len(data)
        return data

    def window(self, offset: int, need: int) -> tuple[bytes, int]:
        return self.read(offset, max(need, self.window_size)), offset


# -- the classification ----------------------------------------------------------------


def whole_record(kind: Kind, seg: int, path: str, off: int, size: int, end: int, reason: str) -> Anomaly:
    """The anomaly of a frame at ``off`` of ``size`` bytes that passes its checksum but cannot be used
    (``kind``: BAD_PAYLOAD or UNKNOWN_TYPE). Reading resumes right after it (``end``: where the data ends)."""
    return Anomaly(kind, seg, path, off, size, reason, off + size if off + size < end else None)


def failure_reason(seg: int, src: Source, off: int, end: int) -> str:
    """Why the frame at ``off`` fails (the codec's own words), or "" if it does not."""
    head = src.read(off, min(HEADER_SIZE, end - off))
    if len(head) < HEADER_SIZE:
        return "truncated header"
    length = HEADER.unpack_from(head)[1]
    if length > MAX_PAYLOAD or off + HEADER_SIZE + length > end:
        return f"length {length} runs past the end of the data"
    try:
        check_frame(seg, src.read(off, HEADER_SIZE + length), 0)
    except CorruptRecord as exc:
        return exc.reason
    return ""


def next_valid(seg: int, src: Source, after: int, end: int, window: int = WINDOW) -> int | None:
    """Offset of the first frame that begins after ``after`` and passes its checks, if any, before ``end``."""
    w = after + 1
    while w + HEADER_SIZE <= end:
        buf = src.read(w, min(window + HEADER_SIZE - 1, end - w))
        limit = min(window, len(buf) - HEADER_SIZE + 1)
        for m in _CANDIDATE.finditer(buf):
            rel = m.start()
            if rel >= limit:
                break
            length = HEADER.unpack_from(buf, rel)[1]
            frame_end = w + rel + HEADER_SIZE + length
            if length > MAX_PAYLOAD or frame_end > end:
                continue
            frame = buf if rel + HEADER_SIZE + length <= len(buf) else src.read(w + rel, HEADER_SIZE + length)
            try:
                check_frame(seg, frame, rel if frame is buf else 0)
            except CorruptRecord:
                continue
            return w + rel
        w += window
    return None


def looks_torn(src: Source, off: int, end: int, window: int = WINDOW) -> bool:
    """Does the failure at ``off`` look like an interrupted write (docs/format.md, "Reading the log")?

    A short header; a length running past ``end``; or zeros from a sector
    boundary (counted from the start of the source) before the failing
    frame's end up to ``end``: a sector that was allocated but never written.
    """
    if end - off < HEADER_SIZE:
        return True
    frame_end = off + HEADER_SIZE + HEADER.unpack_from(src.read(off, HEADER_SIZE))[1]
    if frame_end > end:
        return True
    last = _last_nonzero(src, off, end, window)
    if last is None:
        return True
    first_zero = last + 1
    boundary = -(-first_zero // SECTOR) * SECTOR
    return bool(boundary < frame_end)


def _last_nonzero(src: Source, start: int, end: int, window: int) -> int | None:
    hi = end
    while hi > start:
        lo = max(start, hi - window)
        chunk = src.read(lo, hi - lo)
        stripped = len(chunk.rstrip(b"\0"))
        if stripped:
            return lo + stripped - 1
        hi = lo
    return None


def classify(seg: int, path: str, src: Source, off: int, end: int, *, tail_ok: bool,
             reason: str = "", window: int = WINDOW) -> Anomaly:
    """The anomaly that begins with the failing frame at ``off`` (``end``: where the segment's data ends).

    ``tail_ok``: this is the last segment of the log and ``off`` lies past
    every position known durable, so the failure may be a torn tail.
    """
    reason = failure_reason(seg, src, off, end) or reason or "record fails its checks"
    later = next_valid(seg, src, off, end, window)
    if later is not None:
        return Anomaly(Kind.DAMAGED_RECORD, seg, path, off, later - off, reason, later)
    if not tail_ok:
        return Anomaly(Kind.DAMAGED_RECORD, seg, path, off, end - off, reason)
    # The end of the log: the range stops where the zeroed room begins (format version 3), so that a cut
    # keeps the bytes that were written, not the megabyte of zeros the writer had prepared after them.
    stop = zero_room(src, off, end, window)
    if stop <= off:  # all zeros: a caller that did not take them as the clean end (FrameWalk does)
        stop = end
    if looks_torn(src, off, end, window):
        return Anomaly(Kind.TORN_TAIL, seg, path, off, stop - off, reason)
    return Anomaly(Kind.DAMAGED_RECORD, seg, path, off, stop - off, reason)


def zero_room(src: Source, start: int, end: int, window: int = WINDOW) -> int:
    """Where the run of zeros that ends the source at ``end`` begins, at or after ``start``.

    ``start`` itself when everything from there is zero: the zeroed room a
    writer of format version 3 keeps ahead of its position (docs/format.md,
    "Zeroed room"). Zeros can never be a frame (type 0 is no record type, and
    a frame's checksum is salted), so a zero tail is the log's clean end, not
    damage.
    """
    last = _last_nonzero(src, start, end, window)
    return start if last is None else last + 1


def all_zero(src: Source, start: int, end: int, window: int = WINDOW) -> bool:
    return _last_nonzero(src, start, end, window) is None
