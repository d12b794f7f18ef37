"""The counter table: a fixed-size file mapped into every relay process, changed under one file lock.

Theory of operation
-------------------
``[server] processes = N`` runs N relay processes that share nothing at run
time; a rate limit must still count a client's mail over all of them. The
counters live in one file (``[limits] table``) that every process maps with
``mmap``; a change is made under ``flock(LOCK_EX)`` on that file, so it is
atomic across processes, and costs two system calls and a few struct
unpacks (measured: docs/benchmarks.md, "Rate limits"). No new daemon, no
socket, and a process that dies holding the lock releases it with its file.

Windows: each counter is a sliding window approximated from two fixed ones
(the current window's count plus the previous window's, weighted by how much
of it the sliding window still covers), as nginx's and Cloudflare's limiters
do: no burst of twice the limit at a window's edge, two numbers a counter.
Windows are aligned on the epoch, so every process agrees on them.

Layout (native byte order: the file never leaves the host): a 64-byte
header (``MAGIC``, the slot count), then slots of 32 bytes: a 12-byte key
digest (BLAKE2b of the counter's name), the current window's start (u64,
seconds since the epoch), the window's length (u32 seconds), the current
and the previous window's counts (u32 each). Slots are grouped in buckets
of ``BUCKET`` by the digest; a counter lives in its bucket or nowhere.

Memory is bounded by the file: when a counter needs a slot and its bucket is
full, the slot whose windows ended longest ago is taken (one whose windows
have both passed holds nothing any more). Only under more distinct live
counters than a bucket holds is a live one evicted: that client, user or
sender then starts again from zero (it may get up to its limit again). A
log line is never written for it; the table's size is the operator's knob.

Not durable, on purpose: the file is never fsynced. After a crash of the
host the counters may be lost (everyone starts from zero); a relay process
that crashes loses nothing (the page cache holds the map). A file of the
wrong size or magic is reset when it is opened (a changed ``table_size``).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import struct
from collections.abc import Sequence

import attrs

__all__ = ["BUCKET", "HEADER", "MAGIC", "SLOT", "Counter", "RateTable", "file_size"]

MAGIC = b"LSRATES1"
HEADER = 64
_HEADER = struct.Struct("=8sI")
_SLOT = struct.Struct("=12sQIII")
SLOT = _SLOT.size
BUCKET = 8  # slots a counter may live in: one cache line pair read per lookup


def file_size(slots: int) -> int:
    return HEADER + slots * SLOT


@attrs.frozen
class Counter:
    """One thing counted: its name (``client:192.0.2.1:messages``), its limit per window of ``window`` seconds."""

    name: str
    limit: int
    window: int
    digest: bytes = attrs.field(init=False)

    @digest.default
    def _digest(self) -> bytes:
        return hashlib.blake2b(f"{self.name}/{self.window}".encode("utf-8", "surrogateescape"), digest_size=12).digest()


class RateTable:
    """The shared counters of one relay; ``take`` is the only operation.

    Resource handling: the file and its map stay open for the life of the
    process; ``close`` is for tests and tools.
    """

    def __init__(self, path: str, slots: int) -> None:
        """Open (or make, or reset) the table at ``path``.

        Raises OSError: the file cannot be made or mapped.
        """
        if slots < BUCKET or slots % BUCKET:
            raise ValueError(f"slots must be a multiple of {BUCKET}, got {slots}")
        self.path = path
        self.slots = slots
        self.buckets = slots // BUCKET
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._shape()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(self._fd, file_size(slots))
        except BaseException:
            os.close(self._fd)
            raise

    def _shape(self) -> None:
        """Under the lock: a file of another size or magic is emptied and made this table's."""
        size = file_size(self.slots)
        head = os.pread(self._fd, _HEADER.size, 0)
        if os.fstat(self._fd).st_size == size and head == _HEADER.pack(MAGIC, self.slots):
            return
        os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, size)
        os.pwrite(self._fd, _HEADER.pack(MAGIC, self.slots), 0)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def take(self, counters: Sequence[Counter], now: float, n: int = 1) -> Counter | None:
        """Count ``n`` on every counter, or on none: the first counter that ``n`` more would take over its
        limit is returned (and nothing is counted); None: all were counted."""
        if not counters:
            return None
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            found: list[tuple[int, bytes, int, int, int, int]] = []
            for c in counters:  # two new counters of one bucket must not both be given its stalest slot
                found.append(self._find(c, now, {f[0] for f in found}))
            for c, (_, _, _, current, previous, start) in zip(counters, found, strict=True):
                if _estimate(current, previous, start, c.window, now) + n > c.limit:
                    return c
            for c, (offset, _, _, current, previous, start) in zip(counters, found, strict=True):
                _SLOT.pack_into(self._map, offset, c.digest, start, c.window, current + n, previous)
            return None
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def count(self, counter: Counter, now: float) -> float:
        """The sliding count of ``counter`` now (for tests and the benchmark)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            _, _, _, current, previous, start = self._find(counter, now)
            return _estimate(current, previous, start, counter.window, now)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _find(self, c: Counter, now: float, taken: set[int] | frozenset[int] = frozenset()
              ) -> tuple[int, bytes, int, int, int, int]:
        """Under the lock: ``c``'s slot (offset, digest, window, current, previous, start), its windows moved on to
        the one ``now`` is in; a new counter gets the bucket's stalest slot not in ``taken``, emptied."""
        start = int(now // c.window) * c.window
        base = HEADER + (int.from_bytes(c.digest[:8], "little") % self.buckets) * BUCKET * SLOT
        stalest, stalest_end = base, math.inf
        for i in range(BUCKET):
            offset = base + i * SLOT
            digest, slot_start, window, current, previous = _SLOT.unpack_from(self._map, offset)
            if digest == c.digest and window == c.window:
                if slot_start == start:
                    return offset, digest, window, current, previous, start
                if slot_start + window == start:
                    return offset, digest, window, 0, current, start
                return offset, digest, window, 0, 0, start
            end = slot_start + 2 * window  # after this, nothing in the slot counts
            if end < stalest_end and offset not in taken:
                stalest, stalest_end = offset, end
        return stalest, c.digest, c.window, 0, 0, start


def _estimate(current: int, previous: int, start: int, window: int, now: float) -> float:
    """The sliding window's count: the current window's, plus the part of the previous one still inside it."""
    covered = 1.0 - min(1.0, max(0.0, (now - start) / window))
    return current + previous * covered
