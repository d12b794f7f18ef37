"""A delivery worker's bodies: read by position from the spool's segment files, the relay's reads as the fallback.

Why. A body sent inline in the batch frame was held by both
processes while its batch was delivered: read (or taken from the spool's
cache) and encoded by the relay, decoded and kept by the worker; at 100 KB
and 100 sessions the relay tree's memory nearly doubled (176-217 MB PSS
against 110 MB before workers), and the relay's loop, the lone client's
bottleneck, spent its time on the copies. Now the batch frame carries each
stored body's positions (its DATA records, as its envelope lists them), and
the worker reads the records itself, one at a time as the transport sends
them, each read and checked against its checksum by the spool's own
``spool.format.segment.read_frame_at``, so neither process holds a body whole.

Damage stays the relay's. A record this worker cannot read (a checksum that
fails, a length past the file's end, not a DATA record, a segment missing or
unreadable) is not judged here: the worker logs one line and asks the relay
for the body from that chunk on (``read``/``chunk`` frames, as for a body
the relay cannot give by position). The relay reads through the spool, where
a damaged record is found, quarantined and named exactly as without workers,
and the scheduler sees it on ``StoredBody.damaged``; a record the relay
reads fine (its cached copy, say) is delivered.

Why the worker may read the files: a body is durable before its message's
``250`` and the runners hand out only what is durable, so every record a batch
names is in the file; a segment is deleted only once no message in flight
needs it (``spool/engine/reclaim.py``); and the files' bytes are what the relay's own
reads verify, by the same function.

Descriptors. The worker keeps one segment open, the newest it has read (most
bodies are in the segment being written); an older one is opened for the read
and closed after it. So a worker holds at most one segment file open, and a
deleted one only until it reads a body from a newer segment.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import trio

from mta.observe.logline import event
from spool import CorruptRecord, OsFileIO, RecordType, pos_offset, pos_segment, read_frame_at, segment_path

log = logging.getLogger("mta.worker")
# Bodies up to this size are read in the worker's loop (from the page cache); bigger ones in a thread.
INLINE_READ = 64 * 1024

_FILES = OsFileIO()
Pull = Callable[[int], Awaitable[bytes | None]]
"""``pull(k)``: chunk ``k`` of the body as the relay reads it (None after the last)."""


class SegmentReader:
    """DATA records by position from one spool's segment files, verified as the spool verifies them."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._open: tuple[int, int] | None = None  # (segment id, descriptor) of the newest segment read

    def read(self, pos: int, *, keep: bool = True) -> bytes:
        """The payload of the DATA record at ``pos``, read and verified by the spool's own ``read_frame_at``.

        ``keep``: may use and keep the descriptor of the newest segment (only the worker's loop may; a thread
        opens its own). Raises CorruptRecord (checksum, length, type) or OSError (a segment missing).
        """
        seg = pos_segment(pos)
        path = segment_path(self.log_dir, seg)
        fd, owned = self._descriptor(seg, keep)
        try:
            frame = read_frame_at(_FILES, fd, path, seg, pos_offset(pos))
        finally:
            if owned:
                os.close(fd)
        if frame.rtype != RecordType.DATA:
            raise CorruptRecord(f"a {RecordType(frame.rtype).name} record lies where message data should be",
                                path, pos_offset(pos))
        return frame.payload

    def _descriptor(self, seg: int, keep: bool) -> tuple[int, bool]:
        """A descriptor of segment ``seg``, and whether the caller closes it."""
        if keep and self._open is not None and self._open[0] == seg:
            return self._open[1], False
        fd = os.open(segment_path(self.log_dir, seg), os.O_RDONLY | os.O_CLOEXEC)
        if keep and (self._open is None or seg > self._open[0]):
            if self._open is not None:
                os.close(self._open[1])
            self._open = (seg, fd)
            return fd, False
        return fd, True

    def close(self) -> None:
        if self._open is not None:
            os.close(self._open[1])
            self._open = None


class SegmentBody:
    """A body this worker reads from the segment files as the transport sends it; again from the start on a retry.

    ``pull`` is the fallback: from the first chunk that cannot be read here, the relay reads the rest.
    """

    def __init__(self, reader: SegmentReader, qid: str, positions: Sequence[int], size: int, pull: Pull) -> None:
        self.reader = reader
        self.qid = qid
        self.positions = tuple(positions)
        self.size = size
        self.pull = pull

    def __iter__(self) -> Iterator[bytes]:
        raise TypeError("a body read by a delivery worker is read with async for")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        inline = self.size <= INLINE_READ
        for k, pos in enumerate(self.positions):
            try:
                if inline:
                    chunk = self.reader.read(pos)
                else:
                    chunk = await trio.to_thread.run_sync(functools.partial(self.reader.read, pos, keep=False))
            except (CorruptRecord, OSError) as exc:
                event(log, "body_read_fallback", self.qid, level=logging.WARNING, chunk=k,
                      error=f"{type(exc).__name__}: {exc}", action="the relay reads it")
                async for pulled in self._pulled(k):
                    yield pulled
                return
            yield chunk

    async def _pulled(self, k: int) -> AsyncIterator[bytes]:
        while True:
            chunk = await self.pull(k)
            if chunk is None:
                return
            yield chunk
            k += 1
