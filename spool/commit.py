"""The trio layer: group commit, runner wake-ups, periodic checkpoints.

Group commit. Tasks append records at once (positions are assigned in the
event loop's thread) and then ``await commit()``. One committer task takes
everything pending, writes and fdatasyncs it in a worker thread, and wakes
every waiter whose records are now durable. While that fsync runs, more
appends pile up for the next one, so fsyncs per message fall as concurrency
rises: at 100 concurrent enqueues one fsync covers dozens of messages.

Written, not synced. A committer pass writes without fdatasync unless
someone waits for durability (``commit``): ``write_through`` (claims, before
delivery begins) and a big body's flush only need the bytes in the file,
where a killed process leaves them. The next sync covers them.

Lazy records. FINISH records, replacement envelopes and the marks of an
ended attempt need no fsync of their own (DESIGN §2), so ``finish`` does not
start a commit: they ride with the next commit someone waits for, or, if none
comes within ``lazy_commit_delay``, one lazy commit takes them. It still
fdatasyncs, because runners read only the durable part of the log (a
replacement envelope must become visible to its runner) and a garbage mark may
only be written once its START is durable; but at any load it finds the
records already taken by a commit that was needed anyway.

No polling. ``next_due`` sleeps until a commit or a finish changes something
or a runner's wake time comes; the runners themselves skip a pass that could
find nothing (``Runner.idle``). The checkpointer sleeps until something
changed, so an idle relay makes no system calls at all.

Bodies for delivery. ``read_body`` returns a ``StoredBody``: an iterable read
chunk by chunk as it is iterated (bounded memory, and again from the start on
a retry), served from the spool's body cache when the message was accepted a
moment ago. Iterated with ``async for``, big bodies are read in a worker
thread; small ones inline (one pread from the page cache is cheaper than the
thread hop).

Crash-only. An exception in the committer (a failed fsync above all) is not
handled: it ends the nursery and the process, and the next start recovers.

Resource handling: ``run()`` must be started in a nursery (``await
nursery.start(aspool.run)``); it owns the committer and checkpointer tasks.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import trio

from spool import admin
from spool.config import SpoolConfig
from spool.fileio import FileIO
from spool.record import HELD_CLASS, Outcome
from spool.spool import Attempt, BodyWriter, Spool

# Bodies up to this size are read in the event loop's thread (from the page cache: a few
# microseconds), bigger ones chunk by chunk in a worker thread.
INLINE_READ = 64 * 1024


class StoredBody:
    """A message's data for delivery: chunks read as they are iterated, any number of times.

    Why: a transport must be able to send a 50 MB message in bounded memory
    and to start over on a retry; and a body that is still in the spool's
    cache costs no read at all.
    """

    def __init__(self, core: Spool, attempt: Attempt) -> None:
        self._core = core
        self.positions = attempt.envelope.body
        self.size = attempt.envelope.body_size
        self._cached = core.cached_body(attempt.envelope)

    @property
    def cached(self) -> bool:
        return self._cached is not None

    def __iter__(self) -> Iterator[bytes]:
        """Blocking reads: for worker threads, or small bodies."""
        if self._cached is not None:
            return iter(self._cached)
        return (self._core.read_chunk(p) for p in self.positions)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._cached is not None:
            for chunk in self._cached:
                yield chunk
            return
        inline = self.size <= INLINE_READ
        for pos in self.positions:
            if inline:
                yield self._core.read_chunk(pos)
            else:
                yield await trio.to_thread.run_sync(self._core.read_chunk, pos)


class AsyncSpool:
    def __init__(self, core: Spool) -> None:
        self.core = core
        self._kick = trio.Event()
        self._synced = trio.Event()
        self._changed = trio.Event()
        self._lazy = trio.Event()
        self._moved = trio.Event()
        self._last_plan: Any = None
        self.batch_sizes: list[int] = []
        self.lazy_commits = 0
        self._want_sync = False  # someone waits for durability, not only for the bytes to be written
        self.checkpoint_passes = 0
        core.flush_hook = self._kick.set
        self._running = False

    @classmethod
    async def open(cls, path: str, config: SpoolConfig | None = None, io: FileIO | None = None) -> AsyncSpool:
        core = await trio.to_thread.run_sync(lambda: Spool.open(path, config, io))
        return cls(core)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._committer)
            nursery.start_soon(self._lazy_committer)
            nursery.start_soon(self._checkpointer)
            self._running = True
            task_status.started()

    # -- durability -----------------------------------------------------------

    async def _committer(self) -> None:
        writer = self.core.writer
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            self.core.flush_hook = self._kick.set
            while writer.has_chunks or (self._want_sync and (
                    writer.has_pending or writer.durable_end < writer.written_end)):
                before = writer.records
                sync, self._want_sync = self._want_sync, False
                batch = writer.take_batch(sync=sync)
                await trio.to_thread.run_sync(writer.write_batch, batch)
                self.batch_sizes.append(before)
                if len(self.batch_sizes) > 1024:
                    del self.batch_sizes[:512]
                synced, self._synced = self._synced, trio.Event()
                synced.set()
                self._signal_change()

    async def commit(self) -> None:
        """Return once everything appended before the call is durable."""
        writer = self.core.writer
        ticket = writer.head
        while writer.durable_end < ticket:
            self._want_sync = True
            self._kick.set()
            await self._synced.wait()

    async def write_through(self) -> None:
        """Return once everything appended before the call is written to the log's files, not synced.

        Written bytes survive the process being killed (they are in the
        kernel's page cache), not a power cut; the next commit makes them durable.
        """
        writer = self.core.writer
        ticket = writer.head
        while writer.written_end < ticket:
            self._kick.set()
            await self._synced.wait()

    async def _lazy_committer(self) -> None:
        """Commit what nobody waits for, unless a commit somebody waits for takes it first."""
        delay = self.core.config.lazy_commit_delay
        writer = self.core.writer
        while True:
            await self._lazy.wait()
            await trio.sleep(delay)
            self._lazy = trio.Event()
            if writer.has_pending or writer.durable_end < writer.written_end:
                self.lazy_commits += 1
                self._want_sync = True
                self._kick.set()

    def _signal_change(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()
        self._moved.set()

    # -- back-pressure ------------------------------------------------------------

    @property
    def unflushed_bytes(self) -> int:
        """Bytes appended (message data above all) that the committer has not yet written."""
        return self.core.writer.pending_bytes

    async def wait_flushed(self) -> None:
        """Return once the unwritten backlog is below ``flush_threshold`` (at once if it is).

        For a receiver: stop reading from a client that sends faster than the
        disk writes, instead of piling its message up in memory.
        """
        writer = self.core.writer
        limit = self.core.config.flush_threshold
        while writer.pending_bytes >= limit:
            self._kick.set()
            await self._synced.wait()

    # -- enqueue ----------------------------------------------------------------

    def begin_body(self) -> BodyWriter:
        return self.core.begin_body()

    async def enqueue(self, sender: str, recipients: Iterable[str], body: bytes | BodyWriter | Iterable[bytes], *,
                      extra: dict[str, Any] | None = None) -> int:
        """Append and wait for durability: the caller may answer 250 when this returns."""
        mid = self.core.enqueue(sender, recipients, body, extra=extra)
        await self.commit()
        return mid

    async def enqueue_many(self, messages: Iterable[tuple[str, Iterable[str], bytes]]) -> list[int]:
        ids = [self.core.enqueue(s, r, b) for s, r, b in messages]
        await self.commit()
        return ids

    # -- delivery ---------------------------------------------------------------

    async def next_due(self, limit: int | None = None) -> list[Attempt]:
        """Wait until something is due, then claim it (new and deferred mail alternately).

        Sleeps until a commit or a finish changes something, or until the
        earliest runner wake time; never on a polling timer.
        """
        core = self.core
        while True:
            changed = self._changed
            before = [r.pos for r in core.runners]
            attempts = core.poll_due(limit=limit)
            if [r.pos for r in core.runners] != before:
                self._moved.set()
            if attempts:
                # The STARTs reach the log's file before any delivery begins: then a killed
                # process leaves a record of every attempt that may have reached a remote, and
                # recovery can name its recipients as in doubt. A START needs no fsync of its own
                # (DESIGN §2): the DELIVERY commit that follows covers it. With sync_claims, a
                # power cut leaves them too, at one more fsync per batch of claims.
                if core.config.sync_claims:
                    await self.commit()
                else:
                    await self.write_through()
                return attempts
            wake = core.next_wake() if core.has_room else None
            if wake is None:
                await changed.wait()
                continue
            # The spool's clock is the wall clock, trio's is monotonic: a millisecond of margin so
            # as not to wake just before the record is due, and at most a minute between looks
            # in case the wall clock is set back.
            with trio.move_on_after(min(60.0, max(0.0, wake - core.config.clock()) + 0.001)):
                await changed.wait()

    async def record_delivery(self, attempt: Attempt, outcomes: Iterable[Outcome], duration_ms: int = 0) -> None:
        """Append the outcomes and wait until they are durable (before the message's next step)."""
        self.core.record_delivery(attempt, outcomes, duration_ms)
        await self.commit()

    def finish(self, attempt: Attempt, *, next_class: int | None = None,
               extra: dict[str, Any] | None = None) -> int | None:
        """End the attempt. No fsync of its own: recovery rebuilds a lost FINISH or replacement."""
        result = self.core.finish(attempt, next_class=next_class, extra=extra)
        self._lazy.set()  # the records ride with the next commit, or a lazy one soon
        self._signal_change()
        return result

    async def read_body(self, attempt: Attempt) -> StoredBody:
        """The body, read lazily as it is iterated (see StoredBody); nothing is read here."""
        return StoredBody(self.core, attempt)

    # -- admin ------------------------------------------------------------------

    async def find(self, message_id: int) -> admin.LiveMessage:
        return await trio.to_thread.run_sync(admin.find, self.core, message_id)

    async def hold(self, message_id: int) -> None:
        msg = await self.find(message_id)
        if msg.held:
            return
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_replace(attempt, klass=HELD_CLASS, held=True)
        await self.commit()

    async def release(self, message_id: int) -> None:
        msg = await self.find(message_id)
        if not msg.held:
            return
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_replace(attempt, klass=0, held=False)
        await self.commit()
        self._signal_change()

    async def delete(self, message_id: int) -> None:
        msg = await self.find(message_id)
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_delete(attempt)
        await self.commit()

    async def flush(self, message_id: int) -> None:
        """Make a deferred message due now (the new-mail runner takes it)."""
        msg = await self.find(message_id)
        if msg.held or msg.klass == 0:
            return
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_replace(attempt, klass=0, held=False)
        await self.commit()
        self._signal_change()

    # -- checkpoints ------------------------------------------------------------

    async def _checkpointer(self) -> None:
        """Every ``checkpoint_interval``, if anything moved since the last one; else sleep until it does."""
        interval = self.core.config.checkpoint_interval
        if not math.isfinite(interval):
            return
        while True:
            await trio.sleep(interval)
            self._moved = trio.Event()
            self.checkpoint_passes += 1
            await self.checkpoint()
            await self._moved.wait()

    async def checkpoint(self) -> list[int]:
        """Write restart positions (if they moved) and reclaim segments behind them."""
        plan = self.core.checkpoint_plan()
        key = (plan.checkpoint.head, plan.checkpoint.working_start, plan.checkpoint.runners)
        if key == self._last_plan:
            return []
        await self.commit()
        gone = await trio.to_thread.run_sync(self.core.checkpoint_write, plan)
        self._last_plan = key
        return gone
