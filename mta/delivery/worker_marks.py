"""A delivery worker's own points of no return: marks in its own file, synced together, no relay round trip.

Why. A worker may write a message's final dot only once a record that the
dot may go is durable (docs/design.md, "The point of no return"). Asked of
the relay (a ``dot`` frame, a ``sending`` DELIVERY through the log's group
commit, a ``dot_ok`` frame), every message waited for two frames through the
relay's busy loop and for its commit window: a fifth of the throughput at
100 sessions (docs/benchmarks.md, "The point of no return"). The worker's
own file (``spool.write.marks``) needs neither: a mark is appended and
fdatasynced here; the marks that arrive during one fdatasync share the
next, and a sync waits a moment (``GATHER_MAX``) for the worker's other
batches on their way to a dot. Recovery reads every worker's marks beside
the log's ``sending`` records, and the relay reads a dead worker's when it
fails its batches.

A mark names the attempt's START, so it is written only for an attempt whose
START the relay has said is durable (``durable`` frames): then recovery finds
the attempt the mark belongs to after any crash, a power cut included. An
attempt whose START is not yet durable (a lone message, claimed since the
last commit) asks the relay as before.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import trio

from spool import INLINE_SYNC_FAST, MarksWriter

# A sync runs in the worker's own thread while the median of the last SAMPLES took less than INLINE_SYNC_FAST:
# a thread's hand-off and wake-up cost the worker more CPU than a fast fdatasync blocks its loop, and on a
# 2-core machine that CPU is the relay's (docs/benchmarks.md, "The point of no return: its cost"). A slow disk
# sends it to a thread, where the marks that arrive during one sync share the next.
SAMPLES = 8
# How long a sync may wait for the marks of the worker's other batches that are on their way to a dot (``coming``).
# Under load the worker's dots come a fraction of a millisecond apart (median 0.2 ms at 20 sessions) while a fast
# disk's fdatasync blocks the loop for 0.25 ms, so without a wait nearly every mark had an fdatasync of its own
# (0.88 a message over the relay's tree; 0.41-0.52 with this wait, docs/benchmarks.md, "The point of no return:
# its cost"). The bound is what one dot may be held back: small against a next hop's round trips.
GATHER_MAX = 0.001


class WorkerMarks:
    """``MarksWriter``'s appends and fdatasyncs for the tasks of one trio loop: one sync at a time, the marks
    that came meanwhile in the next. Adds happen in the loop's thread only while no sync runs (a sync in a
    thread reads them there)."""

    def __init__(self, writer: MarksWriter, coming: Callable[[], int] = lambda: 0) -> None:
        self.writer = writer
        self.coming = coming  # batches that may ask for a mark soon (their next job is on its way to its dot)
        self._added = trio.Event()  # set when a mark is asked for
        self._waiting: list[tuple[int, tuple[str, ...]]] = []  # marks not yet handed to the writer
        self._asked = 0  # marks asked for
        self._synced = 0  # of those, durable
        self._syncing = False
        self._done = trio.Event()
        self._error: OSError | None = None
        self._failed_upto = 0  # marks covered by the sync that failed (their callers get the error)
        self._seconds: deque[float] = deque([1.0], maxlen=SAMPLES)  # the last syncs' times; the first in a thread
        self.syncs = 0

    async def mark(self, start_pos: int, recipients: Sequence[str]) -> None:
        """Return once the mark is durable; raises OSError when it could not be made so (the dot must not go)."""
        self._waiting.append((start_pos, tuple(recipients)))
        self._asked += 1
        added, self._added = self._added, trio.Event()
        added.set()
        ticket = self._asked
        while self._synced < ticket:
            if self._failed_upto >= ticket and self._error is not None:
                raise self._error
            if self._syncing:
                await self._done.wait()
                continue
            await self._sync()

    async def _sync(self) -> None:
        self._syncing = True
        upto = self._asked
        try:
            # One pass of the loop first: the connections whose replies came in the same wake-up reach their
            # dots in it, and their marks join this sync instead of waiting for the next.
            await trio.lowlevel.checkpoint()
            if self.coming() > 0:
                with trio.move_on_after(GATHER_MAX):
                    while self.coming() > 0:
                        await self._added.wait()
            upto = self._asked
            for start_pos, recipients in self._waiting:
                self.writer.add(start_pos, recipients)
            self._waiting = []
            if statistics.median(self._seconds) < INLINE_SYNC_FAST:
                self._seconds.append(self._timed_sync())
            else:
                self._seconds.append(await trio.to_thread.run_sync(self._timed_sync))
            self._synced = upto
            self.syncs += 1
        except OSError as exc:
            self._error, self._failed_upto = exc, upto
            raise
        finally:
            self._syncing = False
            done, self._done = self._done, trio.Event()
            done.set()

    def _timed_sync(self) -> float:
        """The writer's sync; returns how long its write and fdatasync took (not a thread's hand-off)."""
        t0 = time.perf_counter()
        self.writer.sync()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.writer.close()
