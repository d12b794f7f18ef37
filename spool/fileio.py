"""Every file operation the spool performs, behind one small interface.

Why: the fault-injection harness records these calls to build the crash states
Linux permits, and injects ENOSPC, EIO, short writes and fsync failure, without
touching the engine. The engine never calls ``os`` for file I/O directly, and
neither does local delivery (``mta.delivery.maildir``): a message delivered
into a Maildir is part of what a power cut may take, so the harness records it
through the same interface.

File handles are plain integers (file descriptors for ``OsFileIO``); an
implementation may hand out any integers it likes.
"""

from __future__ import annotations

import os
from typing import Protocol


class FileIO(Protocol):
    def open(self, path: str, *, create: bool = False, truncate: bool = False) -> int:
        """Open read-write (``create``: make it if missing, mode 0600)."""
        ...

    def create_new(self, path: str) -> int:
        """Create ``path`` (mode 0600) and open it for writing; ``FileExistsError`` if it exists (O_EXCL)."""
        ...

    def open_read(self, path: str) -> int: ...

    def close(self, fd: int) -> None: ...

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        """Write at ``offset``; returns bytes written (may be short)."""
        ...

    def read(self, fd: int, size: int, offset: int) -> bytes: ...

    def size(self, fd: int) -> int: ...

    def fsync(self, fd: int) -> None: ...

    def fdatasync(self, fd: int) -> None: ...

    def truncate(self, fd: int, length: int) -> None: ...

    def allocate(self, fd: int, length: int) -> None:
        """Give the file blocks for its first ``length`` bytes (zeros), so that the space is held.

        Raises OSError(ENOSPC) when there is no room. Used for the spool's
        reserve (``spool.write.reserve``).
        """
        ...

    def rename(self, src: str, dst: str) -> None: ...

    def unlink(self, path: str) -> None: ...

    def fsync_dir(self, path: str) -> None: ...

    def listdir(self, path: str) -> list[str]: ...

    def exists(self, path: str) -> bool: ...

    def makedirs(self, path: str) -> None:
        """Make ``path`` and its missing parents (mode 0700); nothing if it exists."""
        ...


class OsFileIO:
    """The real thing: thin wrappers over ``os`` calls."""

    def open(self, path: str, *, create: bool = False, truncate: bool = False) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT
        if truncate:
            flags |= os.O_TRUNC
        return os.open(path, flags, 0o600)

    def create_new(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def open_read(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def close(self, fd: int) -> None:
        os.close(fd)

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def read(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def allocate(self, fd: int, length: int) -> None:
        os.posix_fallocate(fd, 0, length)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)


def write_all(io: FileIO, fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write every byte, looping over short writes; a zero-length write is an error."""
    view = memoryview(data)
    while view:
        n = io.write(fd, view, offset)
        if n <= 0:
            raise OSError(f"write returned {n}")
        view = view[n:]
        offset += n


def read_exact(io: FileIO, fd: int, size: int, offset: int) -> bytes:
    """Read ``size`` bytes or fewer at end of file, looping over short reads."""
    parts: list[bytes] = []
    got = 0
    while got < size:
        chunk = io.read(fd, size - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
