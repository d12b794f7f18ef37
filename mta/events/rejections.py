"""SMTP rejections as a stream: a bounded side log beside the spool, apart from the log of messages.

Why apart. A rejection never reaches the spool: putting it in the log
would let refused traffic, which an attacker controls, grow the log and
pin its segments. So each shard's relay keeps its rejections in
``<spool.dir>/rejections/``, a log of its own with its own ids, a byte cap
and no consumer that can pin it.

Layout. Files ``<first seq, 12 digits>.jsonl``, one JSON object a line,
each with ``seq``, a number one higher than the line before it in the
shard's rejections (never reused, across restarts too), and ``id`` =
``r:<seq>``, which is how the stream names it (so it can never be taken for
a record's position). ``durable`` holds the highest ``seq`` fsynced, as 8
bytes, rewritten with one ``pwrite`` after every ``fdatasync``; readers show
nothing past it, so nothing a crash undoes is ever shown.

Bounds. The relay adds a rejection in O(1) to a queue of at most
``PENDING`` lines, and a task writes the queue out and syncs it, in a
worker thread, at most ``FLUSH`` seconds after the first line came. A full
queue, or a write that fails (a full disk), drops lines: the next line
written carries ``dropped_before`` (how many were dropped just before it),
and nothing else stops. A file is closed at half the cap
(``[events] rejections_max``) and a new one begun; only the newest two are
kept, so the directory holds about the cap at most: a reader whose ``after`` went with them is told it lags, with the
gap of seqs no longer kept.

One writer per directory: a shard's relay is the only writer of its spool.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections import deque
from typing import Any

import attrs
import trio

from spool import FileIO, OsFileIO

__all__ = ["RejectionLog", "RejectionPage", "RejectionReader", "format_rid", "parse_rid"]

log = logging.getLogger("mta.events")

PENDING = 4096  # lines queued in memory at most
FLUSH = 0.1  # seconds a line may wait before the queue is written and synced
DIRNAME = "rejections"
_FILE = re.compile(r"(\d{12})\.jsonl")
_DURABLE = struct.Struct("<Q")


def format_rid(seq: int) -> str:
    return f"r:{seq}"


def parse_rid(text: str) -> int:
    """``r:<seq>``. Raises ValueError."""
    head, colon, digits = text.strip().partition(":")
    if head != "r" or not colon or not digits.isdigit():
        raise ValueError(f"not a rejection id: {text!r} (want r:17)")
    return int(digits)


def _files(directory: str) -> list[tuple[int, str]]:
    """(first seq, path) of the directory's files, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in names if (m := _FILE.fullmatch(name))]
    return sorted(found)


def _read_durable(directory: str) -> int:
    try:
        with open(os.path.join(directory, "durable"), "rb") as f:
            data = f.read(_DURABLE.size)
    except FileNotFoundError:
        return 0
    return _DURABLE.unpack(data)[0] if len(data) == _DURABLE.size else 0


