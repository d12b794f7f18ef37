"""A FileIO that performs every operation on real files and records it, in order.

Theory of operation. The recording is the input of the crash-state builder
(``fault_injection.crashstates``), as in ALICE and LazyFS: it names files by
*inode* (a small integer handed out when a file or directory is created), not
by path, because a rename moves a name and not the data. Every mutating call
becomes one ``Op``:

- namespace ops (``Link`` for create/mkdir, ``Rename``, ``Unlink``) belong to a
  directory and become durable only with a later ``SyncDir`` of it;
- data ops (``Write``, ``Truncate``) belong to a file and become durable with a
  later ``Sync`` (fsync or fdatasync) of it.

The workload logs its own acknowledgements (``Event`` ops: "this message was
acknowledged", "this outcome was recorded") into the same sequence, so every
crash point knows exactly what had been promised before it.

Reads are passed through and not recorded. A failed call (an exception from
the inner FileIO) is not recorded either: a failed fsync made nothing durable.

Threads: the relay calls its FileIO from worker threads (the committer's
syncs, local delivery), several at once. Each mutating call and its record
happen under one lock, so the recorded order is the order the calls took
effect: an fsync recorded before a concurrent write never claims that write.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import attrs

from spool.fileio import FileIO, OsFileIO

ROOT_INO = 0


@attrs.frozen
class Link:
    """A new name in directory ``parent`` for a fresh inode (create or mkdir)."""

    parent: int
    name: str
    ino: int
    is_dir: bool


@attrs.frozen
class Rename:
    src_parent: int
    src_name: str
    dst_parent: int
    dst_name: str
    ino: int


@attrs.frozen
class Unlink:
    parent: int
    name: str
    ino: int


@attrs.frozen
class Write:
    ino: int
    offset: int
    data: bytes


@attrs.frozen
class Truncate:
    ino: int
    length: int


@attrs.frozen
class Sync:
    """fsync or fdatasync of a file completed: its data up to here is durable."""

    ino: int


@attrs.frozen
class SyncDir:
    """fsync of a directory completed: its namespace ops up to here are durable."""

    ino: int


@attrs.frozen
class Event:
    """Something the workload logged: an acknowledgement or a remote's answer."""

    kind: str
    data: tuple[Any, ...]


Op = Link | Rename | Unlink | Write | Truncate | Sync | SyncDir | Event
NamespaceOp = Link | Rename | Unlink
DataOp = Write | Truncate


@attrs.define
class Snapshot:
    """A durable starting state: directories and files (relative paths) with contents."""

    dirs: list[str] = attrs.field(factory=list)
    files: dict[str, bytes] = attrs.field(factory=dict)

    @classmethod
    def capture(cls, root: str) -> Snapshot:
        snap = cls()
        for dirpath, dirnames, filenames in os.walk(root):
            rel = os.path.relpath(dirpath, root)
            for d in sorted(dirnames):
                snap.dirs.append(os.path.normpath(os.path.join(rel, d)))
            for f in sorted(filenames):
                if f == "lock":
                    continue  # the spool's lock file: taken with os directly, never data
                with open(os.path.join(dirpath, f), "rb") as fh:
                    snap.files[os.path.normpath(os.path.join(rel, f))] = fh.read()
        return snap


class Recording:
    """The ops of one run, with the initial state they apply to."""

    def __init__(self, initial: Snapshot | None = None) -> None:
        self.initial = initial or Snapshot()
        self.ops: list[Op] = []
        # The initial namespace: inode numbers for what the snapshot holds.
        self.initial_entries: dict[int, dict[str, int]] = {ROOT_INO: {}}
        self.initial_data: dict[int, bytes] = {}
        self.dir_inos: set[int] = {ROOT_INO}
        self._next_ino = 1
        for d in sorted(self.initial.dirs, key=lambda p: p.count("/")):
            parent, name = self._split_initial(d)
            ino = self.new_ino()
            self.initial_entries[parent][name] = ino
            self.initial_entries[ino] = {}
            self.dir_inos.add(ino)
        for f, data in sorted(self.initial.files.items()):
            parent, name = self._split_initial(f)
            ino = self.new_ino()
            self.initial_entries[parent][name] = ino
            self.initial_data[ino] = data

    def _split_initial(self, rel: str) -> tuple[int, str]:
        parts = rel.split("/")
        ino = ROOT_INO
        for p in parts[:-1]:
            ino = self.initial_entries[ino][p]
        return ino, parts[-1]

    def new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def events(self, upto: int | None = None) -> list[Event]:
        ops = self.ops if upto is None else self.ops[:upto]
        return [op for op in ops if isinstance(op, Event)]


