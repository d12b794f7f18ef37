"""The durable horizon: how far the log is known to be on disk, published for readers in other processes.

File ``DIR/durable``, 16 bytes::

    offset size field
    0      4    magic    b"LSDH"
    4      8    position everything before it is on disk (little-endian)
    12     4    crc      CRC-32C of bytes 0..11

Why a file of its own: a reader outside the relay (``mta events``, a
shipper) must show only records that no crash can take back. The
checkpoint's head says that too, but checkpoints are rare by design
(``spool.aio.checkpointer``). The writer rewrites this file in place (one
``pwrite``, no fsync) after every fdatasync of the log, so its position never
passes a byte that is not on disk; a crash leaves an older position or the
last one, both true. Nothing in the engine reads it: losing it (or a torn
write of it, caught by the checksum) costs a reader only a wait for the next
commit.
"""

from __future__ import annotations

import os
import struct

from crc32c import crc32c

from spool.fileio import FileIO, read_exact

NAME = "durable"
MAGIC = b"LSDH"
SIZE = 16
_FIELDS = struct.Struct("<4sQ")
_CRC = struct.Struct("<I")


def horizon_path(spool_dir: str) -> str:
    return os.path.join(spool_dir, NAME)


def encode_horizon(position: int) -> bytes:
    head = _FIELDS.pack(MAGIC, position)
    return head + _CRC.pack(crc32c(head))


def decode_horizon(data: bytes) -> int | None:
    """The position in ``data``; None for anything that is not a whole, valid horizon (a torn write)."""
    if len(data) < SIZE:
        return None
    magic, position = _FIELDS.unpack_from(data)
    if magic != MAGIC or _CRC.unpack_from(data, 12)[0] != crc32c(data[:12]):
        return None
    return int(position)


def read_horizon(io: FileIO, spool_dir: str) -> int | None:
    """The published durable position of the spool in ``spool_dir``; None when none is (yet) readable."""
    try:
        fd = io.open_read(horizon_path(spool_dir))
    except FileNotFoundError:
        return None
    try:
        return decode_horizon(read_exact(io, fd, SIZE, 0))
    finally:
        io.close(fd)
