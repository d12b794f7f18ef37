"""The quarantine directory: damaged bytes kept aside with a note that says where they came from.

Theory of operation (Postfix's ``corrupt/`` queue). When the spool meets
damage it does not fix (a damaged record in a sealed segment, a missing
segment, a checkpoint that fails its checksum) or cuts bytes it cannot vouch
for (a torn tail, an unacknowledged tail: docs/design.md, "Recovery"), the
bytes go here first, with their segment and offsets, and a note. Nothing in
this directory is ever read back by the engine; it is for the operator (and
``spoolctl verify``, which lists it). docs/format.md, "Quarantine", has the
layout::

    DIR/quarantine/<segment:016x>-<offset:010d>-<kind>.bin    the bytes, as they were
    DIR/quarantine/<segment:016x>-<offset:010d>-<kind>.json   the note
    DIR/quarantine/checkpoint-<ms>.bin, .json                 a damaged checkpoint, moved here

The key (segment, offset, kind) is what every reader names for the same
damage, so damage met again (by the next runner, the next start, an admin
read) is recognised: ``known`` is true, and nothing is copied or named twice.

Durability: the bytes are fsynced and renamed into place, and the directory
fsynced, before ``keep`` returns, because a caller that cuts (``Recovery``)
truncates the segment right after. A copy that fails (no room) is reported in
the note and the log line; it never stops the caller.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from spool.fileio import FileIO, read_exact, write_all
from spool.read.anomaly import Anomaly, Kind

log = logging.getLogger("spool.read.anomaly")

DIRNAME = "quarantine"
COPY_WINDOW = 1 << 20
# How each kind of note is named (the file name's last part).
SLUGS = {Kind.TORN_TAIL: "torn-tail", Kind.DAMAGED_RECORD: "damaged-record", Kind.BAD_HEADER: "bad-header",
         Kind.NEWER_FORMAT: "newer-format", Kind.MISSING_SEGMENT: "missing-segment",
         Kind.SIZE_MISMATCH: "size-mismatch", Kind.ENDS_EARLY: "ends-early", Kind.BAD_PAYLOAD: "bad-payload",
         Kind.UNKNOWN_TYPE: "unknown-type"}
CUT = "cut"  # the slug of an unacknowledged tail cut by recovery (docs/design.md, "Recovery")


def entry_name(segment: int, offset: int, slug: str) -> str:
    return f"{segment:016x}-{offset:010d}-{slug}"


@attrs.frozen
class Entry:
    """One quarantined piece of damage, as its note on disk says."""

    name: str  # the file name without its extension
    note: dict[str, Any]

    @property
    def bytes_kept(self) -> int:
        return int(self.note.get("bytes_kept") or 0)

    @property
    def lost(self) -> list[dict[str, Any]]:
        lost = self.note.get("lost") or []
        return list(lost) if isinstance(lost, list) else []

    def describe(self) -> str:
        n = self.note
        where = f"segment {n.get('segment')} at {n.get('offset')}" if n.get("segment") is not None else "checkpoint"
        return f"{self.name}: {n.get('kind', '?')} ({where}, {n.get('length', 0)} bytes): {n.get('action', '')}"


class Quarantine:
    """``DIR/quarantine`` of one spool. Thread-safe: runners, admin reads and body reads may all meet damage."""

    def __init__(self, io: FileIO, spool_dir: str) -> None:
        self.io = io
        self.spool_dir = spool_dir
        self.path = os.path.join(spool_dir, DIRNAME)
        self._lock = threading.Lock()
        self._names: set[str] | None = None
        self.bytes_on_disk = 0  # what the directory holds (bytes files), for the metric
        self.entries_on_disk = 0
        self.lost_on_disk = 0  # messages named lost in the notes

    # -- what is there --------------------------------------------------------------

    def _load(self) -> set[str]:
        if self._names is None:
            names: set[str] = set()
            for entry in read_entries(self.io, self.spool_dir):
                names.add(entry.name)
                self.entries_on_disk += 1
                self.bytes_on_disk += entry.bytes_kept
                self.lost_on_disk += len(entry.lost)
            self._names = names
        return self._names

    def totals(self) -> tuple[int, int, int]:
        """What the directory holds: notes, bytes kept, messages named lost (read once, then kept up to date)."""
        with self._lock:
            self._load()
            return self.entries_on_disk, self.bytes_on_disk, self.lost_on_disk

    def known(self, name: str) -> bool:
        """Is there a note by that name already (this damage was met and kept before)?"""
        with self._lock:
            return name in self._load()

    # -- keeping ------------------------------------------------------------------------

    def keep(self, name: str, note: dict[str, Any], source: tuple[str, int, int] | None) -> dict[str, Any]:
        """Copy ``source`` (file, offset, length) to ``NAME.bin`` and write the note ``NAME.json``.

        Returns the note as written (with ``bytes_kept`` and ``bytes_file``, or
        ``copy_error``). Never raises for a failed copy: the caller goes on.
        """
        with self._lock:
            names = self._load()
            note = dict(note)
            note.setdefault("found", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            note["bytes_kept"] = 0
            note["bytes_file"] = None
            try:
                self.io.makedirs(self.path)
                if source is not None and source[2] > 0:
                    kept = self._copy(source, os.path.join(self.path, name + ".bin"))
                    note["bytes_kept"] = kept
                    note["bytes_file"] = name + ".bin" if kept else None
                self._write_json(os.path.join(self.path, name + ".json"), note)
                self.io.fsync_dir(self.path)
            except OSError as exc:
                note["copy_error"] = f"{exc.strerror or exc}"
                log.error("could not write %s in %s: %s; the damage is reported here only", name, self.path,
                          note["copy_error"])
            if name not in names:
                names.add(name)
                self.entries_on_disk += 1
                self.lost_on_disk += len(note.get("lost") or [])
            self.bytes_on_disk += note["bytes_kept"]
            return note

    def add_lost(self, name: str, lost: Sequence[dict[str, Any]]) -> None:
        """Add messages to the ``lost`` list of note ``name`` (best effort: the log line has them anyway)."""
        with self._lock:
            path = os.path.join(self.path, name + ".json")
            try:
                fd = self.io.open_read(path)
                try:
                    note = json.loads(read_exact(self.io, fd, self.io.size(fd), 0))
                finally:
                    self.io.close(fd)
                note["lost"] = list(note.get("lost") or []) + list(lost)
                self._write_json(path, note)
                self.lost_on_disk += len(lost)
            except (OSError, ValueError) as exc:
                log.warning("could not add to %s: %s", path, exc)

    def move_in(self, path: str, name: str, note: dict[str, Any]) -> dict[str, Any]:
        """Move a whole file (a damaged checkpoint) here as ``NAME.bin``, with its note."""
        with self._lock:
            self._load()
            note = dict(note)
            note.setdefault("found", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            try:
                self.io.makedirs(self.path)
                fd = self.io.open_read(path)
                try:
                    size = self.io.size(fd)
                finally:
                    self.io.close(fd)
                self.io.rename(path, os.path.join(self.path, name + ".bin"))
                note["bytes_kept"] = size
                note["bytes_file"] = name + ".bin"
                self._write_json(os.path.join(self.path, name + ".json"), note)
                self.io.fsync_dir(self.path)
                self.io.fsync_dir(os.path.dirname(path))
            except OSError as exc:
                note["copy_error"] = f"{exc.strerror or exc}"
                log.error("could not move %s into %s: %s", path, self.path, note["copy_error"])
                raise
            self.entries_on_disk += 1
            self.bytes_on_disk += size
            return note

    def _copy(self, source: tuple[str, int, int], dst: str) -> int:
        """Copy what exists of the byte range (a truncated file may hold less); returns bytes copied."""
        src_path, offset, length = source
        tmp = dst + ".tmp"
        try:
            rfd = self.io.open_read(src_path)
        except FileNotFoundError:
            return 0
        copied = 0
        try:
            size = self.io.size(rfd)
            end = min(offset + length, size)
            if end <= offset:
                return 0
            wfd = self.io.open(tmp, create=True, truncate=True)
            try:
                pos = offset
                while pos < end:
                    data = read_exact(self.io, rfd, min(COPY_WINDOW, end - pos), pos)
                    if not data:
                        break
                    write_all(self.io, wfd, data, pos - offset)
                    pos += len(data)
                    copied += len(data)
                self.io.fsync(wfd)
            finally:
                self.io.close(wfd)
        finally:
            self.io.close(rfd)
        self.io.rename(tmp, dst)
        return copied

    def _write_json(self, path: str, note: dict[str, Any]) -> None:
        data = (json.dumps(note, indent=1, sort_keys=True, default=str) + "\n").encode()
        tmp = path + ".tmp"
        fd = self.io.open(tmp, create=True, truncate=True)
        try:
            write_all(self.io, fd, data, 0)
            self.io.fsync(fd)
        finally:
            self.io.close(fd)
        self.io.rename(tmp, path)


def read_entries(io: FileIO, spool_dir: str) -> Iterator[Entry]:
    """The notes in ``DIR/quarantine``, in name order (segment, then offset). Unreadable notes are skipped."""
    path = os.path.join(spool_dir, DIRNAME)
    try:
        names = sorted(io.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            fd = io.open_read(os.path.join(path, name))
            try:
                note = json.loads(read_exact(io, fd, io.size(fd), 0))
            finally:
                io.close(fd)
        except (OSError, ValueError):
            continue
        if isinstance(note, dict):
            yield Entry(name.removesuffix(".json"), note)


def anomaly_note(anomaly: Anomaly, spool_dir: str, *, found_by: str, action: str,
                 lost: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The note of an anomaly of the log: what, where (file relative to the spool), why, and what it cost."""
    return {"kind": anomaly.kind.value, "segment": anomaly.segment,
            "file": os.path.relpath(anomaly.path, spool_dir), "offset": anomaly.offset, "length": anomaly.length,
            "resumes_at": anomaly.resume, "reason": anomaly.reason, "found_by": found_by, "action": action,
            "lost": list(lost)}
