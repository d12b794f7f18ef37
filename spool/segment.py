"""Segment files: the header, naming, reading frames, and finding a torn tail.

A segment is ``header record*``. The 32-byte header::

    offset size field
    0      8    magic      b"LSPOOLSG"
    8      2    version    format version, little-endian (FORMAT_VERSION)
    10     2    hdr_size   32
    12     4    prev_size  final size of segment segment_id-1 (0 if none preceded it)
    16     8    segment_id little-endian; also the file name, in hex
    24     4    created    seconds since the Unix epoch
    28     4    crc        CRC-32C of bytes 0..27

Torn tail rules (docs/format.md "Recovery"): only the last segment of the log
may end in a torn write, because a segment is fsynced whole before the next is
created. At the first frame that fails, the tail is *torn* (cut off) when no
valid frame follows it and the failure looks like an interrupted write: a short
header, a length running past the end of the file, or bytes that are zero from
a 512-byte boundary onward. Anything else is corruption and stops the open
with the file and offset.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Final

from crc32c import crc32c

from spool.errors import CorruptRecord, CorruptSegment, FormatVersionError
from spool.fileio import FileIO, read_exact
from spool.record import (
    GARBAGE,
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD,
    Frame,
    check_frame,
    checksum,
    decode_frame,
    make_pos,
)

MAGIC: Final = b"LSPOOLSG"
FORMAT_VERSION: Final = 2
SEGMENT_HEADER = struct.Struct("<8sHHIQII")
SEGMENT_HEADER_SIZE: Final = SEGMENT_HEADER.size  # 32
SECTOR: Final = 512
READ_CHUNK: Final = 1 << 20
SUFFIX: Final = ".seg"
_VALID_TYPES = frozenset(range(1, 6))
_unpack_header = HEADER.unpack_from


def segment_name(segment_id: int) -> str:
    return f"{segment_id:016x}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    if not name.endswith(SUFFIX) or len(name) != 16 + len(SUFFIX):
        return None
    try:
        seg = int(name[:16], 16)
    except ValueError:
        return None
    # int() also takes "0x", "+", "_", spaces and upper case: accept only the name we write.
    return seg if segment_name(seg) == name else None


def list_segments(io: FileIO, log_dir: str) -> list[int]:
    ids = [s for s in (parse_segment_name(n) for n in io.listdir(log_dir)) if s is not None]
    return sorted(ids)


def encode_segment_header(segment_id: int, created: int, prev_size: int = 0) -> bytes:
    body = SEGMENT_HEADER.pack(MAGIC, FORMAT_VERSION, SEGMENT_HEADER_SIZE, prev_size, segment_id, created, 0)[:28]
    return body + struct.pack("<I", crc32c(body))


def segment_header_fields(buf: bytes, path: str, expect_id: int | None = None) -> tuple[int, int, int]:
    """Return (segment_id, created, prev_size). Raises CorruptSegment or FormatVersionError.

    ``prev_size`` is how long the previous segment was when this one began:
    without it, a sealed segment cut at a record boundary would look whole.
    """
    if len(buf) < SEGMENT_HEADER_SIZE:
        raise CorruptSegment("segment header is truncated", path, 0)
    magic, version, hdr_size, prev_size, seg_id, created, crc = SEGMENT_HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptSegment("not a logspool segment (bad magic)", path, 0)
    if crc32c(buf[:28]) != crc:
        raise CorruptSegment("segment header checksum mismatch", path, 0)
    if version != FORMAT_VERSION:
        raise FormatVersionError(f"{path}: segment format version {version}, this logspool reads {FORMAT_VERSION}")
    if hdr_size != SEGMENT_HEADER_SIZE:
        raise CorruptSegment("segment header has an unknown size", path, 0)
    if expect_id is not None and seg_id != expect_id:
        raise CorruptSegment(f"segment id {seg_id} does not match its file name ({expect_id})", path, 16)
    return seg_id, created, prev_size


def decode_segment_header(buf: bytes, path: str, expect_id: int | None = None) -> tuple[int, int]:
    """Return (segment_id, created). Raises CorruptSegment or FormatVersionError."""
    seg_id, created, _prev = segment_header_fields(buf, path, expect_id)
    return seg_id, created


def check_sealed_size(io: FileIO, log_dir: str, seg: int, size: int) -> None:
    """Compare a sealed segment's size with what its successor's header recorded.

    Raises CorruptSegment when they differ (a truncated or extended file). A
    successor that is missing or holds no header yet proves nothing either way.
    """
    nxt = segment_path(log_dir, seg + 1)
    try:
        fd = io.open_read(nxt)
    except FileNotFoundError:
        return
    try:
        head = read_exact(io, fd, SEGMENT_HEADER_SIZE, 0)
    finally:
        io.close(fd)
    if len(head) < SEGMENT_HEADER_SIZE or head.count(0) == len(head):
        return
    _id, _created, prev = segment_header_fields(head, nxt, seg + 1)
    if prev and prev != size:
        raise CorruptSegment(f"the segment is {size} bytes but segment {seg + 1} records it sealed at {prev} "
                             f"bytes: it was truncated or overwritten", segment_path(log_dir, seg), min(size, prev))


def _plausible_frame_at(seg_id: int, data: bytes | memoryview, off: int) -> bool:
    if len(data) - off < HEADER_SIZE:
        return False
    crc, length, rtype, flags, _k, reserved, _t = HEADER.unpack_from(data, off)
    if rtype not in _VALID_TYPES or reserved or flags & ~GARBAGE or length > MAX_PAYLOAD:
        return False
    end = off + HEADER_SIZE + length
    if end > len(data):
        return False
    view = memoryview(data)
    return bool(checksum(seg_id, view[off : off + HEADER_SIZE], view[off + HEADER_SIZE : end]) == crc)


def valid_frame_after(seg_id: int, data: bytes | memoryview, start: int) -> int | None:
    """Offset of the first frame after ``start`` whose checksum passes, if any.

    Only used on the error path: it tells a torn tail (nothing valid follows)
    from a damaged record in the middle of the log.
    """
    for off in range(start + 1, len(data) - HEADER_SIZE + 1):
        if _plausible_frame_at(seg_id, data, off):
            return off
    return None


def _looks_torn(data: bytes | memoryview, off: int) -> bool:
    """Does the failure at ``off`` look like an interrupted write?"""
    remaining = len(data) - off
    if remaining < HEADER_SIZE:
        return True
    length = HEADER.unpack_from(data, off)[1]
    frame_end = off + HEADER_SIZE + length
    if frame_end > len(data):
        return True
    tail = bytes(data[off:])
    stripped = tail.rstrip(b"\0")
    if not stripped:
        return True
    first_zero = off + len(stripped)
    boundary = -(-first_zero // SECTOR) * SECTOR
    return bool(boundary < frame_end)


def find_end(seg_id: int, data: bytes | memoryview, start: int, path: str, *, last: bool) -> int:
    """Validate frames from ``start``; return the offset where valid data ends.

    Raises CorruptSegment for damage that is not a torn tail of the last segment.
    """
    off = start
    n = len(data)
    while off < n:
        try:
            off = check_frame(seg_id, data, off)[4]
        except CorruptRecord as exc:
            reason = exc.reason
            later = valid_frame_after(seg_id, data, off)
            if later is not None:
                raise CorruptSegment(
                    f"{reason}; valid records follow at offset {later}, so this is not a torn tail",
                    path,
                    off,
                ) from None
            if last and _looks_torn(data, off):
                return off
            raise CorruptSegment(reason, path, off) from None
    return off


class FrameReader:
    """Sequential reader of one segment file through a 1 MiB window.

    Why a window: runners and recovery walk segments of 64 MiB; holding whole
    segments would make memory grow with the queue.
    """

    def __init__(self, io: FileIO, path: str, seg_id: int, start: int, end: int) -> None:
        self.io = io
        self.path = path
        self.seg_id = seg_id
        self.pos = start
        self.end = end
        self.fd = io.open_read(path)
        self.buf = b""
        self.buf_start = start
        self.bytes_read = 0

    def close(self) -> None:
        if self.fd >= 0:
            self.io.close(self.fd)
            self.fd = -1

    def _fill(self, need: int) -> None:
        """Make buf hold at least ``need`` bytes from self.pos (or up to end)."""
        rel = self.pos - self.buf_start
        if rel + need <= len(self.buf):
            return
        want = max(need, READ_CHUNK)
        want = min(want, self.end - self.pos)
        data = read_exact(self.io, self.fd, want, self.pos)
        self.bytes_read += len(data)
        self.buf = data
        self.buf_start = self.pos

    def frames(self, *, verify: bool = True) -> Iterator[Frame]:
        """Yield frames up to ``end``. ``verify`` checks checksums (CorruptSegment).

        Each frame is checked and cut straight out of the window: one header
        unpack, one checksum and one payload copy per record.
        """
        seg, end = self.seg_id, self.end
        while self.pos < end:
            pos = self.pos
            buf = self.buf
            rel = pos - self.buf_start
            if len(buf) - rel < HEADER_SIZE:
                self._fill(HEADER_SIZE)
                buf, rel = self.buf, 0
                if len(buf) < HEADER_SIZE:
                    raise CorruptSegment("truncated header before the end of the log", self.path, pos)
            _crc, length, rtype, flags, klass, _res, time = _unpack_header(buf, rel)
            size = HEADER_SIZE + length
            if length > MAX_PAYLOAD or pos + size > end:
                raise CorruptSegment(f"length {length} runs past the end of the log", self.path, pos)
            if rel + size > len(buf):
                self._fill(size)
                buf, rel = self.buf, 0
            if verify:
                try:
                    check_frame(seg, buf, rel)
                except CorruptRecord as exc:
                    raise CorruptSegment(exc.reason, self.path, pos) from None
            self.pos = pos + size
            yield Frame(make_pos(seg, pos), rtype, flags, klass, time, buf[rel + HEADER_SIZE : rel + size])


def read_frame_at(io: FileIO, fd: int, path: str, seg_id: int, offset: int) -> Frame:
    """Read and verify the one record at ``offset`` (header first, then its payload).

    Raises CorruptRecord naming ``path`` and ``offset``.
    """
    head = read_exact(io, fd, HEADER_SIZE, offset)
    length = HEADER.unpack_from(head)[1] if len(head) == HEADER_SIZE else 0
    data = head + read_exact(io, fd, length, offset + HEADER_SIZE)
    try:
        return decode_frame(seg_id, data, 0, at=offset)
    except CorruptRecord as exc:
        raise CorruptRecord(exc.reason, path, offset) from None


def read_segment_header(io: FileIO, path: str, expect_id: int | None = None) -> tuple[int, int]:
    fd = io.open_read(path)
    try:
        return decode_segment_header(read_exact(io, fd, SEGMENT_HEADER_SIZE, 0), path, expect_id)
    finally:
        io.close(fd)


def read_whole(io: FileIO, path: str) -> bytes:
    fd = io.open_read(path)
    try:
        return read_exact(io, fd, io.size(fd), 0)
    finally:
        io.close(fd)


def segment_path(log_dir: str, segment_id: int) -> str:
    return os.path.join(log_dir, segment_name(segment_id))