class RejectionLog:
    """The writer (in the relay). ``add`` from the event loop; ``run`` is the task that writes and syncs.

    All its file operations go through ``io`` (the relay's ``spool.FileIO``,
    so a recording of the relay's I/O sees them). Resource handling: one
    open file (the newest) and the ``durable`` file, opened by ``open``
    (recovery: a torn last line is cut off, what is left is synced and
    published) and kept for the life of the process.
    """

    def __init__(self, spool_dir: str, max_bytes: int, io: FileIO | None = None) -> None:
        self.dir = os.path.join(spool_dir, DIRNAME)
        self.max_bytes = max_bytes
        self.io: FileIO = io if io is not None else OsFileIO()
        self._queue: deque[dict[str, Any]] = deque()
        self._dropped = 0
        self._wake = trio.Event()
        self._next = 1
        self._fd = -1
        self._size = 0
        self._durable_fd = -1

    def _files(self) -> list[tuple[int, str]]:
        names = self.io.listdir(self.dir)
        return sorted((int(m.group(1)), os.path.join(self.dir, name)) for name in names
                      if (m := _FILE.fullmatch(name)))

    def open(self) -> None:
        """Recover the directory (blocking: call before serving). Raises OSError."""
        io = self.io
        io.makedirs(self.dir)
        files = self._files()
        durable_path = os.path.join(self.dir, "durable")
        self._durable_fd = io.open(durable_path, create=True)
        raw = io.read(self._durable_fd, _DURABLE.size, 0)
        last = _DURABLE.unpack(raw)[0] if len(raw) == _DURABLE.size else 0
        if files:
            first, path = files[-1]
            self._fd = io.open(path)
            data = io.read(self._fd, io.size(self._fd), 0)
            keep = data.rfind(b"\n") + 1  # a line torn by a crash is cut off
            lines = data[:keep].splitlines()
            last = max(last, int(json.loads(lines[-1])["seq"]) if lines else first - 1)
            io.truncate(self._fd, keep)
            io.fdatasync(self._fd)
            self._size = keep
        self._next = last + 1
        io.write(self._durable_fd, _DURABLE.pack(last), 0)

    def add(self, fields: dict[str, Any]) -> None:
        """Queue one rejection (``time_ms`` is added). Never blocks, never raises."""
        if len(self._queue) >= PENDING:
            self._dropped += 1
            return
        self._queue.append({"time_ms": int(time.time() * 1000), **fields})
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(FLUSH)  # lets a burst gather: one fdatasync for many lines
            batch = list(self._queue)
            self._queue.clear()
            dropped, self._dropped = self._dropped, 0
            try:
                await trio.to_thread.run_sync(self._write, batch, dropped)
            except OSError as e:
                self._dropped += dropped + len(batch)
                log.warning("rejections log %s: %s; %d rejections not kept", self.dir, e.strerror or e, len(batch))

    def _write(self, batch: list[dict[str, Any]], dropped: int) -> None:
        if not batch:
            self._dropped += dropped
            return
        half = max(1, self.max_bytes // 2)
        chunk = bytearray()
        for i, fields in enumerate(batch):
            seq = self._next + i
            line: dict[str, Any] = {"seq": seq, "id": format_rid(seq), "kind": "rejected", **fields}
            if i == 0 and dropped:
                line["dropped_before"] = dropped
            data = (json.dumps(line, sort_keys=True) + "\n").encode()
            if self._fd < 0 or self._size + len(chunk) >= half:  # a file ends at half the cap, even inside a batch
                self._sync(chunk)
                chunk = bytearray()
                self._rotate(seq)
            chunk += data
        self._sync(chunk)
        self._next += len(batch)
        self.io.write(self._durable_fd, _DURABLE.pack(self._next - 1), 0)

    def _sync(self, chunk: bytearray) -> None:
        if chunk and self._fd >= 0:
            self.io.write(self._fd, chunk, self._size)
            self.io.fdatasync(self._fd)
            self._size += len(chunk)

    def _rotate(self, first: int) -> None:
        if self._fd >= 0:
            self.io.close(self._fd)
        self._fd = self.io.open(os.path.join(self.dir, f"{first:012d}.jsonl"), create=True)
        self._size = 0
        self.io.fsync_dir(self.dir)
        for _, old in self._files()[:-2]:  # the newest two stay: the one closed at half the cap and this one
            self.io.unlink(old)


@attrs.frozen
class RejectionPage:
    """``events`` after the cursor, ``after`` the cursor to pass next (the last seq read), ``gap`` the seqs a
    reader lost to the byte cap (``lagged``)."""

    events: list[dict[str, Any]]
    after: int | None
    durable: int
    lagged: bool = False
    gap: tuple[int, int] | None = None


class RejectionReader:
    """Reads a shard's rejections (any process, no lock): durable lines only, oldest first."""

    def __init__(self, spool_dir: str) -> None:
        self.dir = os.path.join(spool_dir, DIRNAME)

    def read(self, after: int | None = None, limit: int = 1000, since_ms: int | None = None) -> RejectionPage:
        durable = _read_durable(self.dir)
        files = _files(self.dir)
        lagged, gap = False, None
        if files and after is not None and files[0][0] > after + 1:
            lagged, gap = True, (after + 1, files[0][0] - 1)
        events: list[dict[str, Any]] = []
        last = after
        for i, (first, path) in enumerate(files):
            if after is not None and i + 1 < len(files) and files[i + 1][0] <= after + 1:
                continue  # all of this file is at or before the cursor
            if first > durable:
                break
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:  # gone to the cap since the listing
                continue
            for raw in data.splitlines():
                if not raw.endswith(b"}"):
                    break  # a line still being written
                line = json.loads(raw)
                seq = int(line["seq"])
                if seq > durable:
                    break
                if after is not None and seq <= after:
                    continue
                last = seq
                if since_ms is None or int(line.get("time_ms", 0)) >= since_ms:
                    events.append(line)
                if len(events) >= limit:
                    return RejectionPage(events, last, durable, lagged, gap)
        return RejectionPage(events, last, durable, lagged, gap)
