"""Reading and collecting the workers' marks files (``spool.format.marks``, written by ``spool.write.marks``).

Three readers, by what each knows about the writers:

- ``read_marks_dir`` (recovery): every file, each under its lock, so that a
  file is read only once no writer can still append to it; one whose lock a
  live writer keeps past ``lock_wait`` is reported, not read.
- ``marks_of`` (the relay, once a worker has died): one writer's files, with
  no lock, since the process that held it is known to be gone.
- ``MarksCollector`` (the relay, while it runs): deletes the closed files
  whose marks recovery would no longer need.

The lock is an ``flock`` on the file: a writer holds it from the creation of
a file until it moves on, so a file whose lock can be taken has no writer and
never changes again.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from typing import Final

import attrs

from spool.format.marks import SUFFIX, TMP_SUFFIX, Mark, MarksRead, parse_marks

LOCK_POLL: Final = 0.010
HELD: Final = "held by a live writer"


def _read_fd(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    parts: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, max(size - offset, 1 << 16), offset)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        offset += len(chunk)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _open(path: str) -> int | None:
    """A descriptor on ``path``, or None when it is gone (deleted, or renamed from ``.tmp`` to ``.marks``)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


def _read_locked(path: str, lock_wait: float) -> MarksRead | None:
    """The file read whole under its lock; one the system cannot read is damage (named), never an error."""
    try:
        fd = _open(path)
        if fd is None:
            return None
        try:
            deadline = time.monotonic() + lock_wait
            while not _try_lock(fd):
                if time.monotonic() >= deadline:
                    return MarksRead(path, (), damage=HELD)
                time.sleep(LOCK_POLL)
            return parse_marks(path, _read_fd(fd))
        finally:
            os.close(fd)
    except OSError as exc:
        return MarksRead(path, (), damage=f"unreadable: {exc.strerror or exc}")


def read_marks_dir(directory: str, *, lock_wait: float = 10.0) -> list[MarksRead]:
    """Every ``*.marks`` and ``*.tmp`` file of ``directory``, read whole under its lock, sorted by name.

    The directory is listed again until no new name appears: a ``.tmp`` renamed between the
    listing and its open is read under its new name. No directory: ``[]``. A file whose lock
    is not got within ``lock_wait`` seconds (its writer is alive) has no marks and the damage
    ``"held by a live writer"``.
    """
    results: dict[str, MarksRead] = {}
    seen: set[str] = set()
    while True:
        try:
            listed = _listdir(directory)
        except OSError as exc:  # not a directory, or not listable: no telling which marks it holds
            return [MarksRead(directory, (), damage=f"cannot be listed: {exc.strerror or exc}")]
        names = sorted(n for n in listed if n.endswith((SUFFIX, TMP_SUFFIX)) and n not in seen)
        if not names:
            break
        for name in names:
            seen.add(name)
            path = os.path.join(directory, name)
            read = _read_locked(path, lock_wait)
            if read is not None:
                results[name] = read
    return [results[name] for name in sorted(results)]


def _writer_files(directory: str, prefix: str) -> list[str]:
    """One writer's file names, in the order it wrote them (by n, not by name: 10 follows 9)."""
    pattern = re.compile(re.escape(prefix) + r"-([1-9][0-9]*)(" + re.escape(SUFFIX) + "|" + re.escape(TMP_SUFFIX) + ")")
    found = [(int(m.group(1)), name) for name in _listdir(directory) if (m := pattern.fullmatch(name))]
    return [name for _n, name in sorted(found)]


def marks_of(directory: str, prefix: str) -> list[Mark]:
    """The marks of every file of the writer ``prefix``, whose process is known to be dead (so: no lock).

    Damage stops the read of that file only; the marks read before it are returned and
    nothing is raised, since the caller (the relay, after a worker died) has no better
    answer for the rest: whatever is missing is damage that recovery reports.
    """
    marks: list[Mark] = []
    try:
        names = _writer_files(directory, prefix)
    except OSError:
        return marks
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = _open(path)
            if fd is None:
                continue
            try:
                marks.extend(parse_marks(path, _read_fd(fd)).marks)
            finally:
                os.close(fd)
        except OSError:
            continue  # unreadable: as damage, what it held is for recovery to report
    return marks


@attrs.frozen
class _Closed:
    """What a closed file held: it never changes again, so it is read once per inode."""

    inode: tuple[int, int]
    highest: int | None  # the highest start_pos; None: no marks
    damaged: bool


class MarksCollector:
    """Deletes the closed marks files that recovery no longer needs.

    A file goes when its lock can be taken at once (no writer: a writer's current file is
    locked, and a ``.tmp`` is never touched) and all its marks lie before the working
    suffix's start of a durable checkpoint (or it holds none): recovery begins its scan at
    that start and ignores a mark of an attempt before it. A damaged file is never deleted:
    recovery quarantines it at start.

    No fsync of the directory follows a delete: a deleted file that a crash brings back holds
    only marks before a durable checkpoint's working start, which recovery ignores.

    Resource handling: holds no descriptor between calls; ``collect`` opens one at a time.
    """

    def __init__(self, directory: str) -> None:
        self._dir = directory
        self._closed: dict[str, _Closed] = {}

    def collect(self, working_start: int) -> list[str]:
        """Delete what may go; returns the names deleted. Raises OSError from a delete or a read."""
        names = sorted(n for n in _listdir(self._dir) if n.endswith(SUFFIX))
        self._closed = {n: c for n, c in self._closed.items() if n in names}
        deleted: list[str] = []
        for name in names:
            path = os.path.join(self._dir, name)
            fd = _open(path)
            if fd is None:
                self._closed.pop(name, None)
                continue
            try:
                if not _try_lock(fd):
                    continue
                closed = self._closed_file(name, path, fd)
                if closed.damaged or (closed.highest is not None and closed.highest >= working_start):
                    continue
                os.unlink(path)
                del self._closed[name]
                deleted.append(name)
            finally:
                os.close(fd)
        return deleted

    def _closed_file(self, name: str, path: str, fd: int) -> _Closed:
        st = os.fstat(fd)
        inode = (st.st_dev, st.st_ino)
        known = self._closed.get(name)
        if known is not None and known.inode == inode:
            return known
        read = parse_marks(path, _read_fd(fd))
        highest = max((m.start_pos for m in read.marks), default=None)
        closed = _Closed(inode, highest, read.damage is not None)
        self._closed[name] = closed
        return closed


@attrs.frozen
class MarksFileInfo:
    """One marks file as ``spoolctl marks`` shows it (read without waiting for any lock)."""

    name: str
    size: int
    marks: int
    first: int | None  # the lowest and highest START positions its marks name
    last: int | None
    writing: bool  # a live writer holds its lock: a worker marks into it now
    damage: str | None


def describe_marks(directory: str) -> list[MarksFileInfo]:
    """Every marks file, read as it is now: a file a worker is writing reads up to its last whole mark."""
    out = []
    for name in sorted(_listdir(directory)):
        if not name.endswith((SUFFIX, TMP_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        fd = _open(path)
        if fd is None:
            continue
        try:
            writing = not _try_lock(fd)  # closing the descriptor releases a lock taken here
            read = parse_marks(path, _read_fd(fd))
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        starts = [m.start_pos for m in read.marks]
        out.append(MarksFileInfo(name, size, len(starts), min(starts, default=None), max(starts, default=None),
                                 writing, read.damage))
    return out
