"""A delivery worker's marks file: its point of no return made durable without asking the relay.

The worker adds a mark for every attempt about to send its final dot, calls
``sync`` (in a thread: it blocks on fdatasync) and writes the dot only once
``sync`` returned. The format is ``spool.format.marks``.

Why each step of opening a file (``<prefix>-<n>.tmp``, lock, header and zeros,
fsync, rename to ``<prefix>-<n>.marks``, fsync of the directory): a reader
never meets a ``.marks`` file without its header and room, so an fdatasync of
an append commits data only, no size; and the ``flock`` taken before anything
is written is held for as long as the file is the current one, so a file whose
lock can be taken has no writer (recovery reads it whole, the relay's collector
may delete it). The lock is why this module calls ``os`` and ``fcntl`` itself
rather than going through ``spool.fileio``: an advisory lock needs a real
descriptor, and the writer runs in a worker process of its own.

Resource handling: one descriptor, the current file's; ``close`` releases it
and its lock. Not thread-safe: one thread at a time calls ``add``, ``sync`` and ``close``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Sequence
from typing import Final

from spool.format.marks import (
    HEADER_SIZE,
    MAX_MARK_PAYLOAD,
    RECORD_HEAD_SIZE,
    SUFFIX,
    TMP_SUFFIX,
    encode_header,
    frame_mark,
    mark_payload,
)

DEFAULT_ROOM: Final = 4 << 20
# The smallest room a file may have: a header and the largest record, so that every mark fits a fresh file.
MIN_ROOM: Final = HEADER_SIZE + RECORD_HEAD_SIZE + MAX_MARK_PAYLOAD
_ZERO_CHUNK: Final = 1 << 20


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class MarksWriter:
    """The marks of one worker, in files ``<directory>/<prefix>-<n>.marks`` (n from 1, one after another).

    ``prefix`` names the writer (unique among live writers: the relay finds a dead worker's
    marks by it); it may not hold a path separator.

    Raises OSError from ``__init__`` when the first file cannot be made, and from ``sync``
    when a write or fdatasync fails: then the marks added since the last sync are dropped
    (not durable: their dots must not go) and the next ``sync`` begins a new file, since
    what the failed write left in this one is unknown.
    """

    def __init__(self, directory: str, prefix: str, room: int = DEFAULT_ROOM) -> None:
        if not prefix or os.sep in prefix or prefix.startswith("."):
            raise ValueError(f"not a marks file prefix: {prefix!r}")
        if room < MIN_ROOM:
            raise ValueError(f"room of {room} bytes is less than a header and the largest mark ({MIN_ROOM})")
        self._dir = directory
        self._prefix = prefix
        self._room = room
        self._n = 0
        self._fd: int | None = None
        self._path = ""
        self._file_id = 0
        self._end = HEADER_SIZE
        self._pending: list[bytes] = []  # payloads (mark_payload) not yet written
        self._closed = False
        if not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)
            _fsync_dir(os.path.dirname(os.path.abspath(directory)))
        self._open_next()

    @property
    def path(self) -> str:
        """The current file (the last one opened, if a failed sync has left none open)."""
        return self._path

    def add(self, start_pos: int, recipients: Sequence[str]) -> None:
        """Remember a mark for the next ``sync``. Raises ValueError for a mark the format cannot hold."""
        self._pending.append(mark_payload(start_pos, recipients))  # a bad mark is refused here, not at sync

    def sync(self) -> None:
        """Make every mark added so far durable; the dots they name may go once this returns."""
        if self._closed:
            raise ValueError("sync of a closed MarksWriter")
        pending, self._pending = self._pending, []
        if not pending:
            return
        if self._fd is None:
            self._open_next()
        # A record's size does not depend on the file's salt: encoded once, framed for the file it goes to.
        sizes = [RECORD_HEAD_SIZE + len(payload) for payload in pending]
        if sum(sizes) > self._room - self._end:
            self._roll()
        done = 0
        while done < len(pending):
            take, size = done, 0
            while take < len(pending) and size + sizes[take] <= self._room - self._end:
                size += sizes[take]
                take += 1
            if take == done:  # a batch bigger than one file: it goes on in the next
                self._roll()
                continue
            self._write(b"".join(frame_mark(self._file_id, payload) for payload in pending[done:take]))
            done = take

    def close(self) -> None:
        """Release the current file and its lock; the marks added since the last sync are not written."""
        self._closed = True
        self._pending = []
        self._release()

    def __enter__(self) -> MarksWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the files ------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        fd = self._fd
        assert fd is not None
        try:
            _pwrite_all(fd, data, self._end)
            os.fdatasync(fd)
        except OSError:
            self._release()
            raise
        self._end += len(data)

    def _roll(self) -> None:
        self._release()
        self._open_next()

    def _release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock

    def _open_next(self) -> None:
        """Make the next file, ready and durable under its final name, and hold its lock.

        Goes on with the next n when the name is taken (a file of an earlier life of this
        prefix: never replaced) or when the ``.tmp`` vanished before its rename (removed
        by someone who took it for a dead writer's leftover).
        """
        while True:
            self._n += 1
            base = os.path.join(self._dir, f"{self._prefix}-{self._n}")
            tmp, final = base + TMP_SUFFIX, base + SUFFIX
            if os.path.lexists(final):
                continue
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                file_id = secrets.randbits(64)
                _pwrite_all(fd, encode_header(file_id), 0)
                zeros = bytes(min(_ZERO_CHUNK, self._room - HEADER_SIZE))
                offset = HEADER_SIZE
                while offset < self._room:
                    _pwrite_all(fd, memoryview(zeros)[: self._room - offset], offset)
                    offset += min(len(zeros), self._room - offset)
                os.fsync(fd)
                try:
                    os.rename(tmp, final)
                except FileNotFoundError:
                    os.close(fd)
                    continue
                _fsync_dir(self._dir)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # a half-made file would read as damage
                raise
            self._fd, self._path, self._file_id, self._end = fd, final, file_id, HEADER_SIZE
            return