class RecordingFileIO:
    """Wraps a real FileIO rooted at ``root``; records every mutation into ``recording``.

    Paths given to it must lie under ``root`` (the spool directory).
    """

    def __init__(self, root: str, recording: Recording | None = None, inner: FileIO | None = None) -> None:
        self.root = os.path.abspath(root)
        self.inner: FileIO = inner or OsFileIO()
        self.rec = recording or Recording(Snapshot.capture(self.root))
        self.entries: dict[int, dict[str, int]] = {k: dict(v) for k, v in self.rec.initial_entries.items()}
        self.fd_ino: dict[int, int] = {}
        self._lock = threading.Lock()

    # -- names --------------------------------------------------------------

    def _parts(self, path: str) -> list[str]:
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if rel == ".":
            return []
        if rel.startswith(".."):
            raise ValueError(f"{path} lies outside the recorded root {self.root}")
        return rel.split(os.sep)

    def _dir_ino(self, parts: list[str]) -> int:
        ino = ROOT_INO
        for p in parts:
            ino = self.entries[ino][p]
        return ino

    def _lookup(self, path: str) -> tuple[int, str, int | None]:
        parts = self._parts(path)
        parent = self._dir_ino(parts[:-1])
        return parent, parts[-1], self.entries[parent].get(parts[-1])

    def event(self, kind: str, *data: Any) -> None:
        """Log an acknowledgement or other workload event at this point of the op sequence."""
        with self._lock:
            self.rec.ops.append(Event(kind, tuple(data)))

    # -- FileIO ---------------------------------------------------------------

    def open(self, path: str, *, create: bool = False, truncate: bool = False) -> int:
        with self._lock:
            parent, name, ino = self._lookup(path)
            fd = self.inner.open(path, create=create, truncate=truncate)
            if ino is None:
                ino = self._link(parent, name, is_dir=False)
            elif truncate:
                self.rec.ops.append(Truncate(ino, 0))
            self.fd_ino[fd] = ino
            return fd

    def create_new(self, path: str) -> int:
        with self._lock:
            parent, name, _ino = self._lookup(path)
            fd = self.inner.create_new(path)  # FileExistsError if the name is taken: nothing recorded
            self.fd_ino[fd] = self._link(parent, name, is_dir=False)
            return fd

    def _link(self, parent: int, name: str, *, is_dir: bool) -> int:
        """A new inode named ``name`` in ``parent``: recorded as a Link."""
        ino = self.rec.new_ino()
        self.entries[parent][name] = ino
        if is_dir:
            self.entries[ino] = {}
            self.rec.dir_inos.add(ino)
        self.rec.ops.append(Link(parent, name, ino, is_dir))
        return ino

    def open_read(self, path: str) -> int:
        return self.inner.open_read(path)

    def close(self, fd: int) -> None:
        with self._lock:
            self.fd_ino.pop(fd, None)
            self.inner.close(fd)

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        with self._lock:
            n = self.inner.write(fd, data, offset)
            if n > 0:
                self.rec.ops.append(Write(self.fd_ino[fd], offset, bytes(memoryview(data)[:n])))
            return n

    def read(self, fd: int, size: int, offset: int) -> bytes:
        return self.inner.read(fd, size, offset)

    def size(self, fd: int) -> int:
        return self.inner.size(fd)

    def fsync(self, fd: int) -> None:
        with self._lock:
            self.inner.fsync(fd)
            self.rec.ops.append(Sync(self.fd_ino[fd]))

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            self.inner.fdatasync(fd)
            self.rec.ops.append(Sync(self.fd_ino[fd]))

    def truncate(self, fd: int, length: int) -> None:
        with self._lock:
            self.inner.truncate(fd, length)
            self.rec.ops.append(Truncate(self.fd_ino[fd], length))

    def allocate(self, fd: int, length: int) -> None:
        """Recorded as a truncate that extends the file with zeros (what it reads as); never shrinks."""
        with self._lock:
            before = self.inner.size(fd)
            self.inner.allocate(fd, length)
            if length > before:
                self.rec.ops.append(Truncate(self.fd_ino[fd], length))

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            sp, sn, ino = self._lookup(src)
            dp, dn, _old = self._lookup(dst)
            self.inner.rename(src, dst)
            assert ino is not None
            del self.entries[sp][sn]
            self.entries[dp][dn] = ino
            self.rec.ops.append(Rename(sp, sn, dp, dn, ino))

    def unlink(self, path: str) -> None:
        with self._lock:
            parent, name, ino = self._lookup(path)
            self.inner.unlink(path)
            assert ino is not None
            del self.entries[parent][name]
            self.rec.ops.append(Unlink(parent, name, ino))

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            ino = self._dir_ino(self._parts(path))
            self.inner.fsync_dir(path)
            self.rec.ops.append(SyncDir(ino))

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def makedirs(self, path: str) -> None:
        """Each directory it made is one Link, recorded once the call succeeded."""
        with self._lock:
            parts = self._parts(path)
            self.inner.makedirs(path)
            ino = ROOT_INO
            for p in parts:
                child = self.entries[ino].get(p)
                if child is None:
                    child = self._link(ino, p, is_dir=True)
                ino = child
