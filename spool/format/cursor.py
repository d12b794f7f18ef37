"""Consumers' cursors: how far each named reader of the event stream has taken it, kept so it survives a crash.

File ``DIR/cursors/NAME``, 16 bytes::

    offset size field
    0      4    magic    b"LSCU"
    4      8    position the last record the consumer has taken (little-endian)
    12     4    crc      CRC-32C of bytes 0..11

Written whole: temporary file, fsync, rename, fsync of the directory, so a
crash leaves the old cursor or the new one. A consumer that resumes from a
cursor sees again at most what it took after the last store, never less:
at-least-once. The engine reads the cursors at each checkpoint: a segment a
cursor has not read past is kept from reclaim, up to ``cursor_pin_max``
bytes of segments (``spool.engine.reclaim``).
"""

from __future__ import annotations

import os
import re
import struct

from crc32c import crc32c

from spool.errors import SpoolError
from spool.fileio import FileIO, read_exact, write_all

DIR_NAME = "cursors"
MAGIC = b"LSCU"
SIZE = 16
_FIELDS = struct.Struct("<4sQ")
_CRC = struct.Struct("<I")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


class CursorError(SpoolError, ValueError):
    """A cursor name that cannot be a file of its own, or a cursor file that is damaged."""


def check_cursor_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name.endswith(".tmp"):
        raise CursorError(f"{name!r} is no consumer name (letters, digits, _ . -; at most 64; not ending .tmp)")
    return name


def cursor_dir(spool_dir: str) -> str:
    return os.path.join(spool_dir, DIR_NAME)


def encode_cursor(position: int) -> bytes:
    head = _FIELDS.pack(MAGIC, position)
    return head + _CRC.pack(crc32c(head))


def decode_cursor(data: bytes, path: str = "") -> int:
    if len(data) != SIZE:
        raise CursorError(f"{path}: a cursor is {SIZE} bytes, this one {len(data)}")
    magic, position = _FIELDS.unpack_from(data)
    if magic != MAGIC or _CRC.unpack_from(data, 12)[0] != crc32c(data[:12]):
        raise CursorError(f"{path}: not a cursor, or damaged (remove it: the consumer starts over)")
    return int(position)


def store_cursor(io: FileIO, spool_dir: str, name: str, position: int) -> None:
    """Make ``position`` the cursor of ``name``, durably, before returning."""
    directory = cursor_dir(spool_dir)
    io.makedirs(directory)
    path = os.path.join(directory, check_cursor_name(name))
    temp = path + ".tmp"
    fd = io.open(temp, create=True, truncate=True)
    try:
        write_all(io, fd, encode_cursor(position), 0)
        io.fsync(fd)
    finally:
        io.close(fd)
    io.rename(temp, path)
    io.fsync_dir(directory)


def load_cursor(io: FileIO, spool_dir: str, name: str) -> int | None:
    """The cursor of ``name``; None if it has none. Raises CursorError for a damaged file."""
    path = os.path.join(cursor_dir(spool_dir), check_cursor_name(name))
    try:
        fd = io.open_read(path)
    except FileNotFoundError:
        return None
    try:
        return decode_cursor(read_exact(io, fd, SIZE + 1, 0), path)
    finally:
        io.close(fd)


def list_cursors(io: FileIO, spool_dir: str) -> dict[str, int | None]:
    """Every consumer's cursor (None: its file is damaged)."""
    directory = cursor_dir(spool_dir)
    if not io.exists(directory):
        return {}
    found: dict[str, int | None] = {}
    for name in sorted(io.listdir(directory)):
        if not _NAME.fullmatch(name) or name.endswith(".tmp"):
            continue
        try:
            found[name] = load_cursor(io, spool_dir, name)
        except (CursorError, OSError):
            found[name] = None
    return found


def remove_cursor(io: FileIO, spool_dir: str, name: str) -> bool:
    path = os.path.join(cursor_dir(spool_dir), check_cursor_name(name))
    try:
        io.unlink(path)
    except FileNotFoundError:
        return False
    io.fsync_dir(cursor_dir(spool_dir))
    return True
