"""Segment files where a fleet keeps them: a path, a ``file://`` URL, or any URL fsspec reaches.

Theory of operation. A place is a string: a local path, or a URL with a
scheme (``s3://bucket/prefix``, ``hdfs://namenode/path``, ``gs://…``).
``file://`` URLs are turned into local paths and read with ``os`` like every
other local file; every other URL goes through fsspec (``s3fs`` for S3,
pyarrow's libhdfs binding for HDFS), the one file-system layer of the
report and of ``mta archive upload``. docs/design.md ("Archives in object
storage") says why fsspec rather than ``pyarrow.fs``: globs on every store,
an object's user metadata (the upload's checksum), and a relay host that
uploads without Arrow.

The log reader (``spool.read.reader``) reads through the ``FileIO`` interface;
``RemoteFileIO`` is a read-only one over an fsspec file system, so a segment
in a bucket is checked and classified by the same code as one on disk. Its
paths are whole URLs. fsspec is imported when the first URL is met, so
``spool`` imports (and reads local files) without it.

Credentials and endpoints come from where each store's library looks: for
S3 the AWS variables and files (``AWS_ENDPOINT_URL`` for MinIO, Ceph or a
test server), for any protocol fsspec's own configuration
(``FSSPEC_S3_ENDPOINT_URL``, ``~/.config/fsspec/``). Nothing here carries
them: a Spark executor finds them in its own environment.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
from collections.abc import Iterator
from typing import Any, Final

from spool.errors import SpoolError
from spool.fileio import FileIO, OsFileIO

_SCHEME: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_GLOB: Final = re.compile(r"[*?\[]")
READ_BLOCK: Final = 4 * 1024 * 1024
"""Bytes fetched per request when reading an object: the reader walks a segment front to back in 1 MiB
windows, so a read-ahead block of a few windows costs one request per block, not per window."""


class PlaceError(SpoolError, ValueError):
    """A URL that cannot be read at all: fsspec or the store's library is not installed, or the scheme is
    unknown. One line for the operator."""


def scheme(place: str) -> str | None:
    """The URL scheme of ``place`` (``s3``), or None for a local path."""
    m = _SCHEME.match(place)
    return m.group(1).lower() if m else None


def is_remote(place: str) -> bool:
    """Is ``place`` read through fsspec (a URL other than ``file://``)?"""
    s = scheme(place)
    return s is not None and s != "file"


def local_path(place: str) -> str:
    """``file:///x/y`` → ``/x/y``; a local path unchanged."""
    if scheme(place) == "file":
        return "/" + place[len("file://"):].lstrip("/")
    return place


def filesystem(url: str) -> Any:
    """The fsspec file system of ``url`` (fsspec keeps one instance per store and its options).

    Raises PlaceError when fsspec, or the library of the URL's scheme, is missing, or the scheme is unknown.
    """
    try:
        import fsspec
    except ImportError:
        raise PlaceError(f"{url}: reading URLs needs fsspec: pip install 'logspool[fleet]'") from None
    try:
        fs, _path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        hint = "pip install 'logspool[fleet]'" if scheme(url) in ("s3", "s3a") else exc.msg
        raise PlaceError(f"{url}: the library for {scheme(url)}:// is not installed ({hint})") from None
    except ValueError:
        raise PlaceError(f"{url}: unknown URL scheme {scheme(url)}://") from None
    except OSError as exc:  # HDFS: pyarrow connects as the file system is made, through the host's libhdfs
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        hint = " (HDFS needs the Hadoop client on this host: HADOOP_HOME, CLASSPATH)" if scheme(url) == "hdfs" else ""
        raise PlaceError(f"{url}: {first}{hint}") from None
    return fs


def is_glob(place: str) -> bool:
    return _GLOB.search(place) is not None


def join(place: str, name: str) -> str:
    return posixpath.join(place, name)


def dirname(place: str) -> str:
    """The parent of a path or URL (``s3://b/mx1/x.seg`` → ``s3://b/mx1``)."""
    return posixpath.dirname(place.rstrip("/"))


def basename(place: str) -> str:
    return posixpath.basename(place.rstrip("/"))


def _url(fs: Any, path: str) -> str:
    """A path as an fsspec call returns it (no scheme) back as a URL."""
    return str(fs.unstrip_protocol(path))


@contextlib.contextmanager
def store_errors(url: str, kind: type[Exception]) -> Iterator[None]:
    """Whatever a store's library raises beyond OSError (botocore's ``NoCredentialsError``, an
    ``aiohttp`` error, a bad endpoint's ``ValueError``) as ``kind``, in one line: so a report names it, and
    a command says it without a traceback. A PlaceError names ``url``; an OSError does not (its catcher
    says which file it was reading)."""
    try:
        yield
    except (OSError, PlaceError):
        raise
    except Exception as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise kind(f"{url}: {why}" if issubclass(kind, PlaceError) else why) from exc


class Listing:
    """The driver's view of remote places, read fresh: fsspec caches listings per file-system instance, and
    a report that lists twice (or an upload that has just written) must see the store as it is now."""

    def __init__(self) -> None:
        self._fresh: set[int] = set()

    def fs(self, url: str) -> Any:
        fs = filesystem(url)
        if id(fs) not in self._fresh:
            fs.invalidate_cache()
            self._fresh.add(id(fs))
        return fs

    def matches(self, pattern: str) -> list[tuple[str, bool]]:
        """``(url, is a directory)`` for what ``pattern`` names: a glob's matches, or the one URL if it is
        there; sorted."""
        with store_errors(pattern, PlaceError):
            return self._matches(pattern)

    def _matches(self, pattern: str) -> list[tuple[str, bool]]:
        fs = self.fs(pattern)
        if is_glob(pattern):
            found = fs.glob(pattern, detail=True)
            return sorted((_url(fs, p), info.get("type") == "directory") for p, info in found.items())
        try:
            info = fs.info(pattern)
        except FileNotFoundError:
            return []
        return [(pattern.rstrip("/"), info.get("type") == "directory")]

    def entries(self, url: str) -> list[tuple[str, bool]]:
        """``(url, is a directory)`` for what ``url`` holds; [] if it is not there."""
        fs = self.fs(url)
        try:
            with store_errors(url, PlaceError):
                found = fs.ls(url, detail=True)
        except FileNotFoundError:
            return []
        return sorted((_url(fs, info["name"]), info.get("type") == "directory") for info in found)


class RemoteFileIO:
    """``FileIO`` over fsspec, read-only: every path is a whole URL. Handles are small integers."""

    def __init__(self) -> None:
        self._files: dict[int, tuple[Any, int]] = {}  # handle -> (open file, its size when opened)
        self._next = 1

    def open_read(self, path: str) -> int:
        """Raises FileNotFoundError for an object that is not there, another OSError for one that cannot be
        read (no permission, archived to cold storage)."""
        fs = filesystem(path)
        with store_errors(path, OSError):
            f = fs.open(path, "rb", block_size=READ_BLOCK, cache_type="readahead")
        fd = self._next
        self._next += 1
        size = getattr(f, "size", None)
        with store_errors(path, OSError):
            self._files[fd] = (f, int(size) if size is not None else int(fs.size(path)))
        return fd

    def read(self, fd: int, size: int, offset: int) -> bytes:
        f = self._files[fd][0]
        with store_errors(str(getattr(f, "path", "")), OSError):
            f.seek(offset)
            return bytes(f.read(size))

    def size(self, fd: int) -> int:
        return self._files[fd][1]

    def close(self, fd: int) -> None:
        self._files.pop(fd)[0].close()

    def listdir(self, path: str) -> list[str]:
        fs = filesystem(path)
        with store_errors(path, OSError):
            return [basename(p) for p in fs.ls(path, detail=False)]

    def exists(self, path: str) -> bool:
        with store_errors(path, OSError):
            return bool(filesystem(path).exists(path))

    # -- the writing half of FileIO: a report never writes where it reads ---------------------------------

    def _read_only(self, *_args: object, **_kwargs: object) -> Any:
        raise PermissionError("segments at a URL are read-only to the log reader")

    open = create_new = write = fsync = fdatasync = truncate = allocate = _read_only
    rename = unlink = fsync_dir = makedirs = _read_only


_OS: Final = OsFileIO()


def file_io(place: str) -> FileIO:
    """The FileIO that reads ``place``: the operating system's for a local path, fsspec's for a URL."""
    return RemoteFileIO() if is_remote(place) else _OS
