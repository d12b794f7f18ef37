"""When the group commit writes a batch in the event loop's thread instead of its worker thread.

Why a module of its own: the rule is a handful of measured conditions (a
lone client, a fast disk, a small batch in the current segment), each with
the figures that set it, apart from the committer's loop that asks it
(``spool.aio.group_commit``). ``InlineCommit`` is a base of ``GroupCommit``:
these methods read the commit's own state (its waiters, the recent syncs'
timings), declared here.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

from spool.engine.spool import Spool
from spool.write.log import Batch

# A lone committer may write and fdatasync in the event loop's thread (see InlineCommit._inline): while the median
# of the last INLINE_SYNC_SAMPLES sync batches' write + fdatasync took less than ``inline_sync_max`` seconds, for
# a batch of at most INLINE_MAX_BYTES that starts no segment, while at most one client is connected. Measured:
# with the deliveries in the relay's own thread a lone client was 3-22 % slower with it (a thread's fsync
# overlapped the deliveries' CPU work); with the zeroed room and the deliveries in a worker it is 6 % faster,
# and at 20 sessions it cost 5 % until it was kept to a lone client (docs/benchmarks.md, "Inline commit for a
# lone client").
# So the spool keeps it off (INLINE_SYNC_MAX) and a relay whose deliveries run in worker processes turns it on
# (``GroupCommit.inline_sync``).
INLINE_SYNC_FAST = 0.001
INLINE_SYNC_MAX = 0.0
INLINE_SYNC_SAMPLES = 5
INLINE_MAX_BYTES = 128 * 1024


class InlineCommit:
    """The inline rule and the writes it allows; the state is ``GroupCommit``'s (set in its ``__init__``)."""

    core: Spool
    _inline_sync_max: float
    connected_clients: Callable[[], int]
    inline_commits: int
    inline_writes: int
    _expected: int
    _message_tickets: list[int]
    _sync_seconds: deque[float]

    def _inline(self, batch: Batch, messages: int) -> bool:
        """Write and sync this batch in the event loop's thread? Only for a lone message on a fast disk.

        Why: handing a batch to a worker thread and waking the loop again when
        it is done costs a lone client ~0.13 ms a message, as much as a fast
        disk's fdatasync (docs/benchmarks.md). The loop does nothing
        else meanwhile, which costs nothing when nothing else waits to run:
        exactly one enqueue waits for durability (its sender waits for the
        250; deliveries' commits waiting beside it ride with its sync), no
        session has announced a commit coming (none is between its RCPT and
        its end of data), and the recent syncs were fast. Anything else keeps
        the thread, so that the next batch gathers while this one syncs (the
        fsyncs per message under concurrency do not change), and a slow or
        stalled disk never holds the loop. A sync the deliveries' commits
        (outcomes) ask for alone keeps it too: nobody waits on them, and
        inline they held the loop while the client's next command waited.
        Measured, a lone client was slower with it in every pair while the
        deliveries ran in the same thread; with them in a worker and the
        zeroed room it pays, for a lone client only (``connected_clients``;
        ``INLINE_SYNC_MAX``; docs/benchmarks.md). A small write-only batch
        (no fdatasync: a claim, FINISH records) goes inline under the same
        rule, since it waits for no disk.
        """
        if self._inline_sync_max <= 0 or batch.size > INLINE_MAX_BYTES or self.connected_clients() > 1:
            return False
        if not batch.sync:
            # Written, not synced (a delivery's claim, FINISH records): a write into the page cache, a few
            # microseconds, where the thread's hand-off cost the loop ~50 us of CPU a batch (futexes, the
            # wake-up, trio's thread machinery) while a lone client waits on that loop.
            return self._fast_disk() and all(off for _, off, _ in batch.chunks)
        if not messages or self._expected or not self._one_message_waiter():
            return False
        return self._fast_disk() and all(off for _, off, _ in batch.chunks)

    def _fast_disk(self) -> bool:
        """Were the recent sync batches' write + fdatasync quick (their median under ``_inline_sync_max``)?"""
        recent = self._sync_seconds
        # (A batch that starts a segment also syncs the ones before it and the directory: never inline.)
        return len(recent) >= INLINE_SYNC_SAMPLES and statistics.median(recent) < self._inline_sync_max

    def _one_message_waiter(self) -> bool:
        """Does exactly one enqueue wait for records not yet durable? (Those woken by the last sync may not have
        run yet: they no longer wait.) The deliveries' commits waiting beside it (an outcome, with at most one
        client connected) keep no client waiting: they ride with its sync (with them counted, a lone
        client's commit went to the thread for 6 messages in 10)."""
        durable, waiting = self.core.writer.durable_end, 0
        for ticket in self._message_tickets:
            if ticket > durable:
                waiting += 1
                if waiting > 1:
                    return False
        return waiting == 1

    def _write_inline(self, batch: Batch) -> bool:
        """Write ``batch`` here, unless another thread holds the log's files (then False: nothing written)."""
        start = time.perf_counter()
        if not self.core.writer.try_write_batch(batch):
            return False
        if batch.sync:
            self._sync_seconds.append(time.perf_counter() - start)
            self.inline_commits += 1
        else:
            self.inline_writes += 1
        return True

    def _write_timed(self, batch: Batch) -> None:
        """``write_batch`` in a worker thread, timing a sync batch for ``_inline``."""
        if self._inline_sync_max <= 0:  # off: nobody reads the timings
            self.core.writer.write_batch(batch)
            return
        start = time.perf_counter()
        self.core.writer.write_batch(batch)
        if batch.sync:
            self._sync_seconds.append(time.perf_counter() - start)
