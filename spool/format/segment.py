"""Segment files: the header, naming, listing, and reading one record at a position.

A segment is ``header record*``. The 32-byte header::

    offset size field
    0      8    magic      b"LSPOOLSG"
    8      2    version    format version, little-endian (FORMAT_VERSION)
    10     2    hdr_size   32
    12     4    prev_size  final size of segment segment_id-1 (0 if none preceded it)
    16     8    segment_id little-endian; also the file name, in hex
    24     4    created    seconds since the Unix epoch
    28     4    crc        CRC-32C of bytes 0..27

Walking a segment, and deciding where the log ends and what is damaged, is
``spool.read.reader``'s job (with ``spool.read.anomaly``); this module keeps the format,
and reads one record at a known position (``read_frame_at``).
"""

from __future__ import annotations

import os
import struct
from typing import Final

from crc32c import crc32c

from spool.errors import CorruptRecord, CorruptSegment, FormatVersionError
from spool.fileio import FileIO, read_exact
from spool.format.record import HEADER, HEADER_SIZE, Frame, decode_frame

MAGIC: Final = b"LSPOOLSG"
# What the writer writes: 6 is 5 plus the workers' marks files (spool.format.marks), refused by a version-5
# reader, which would ignore the marks and send in-doubt mail again.
FORMAT_VERSION: Final = 6
# 2 (no zeroed room), 3 (no `sending`), 4 (no `source`), 5 (no marks) still read.
READABLE_VERSIONS: Final = frozenset({2, 3, 4, 5, 6})
SEGMENT_HEADER = struct.Struct("<8sHHIQII")
SEGMENT_HEADER_SIZE: Final = SEGMENT_HEADER.size  # 32
SECTOR: Final = 512  # torn-write rules count sector boundaries from the start of the file
SUFFIX: Final = ".seg"


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
    if version not in READABLE_VERSIONS:
        raise FormatVersionError(f"{path}: segment format version {version}, this logspool reads "
                                 f"{' and '.join(str(v) for v in sorted(READABLE_VERSIONS))}")
    if hdr_size != SEGMENT_HEADER_SIZE:
        raise CorruptSegment("segment header has an unknown size", path, 0)
    if expect_id is not None and seg_id != expect_id:
        raise CorruptSegment(f"segment id {seg_id} does not match its file name ({expect_id})", path, 16)
    return seg_id, created, prev_size


def header_version(buf: bytes) -> int | None:
    """The format version a segment header names, if it is a verified header (None: not one)."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        return None
    magic, version, _hdr, _prev, _seg, _created, crc = SEGMENT_HEADER.unpack_from(buf)
    if magic != MAGIC or crc32c(buf[:28]) != crc:
        return None
    return int(version)


def decode_segment_header(buf: bytes, path: str, expect_id: int | None = None) -> tuple[int, int]:
    """Return (segment_id, created). Raises CorruptSegment or FormatVersionError."""
    seg_id, created, _prev = segment_header_fields(buf, path, expect_id)
    return seg_id, created


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


def segment_size(io: FileIO, log_dir: str, segment_id: int) -> int:
    """The bytes a segment file holds now; 0 if it is gone (reclaimed while a reader counted)."""
    try:
        fd = io.open_read(segment_path(log_dir, segment_id))
    except FileNotFoundError:
        return 0
    try:
        return io.size(fd)
    finally:
        io.close(fd)
