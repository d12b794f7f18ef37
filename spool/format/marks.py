"""Workers' marks: a delivery worker's own record that an attempt's final dot may go.

Why a file of its own: the worker makes its point of no return durable without
a round trip through the relay's loop; recovery reads every marks file and
treats a mark as a DELIVERY whose ``sending`` names the same recipients. A
worker writes a mark only for an attempt whose START is already durable in the
log, so a mark always names a START that recovery can find.

A marks file, ``<spool>/marks/<prefix>-<n>.marks``, is ``header record* zeros``::

    offset size field
    0      4    magic      b"LSMK"
    4      2    version    1, little-endian
    6      2    reserved   written 0, checked 0
    8      8    file_id    little-endian, random, chosen at creation (the salt)
    16     ...  records, then zeros to the end of the file

and a record::

    offset size field
    0      4    crc        CRC-32C, little-endian, over file_id (8 bytes LE), length (4 bytes LE), payload
    4      4    length     payload bytes, little-endian, 1..65536
    8      n    payload    CBOR [start_pos, [recipient, ...]]

The file is created with its zeros already written and synced (the room), so
that the fdatasync of an append commits no change of size. A length of 0 where
a record would begin, with nothing but zeros after it, is the end.

A record that fails (checksum, length, CBOR, shape) is a *torn tail* when every
byte after it to the end of the file is zero: the crash came inside that
record's write, its fdatasync never returned, so its dot never went; reading
stops there and the file is whole. Anything else is *damage*: a record whose
checksum passed is never taken for torn, and a bad record with data after it
(or with a record that passes its checksum beginning inside the extent its
length claims, which a damaged length may have stretched over the records
after it) was not the last write. The salt keeps a record copied from another file (or
left by an earlier life of a reused one) from passing. docs/format.md,
"Workers' marks (version 6)", is the same description with a worked example.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Sequence
from typing import Final

import attrs
import cbor2
from crc32c import crc32c

MARKS_DIR: Final = "marks"
MAGIC: Final = b"LSMK"
VERSION: Final = 1
HEADER = struct.Struct("<4sHHQ")
HEADER_SIZE: Final = HEADER.size  # 16
RECORD_HEAD = struct.Struct("<II")
RECORD_HEAD_SIZE: Final = RECORD_HEAD.size  # 8
MAX_MARK_PAYLOAD: Final = 64 * 1024
SUFFIX: Final = ".marks"
TMP_SUFFIX: Final = ".tmp"
_MAX_POS: Final = 1 << 64
_SALTED = struct.Struct("<QI")


def marks_dir(spool_path: str) -> str:
    return os.path.join(spool_path, MARKS_DIR)


def _recipients(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class Mark:
    """The final dot of the attempt begun at ``start_pos`` may go, for these recipients."""

    start_pos: int = attrs.field(validator=attrs.validators.instance_of(int))
    recipients: tuple[str, ...] = attrs.field(
        converter=_recipients,
        validator=attrs.validators.deep_iterable(attrs.validators.instance_of(str)),
    )


@attrs.frozen
class MarksRead:
    """What one marks file holds: the marks read up to its end, or up to the damage that stopped the read."""

    path: str
    marks: tuple[Mark, ...]
    damage: str | None  # None: the file is whole (a torn tail is no damage)


def encode_header(file_id: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, file_id)


def mark_checksum(file_id: int, length: int, payload: bytes | memoryview) -> int:
    return crc32c(payload, crc32c(_SALTED.pack(file_id, length)))


def encode_mark(file_id: int, start_pos: int, recipients: Sequence[str]) -> bytes:
    """One record, ready to be written at the file's write offset (``mark_payload`` framed for the file)."""
    return frame_mark(file_id, mark_payload(start_pos, recipients))


def frame_mark(file_id: int, payload: bytes) -> bytes:
    """A payload from ``mark_payload`` with its head: only the checksum depends on the file."""
    n = len(payload)
    return RECORD_HEAD.pack(mark_checksum(file_id, n, payload), n) + payload


