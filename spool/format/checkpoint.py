"""The checkpoint: restart positions, written atomically after what they cover is durable.

File ``DIR/checkpoint``::

    offset size field
    0      8    magic    b"LSPOOLCP"
    8      2    version  CHECKPOINT_VERSION (2), little-endian
    10     2    reserved zero
    12     4    length   of the CBOR payload, little-endian
    16     4    crc      CRC-32C of the payload
    20     n    payload  CBOR map, integer keys (below)

Payload keys: 0 head (position: everything before it was durable when the
checkpoint was taken), 1 working-suffix start (recovery scans from here),
2 garbage-prefix end (every segment wholly before it may be deleted),
3 runner positions (array, index = runner class), 4 time (ms), 5 sequence,
6 body span (optional, default 0): the most segments a live message's body
has reached back behind its envelope; deletion keeps that many more segments.

Written as temp file, fsync, rename, fsync of the directory: a crash leaves
either the old checkpoint or the new one, never a mix. A stale checkpoint only
costs more scanning; that is why positions may lag but never lead.

Failures. A temporary file that cannot be written or synced (no room above
all) is removed and the previous checkpoint stands: ``store`` raises DiskFull
or CheckpointFailed, and the caller tries again later. Retrying is safe here,
unlike a failed fsync of the log, because the failed file is thrown away and
the next attempt writes a new one; nothing that was promised depends on it.
A failed fsync of the directory after the rename is fatal (SyncFailed): then
nobody knows which checkpoint a crash would leave, and segments may only be
deleted behind a durable one. A temporary file left by a crash is removed at
the next start (``remove_temp``).
"""

from __future__ import annotations

import os
import struct
from typing import Any

import attrs
import cbor2
from crc32c import crc32c

from spool.errors import CheckpointFailed, CorruptRecord, DiskFull, FormatVersionError, SyncFailed, no_space
from spool.fileio import FileIO, read_exact, write_all

MAGIC = b"LSPOOLCP"
# The checkpoint's own format version. It was the segments' version until segments went to 3 (zeroed room,
# which changed nothing in the checkpoint): it stays 2, so a spool's checkpoint reads across that change.
CHECKPOINT_VERSION = 2
_HEAD = struct.Struct("<8sHHII")
NAME = "checkpoint"
TEMP = NAME + ".tmp"


class CorruptCheckpoint(CorruptRecord):
    """The checkpoint file is damaged. Removing it makes the next start scan the whole log."""


@attrs.frozen
class Checkpoint:
    head: int
    working_start: int
    garbage_end: int
    runners: tuple[int, ...]
    time_ms: int
    sequence: int
    body_span: int = 0

    def same_restart(self, other: Checkpoint) -> bool:
        """Would recovery and segment reclaiming do the same from ``other``? (time and sequence aside)"""
        return (self.head, self.working_start, self.garbage_end, self.runners, self.body_span) == (
            other.head, other.working_start, other.garbage_end, other.runners, other.body_span)

    def to_bytes(self) -> bytes:
        payload = cbor2.dumps({0: self.head, 1: self.working_start, 2: self.garbage_end,
                               3: list(self.runners), 4: self.time_ms, 5: self.sequence, 6: self.body_span})
        return _HEAD.pack(MAGIC, CHECKPOINT_VERSION, 0, len(payload), crc32c(payload)) + payload

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> Checkpoint:
        if len(data) < _HEAD.size:
            raise CorruptCheckpoint("checkpoint is truncated", path, 0)
        magic, version, reserved, length, crc = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise CorruptCheckpoint("not a logspool checkpoint (bad magic)", path, 0)
        if version != CHECKPOINT_VERSION:
            raise FormatVersionError(f"{path}: checkpoint format version {version}, this logspool reads "
                                     f"{CHECKPOINT_VERSION}")
        payload = data[_HEAD.size:]
        if reserved or len(payload) != length:
            raise CorruptCheckpoint(f"checkpoint length {length} does not match the file", path, 12)
        if crc32c(payload) != crc:
            raise CorruptCheckpoint("checkpoint checksum mismatch", path, 16)
        try:
            d: Any = cbor2.loads(payload)
            return cls(int(d[0]), int(d[1]), int(d[2]), tuple(int(x) for x in d[3]), int(d[4]), int(d[5]),
                       int(d.get(6, 0)))
        except (cbor2.CBORDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptCheckpoint(f"checkpoint payload is malformed: {exc}", path, _HEAD.size) from None


def load(io: FileIO, spool_dir: str) -> Checkpoint | None:
    path = os.path.join(spool_dir, NAME)
    if not io.exists(path):
        return None
    fd = io.open_read(path)
    try:
        data = read_exact(io, fd, io.size(fd), 0)
    finally:
        io.close(fd)
    return Checkpoint.from_bytes(data, path)


def store(io: FileIO, spool_dir: str, cp: Checkpoint) -> None:
    """Atomically replace the checkpoint; durable when this returns.

    Raises DiskFull (no room) or CheckpointFailed (another error) with the
    previous checkpoint in place and no temporary file left; SyncFailed when
    the directory's fsync failed after the rename.
    """
    path = os.path.join(spool_dir, NAME)
    tmp = os.path.join(spool_dir, TEMP)
    try:
        fd = io.open(tmp, create=True, truncate=True)
        try:
            write_all(io, fd, cp.to_bytes(), 0)
            io.fsync(fd)
        finally:
            io.close(fd)
        io.rename(tmp, path)
    except OSError as exc:
        _discard(io, tmp)
        if no_space(exc):
            raise DiskFull(exc.errno, f"no room for the checkpoint in {spool_dir}: {exc.strerror}") from None
        raise CheckpointFailed(exc.errno, f"writing the checkpoint in {spool_dir} failed: {exc}") from exc
    try:
        io.fsync_dir(spool_dir)
    except OSError as exc:
        raise SyncFailed(f"fsync of {spool_dir} after storing the checkpoint failed: {exc}; the process must "
                         "restart and recover") from exc


def _discard(io: FileIO, tmp: str) -> None:
    """Remove a temporary checkpoint that failed (best effort: the next start removes it too)."""
    try:
        if io.exists(tmp):
            io.unlink(tmp)
    except OSError:
        pass


def remove_temp(io: FileIO, spool_dir: str) -> bool:
    """Remove a temporary checkpoint left by a crash or a failed store; True if there was one.

    It is never read: the rename that would have made it the checkpoint did
    not happen. Removing it gives back its space before recovery writes.
    """
    tmp = os.path.join(spool_dir, TEMP)
    if not io.exists(tmp):
        return False
    io.unlink(tmp)
    return True
