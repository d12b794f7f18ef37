"""Upload a relay's archived segments to ``URL/RELAY/``, idempotently, oldest first.

Theory of operation. With ``[spool] archive_dir`` set, the relay moves a
segment into the archive directory only once it is sealed and wholly
garbage, behind a durable checkpoint (``spool.engine.reclaim``): a file there never
changes again. ``upload_archive`` sends each one to
``URL/RELAY/<segment>.seg`` (shard K's to ``URL/RELAY/shards/K/``, which the
report names ``RELAY-K``, as its queue ids end in ``-K``), so a cron line on
every relay feeds one fleet archive and the report's ``--input URL/*`` tells
the relays apart by name.

What is there already is skipped: an object of the same size whose SHA-256
is the segment's. On S3 the checksum travels with the object as user
metadata (``x-amz-meta-logspool-sha256``), so a run costs a listing, a HEAD
per segment of matching size and reading the local files once; an object
with no such metadata (written by something else, or on a store without
user metadata: ``file://``, HDFS) is read back and hashed. Anything that
differs (a partial copy, an object overwritten, a local file replaced) is
sent again.

Segments go one at a time, oldest first, and the first failure stops the
run: the fleet's copy of a relay is always a prefix of its archive, never a
gap that a report would name as a missing segment. An object appears whole
or not at all: S3 makes a PUT (or a multipart upload) visible only once it
completes, and elsewhere the copy is written under a temporary name the
report ignores (``.NAME.part-PID``) and renamed into place.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, Final

import attrs

from mta.archive.errors import ArchiveError, UploadFailed
from spool import parse_segment_name, remote

CHECKSUM_KEY: Final = "logspool-sha256"
"""The user-metadata key of an uploaded segment's SHA-256 (hex) on S3."""

METADATA_STORES: Final = frozenset({"s3", "s3a"})
"""Stores where a PUT is atomic and carries user metadata (s3fs). Elsewhere: temporary name, then rename."""

_RELAY: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_READ: Final = 1024 * 1024


@attrs.frozen
class Sent:
    """What became of one segment: ``uploaded`` (new), ``replaced`` (an object that differed), ``skipped``
    (already there, same size and checksum), ``gone`` (deleted locally while the run went on)."""

    local: str
    url: str
    size: int
    action: str


Progress = Callable[[Sent], None]


def check_relay(name: str) -> str:
    """A relay name is one path segment of the fleet's archive (and the report's ``relay`` column)."""
    if not _RELAY.fullmatch(name):
        raise ArchiveError(f"--relay {name!r}: a relay name is letters, digits, '.', '_' and '-' "
                           "(not starting with '.' or '-'), as in a host name")
    return name


def destination(url: str, relay: str, shard: int = 0) -> str:
    """Where shard ``shard`` of ``relay`` keeps its segments under ``url``."""
    base = f"{url.rstrip('/')}/{relay}"
    return base if shard == 0 else f"{base}/shards/{shard}"


def archived(directory: str) -> list[tuple[int, str]]:
    """``(segment id, path)`` of the segments in an archive directory, oldest first ([] if it is not there)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = ((parse_segment_name(n), os.path.join(directory, n)) for n in names)
    return sorted((seg, path) for seg, path in found if seg is not None)


def _chunks(f: Any) -> Iterator[bytes]:
    while block := f.read(_READ):
        yield block


def file_checksum(path: str) -> str:
    """SHA-256 (hex) of a local file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in _chunks(f):
            h.update(block)
    return h.hexdigest()


def stored_checksum(fs: Any, url: str) -> str:
    """The SHA-256 of the object at ``url``: its user metadata if it has it, else its bytes read back."""
    if remote.scheme(url) in METADATA_STORES:
        value = fs.metadata(url).get(CHECKSUM_KEY)
        if value:
            return str(value)
    h = hashlib.sha256()
    with fs.open(url, "rb") as f:
        for block in _chunks(f):
            h.update(block)
    return h.hexdigest()


def _put(fs: Any, local: str, url: str, checksum: str) -> None:
    """Send ``local`` to ``url`` so that it appears whole or not at all."""
    if remote.scheme(url) in METADATA_STORES:
        fs.put_file(local, url, Metadata={CHECKSUM_KEY: checksum})
        return
    parent = remote.dirname(url)
    fs.makedirs(parent, exist_ok=True)
    part = remote.join(parent, f".{remote.basename(url)}.part-{os.getpid()}")
    fs.put_file(local, part)
    try:
        fs.mv(part, url)
    except BaseException:
        fs.rm(part)
        raise


def _listing(fs: Any, url: str) -> dict[str, int]:
    """Object name -> size under ``url`` (fresh: fsspec caches listings)."""
    fs.invalidate_cache()
    try:
        found = fs.ls(url, detail=True)
    except FileNotFoundError:
        return {}
    return {remote.basename(i["name"]): int(i["size"]) for i in found if i.get("type") == "file"}


def upload_directory(directory: str, dest: str, progress: Progress = lambda _s: None) -> list[Sent]:
    """Upload every segment of the archive ``directory`` to ``dest`` (see the module docstring).

    Raises ArchiveError for a URL no installed library reads, UploadFailed when a segment cannot be sent
    (those before it are there).
    """
    try:
        fs = remote.filesystem(dest)
        with remote.store_errors(dest, OSError):
            there = _listing(fs, dest)
    except remote.PlaceError as exc:
        raise ArchiveError(str(exc)) from None
    except OSError as exc:
        raise UploadFailed(f"{dest}: cannot list: {_why(exc)}") from None
    done: list[Sent] = []
    for _seg, local in archived(directory):
        name = os.path.basename(local)
        url = remote.join(dest, name)
        try:
            size = os.path.getsize(local)
            checksum = file_checksum(local)
        except FileNotFoundError:  # rotated away by the operator's clean-up while we ran
            sent = Sent(local, url, 0, "gone")
        else:
            try:
                with remote.store_errors(url, OSError):
                    sent = _send(fs, local, url, size, checksum, there.get(name))
            except OSError as exc:
                uploaded = sum(1 for s in done if s.action in ("uploaded", "replaced"))
                raise UploadFailed(f"{local} -> {url}: {_why(exc)} ({uploaded} segments uploaded before it; the "
                                   "next run goes on from there)") from None
        done.append(sent)
        progress(sent)
    return done


def _send(fs: Any, local: str, url: str, size: int, checksum: str, size_there: int | None) -> Sent:
    if size_there == size and stored_checksum(fs, url) == checksum:
        return Sent(local, url, size, "skipped")
    _put(fs, local, url, checksum)
    return Sent(local, url, size, "uploaded" if size_there is None else "replaced")


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