def mark_payload(start_pos: int, recipients: Sequence[str]) -> bytes:
    """A mark's CBOR payload.

    Raises ValueError for a position outside 0..2**64-1, no recipients, a recipient that is
    not text, or a payload over 64 KiB (a mark the reader would refuse is refused here).
    """
    if type(start_pos) is not int or not 0 <= start_pos < _MAX_POS:
        raise ValueError(f"not a position: {start_pos!r}")
    rcpts = list(recipients)
    if not rcpts or not all(isinstance(r, str) for r in rcpts):
        raise ValueError(f"a mark names one recipient or more, as text: {recipients!r}")
    payload = cbor2.dumps([start_pos, rcpts])
    n = len(payload)
    if n > MAX_MARK_PAYLOAD:
        raise ValueError(f"mark payload of {n} bytes exceeds {MAX_MARK_PAYLOAD}")
    return payload


def _zeros_from(data: bytes, offset: int) -> bool:
    """Every byte from ``offset`` to the end is zero (bytes.count runs in C: the room is megabytes)."""
    return offset >= len(data) or data.count(0, offset) == len(data) - offset


def _whole_record_within(data: bytes, file_id: int, begin: int, end: int) -> bool:
    """A record whose checksum passes begins in ``begin..end-1``.

    Why: a failing record's extent comes from its own length field, which damage may have
    enlarged over the records after it; one of them passing its checksum shows the failure
    was not the last write. Runs only when a record fails.
    """
    for at in range(begin, min(end, len(data) - RECORD_HEAD_SIZE + 1)):
        crc, length = RECORD_HEAD.unpack_from(data, at)
        start = at + RECORD_HEAD_SIZE
        if 0 < length <= MAX_MARK_PAYLOAD and start + length <= len(data) and \
                mark_checksum(file_id, length, data[start : start + length]) == crc:
            return True
    return False


def _decode_payload(payload: bytes) -> Mark:
    """Raises ValueError with the reason when the payload is not ``[start_pos, [recipient, ...]]``."""
    stream = io.BytesIO(payload)
    try:
        value = cbor2.CBORDecoder(stream).decode()
    except (cbor2.CBORDecodeError, ValueError, TypeError, EOFError) as exc:
        raise ValueError(f"bad CBOR: {exc}") from None
    if stream.tell() != len(payload):
        raise ValueError(f"{len(payload) - stream.tell()} bytes after the CBOR value")
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("payload is not [start_pos, recipients]")
    start_pos, rcpts = value
    if type(start_pos) is not int or not 0 <= start_pos < _MAX_POS:
        raise ValueError(f"start_pos is not a position: {start_pos!r}")
    if not isinstance(rcpts, list) or not rcpts or not all(type(r) is str for r in rcpts):
        raise ValueError("recipients are not a non-empty array of text")
    return Mark(start_pos, tuple(rcpts))


def parse_marks(path: str, data: bytes) -> MarksRead:
    """The marks of one file's bytes; never raises for what the bytes hold (damage is in the result)."""
    if len(data) < HEADER_SIZE:
        return MarksRead(path, (), f"short header ({len(data)} bytes)")
    magic, version, reserved, file_id = HEADER.unpack_from(data)
    if magic != MAGIC:
        return MarksRead(path, (), "bad magic (not a marks file)")
    if version != VERSION:
        return MarksRead(path, (), f"unknown marks format version {version}")
    if reserved:
        return MarksRead(path, (), "reserved header bytes set")
    marks: list[Mark] = []
    offset = HEADER_SIZE
    size = len(data)
    while offset < size:
        if size - offset < RECORD_HEAD_SIZE:
            if _zeros_from(data, offset):
                break
            return MarksRead(path, tuple(marks), None)  # a head cut by the end of the file: torn
        crc, length = RECORD_HEAD.unpack_from(data, offset)
        start = offset + RECORD_HEAD_SIZE
        end = start + length
        if length == 0 and crc == 0 and _zeros_from(data, start):
            break  # the zeroed room
        why: str | None = None
        if length == 0 or length > MAX_MARK_PAYLOAD:
            why, end = f"bad length {length}", start
        elif end > size:
            why, end = f"length {length} runs past the end of the file", size
        elif mark_checksum(file_id, length, data[start:end]) != crc:
            why = "checksum mismatch"
        if why is not None:
            if _zeros_from(data, end) and not _whole_record_within(data, file_id, offset + 1, end):
                return MarksRead(path, tuple(marks), None)  # torn: the write that never returned
            return MarksRead(path, tuple(marks), f"record at offset {offset}: {why}")
        try:
            marks.append(_decode_payload(data[start:end]))
        except ValueError as exc:  # the checksum passed: written whole, so never a torn tail
            return MarksRead(path, tuple(marks), f"record at offset {offset}: {exc}")
        offset = end
    return MarksRead(path, tuple(marks), None)
