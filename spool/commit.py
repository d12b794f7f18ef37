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
from trio.testing import wait_all_tasks_blocked

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
        self._writing = 0  # bytes of the batch the committer's thread is writing now
        self.checkpoint_passes = 0
        core.flush_hook = self._kick.set
        self._running = False
        self._expected = 0  # commits announced as coming (expect_commit) and not yet withdrawn
        self._expect_round = 0
        self._expected_changed = trio.Event()

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
                if self._want_sync:
                    await self._gather()
                before = writer.records
                sync, self._want_sync = self._want_sync, False
                batch = writer.take_batch(sync=sync)
                self._writing = batch.size
                try:
                    await trio.to_thread.run_sync(writer.write_batch, batch)
                finally:
                    self._writing = 0
                self.batch_sizes.append(before)
                if len(self.batch_sizes) > 1024:
                    del self.batch_sizes[:512]
                synced, self._synced = self._synced, trio.Event()
                synced.set()
                self._signal_change()

    async def _gather(self) -> None:
        """The group-commit window: wait for the commits announced as coming, then for an idle loop.

        Why: a commit cut the moment it is wanted carries one or two messages
        when each takes a millisecond or more of CPU to receive: the sessions
        whose data is arriving (announced with ``expect_commit``) and the
        deliveries already answered would each need an fsync of their own a
        moment later. So the committer waits until no announced commit is
        outstanding and no task can run (everything that could append has), or
        ``commit_delay`` at most. With nothing announced and an idle loop (one
        session) it returns at once: one pass of the scheduler, not a delay.

        A session that keeps the window open until the bound (a slow client
        in the middle of its data) is not waited for again in the same
        transaction: its announcement is dropped (``_expect_round``).
        """
        delay = self.core.config.commit_delay
        if delay <= 0:
            return
        writer, limit = self.core.writer, self.core.config.flush_threshold
        with trio.move_on_after(delay) as window:
            while self._expected > 0 and writer.pending_bytes < limit:
                await self._expected_changed.wait()
            if writer.pending_bytes < limit:  # else a session waits in wait_flushed: it cannot join
                await wait_all_tasks_blocked()
        if window.cancelled_caught and self._expected > 0:
            self._expect_round += 1
            self._expected = 0

    def expect_commit(self) -> int:
        """Announce a commit that is coming soon (a session in a mail transaction); withdraw it with the token.

        The group-commit window waits for announced commits, within
        ``commit_delay``, so that a message whose data is still arriving joins
        this fsync instead of needing the next one.
        """
        self._expected += 1
        return self._expect_round

    def withdraw_commit(self, token: int) -> None:
        """The announced commit has arrived (its records are appended) or will not come (the transaction ended)."""
        if token != self._expect_round:
            return  # dropped when a window timed out waiting for it
        self._expected -= 1
        self._wake_window()

    def _wake_window(self) -> None:
        changed, self._expected_changed = self._expected_changed, trio.Event()
        changed.set()

    async def commit(self) -> None:
        """Return once everything appended before the call is durable."""
        writer = self.core.writer
        ticket = writer.head
        while writer.durable_end < ticket:
            self._want_sync = True
            self._kick.set()
            await self._synced.wait()

    async def _ride_along(self) -> None:
        """Return once everything appended before the call is durable, without a sync of its own.

        For waiters that are in no hurry (the checkpoint): under load the next
        commit somebody needs covers it; otherwise the lazy commit does, within
        ``lazy_commit_delay``.
        """
        writer = self.core.writer
        ticket = writer.head
        while writer.durable_end < ticket:
            self._lazy.set()
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
        """Bytes appended (message data above all) that are not yet written: pending, or being written now."""
        return self.core.writer.pending_bytes + self._writing

    async def wait_flushed(self) -> None:
        """Return once the unwritten backlog is below ``flush_threshold`` (at once if it is).

        For a receiver: stop reading from a client that sends faster than the
        disk writes, instead of piling its message up in memory. The backlog
        counts the batch being written too, so that the spool never holds more
        than about ``flush_threshold`` bytes of message data in memory; the
        core asks for a write at half of it, so appending and writing overlap.
        """
        limit = self.core.config.flush_threshold
        while self.unflushed_bytes >= limit:
            self._kick.set()
            self._wake_window()
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
        await self.record_deliveries([(attempt, outcomes, duration_ms)])

    def append_delivery(self, attempt: Attempt, outcomes: Iterable[Outcome], duration_ms: int = 0) -> None:
        """Append the outcomes and have them written soon, without waiting and without an fsync.

        For outcomes known before the rest of their batch: written, they survive
        the process being killed, so the message is not delivered again after a
        restart. They are durable only once a ``commit`` returns, which must come
        before the message's next step (the FINISH).
        """
        self.core.record_delivery(attempt, outcomes, duration_ms)
        self._kick.set()

    async def record_deliveries(self, results: Iterable[tuple[Attempt, Iterable[Outcome], int]]) -> None:
        """``record_delivery`` for several attempts (attempt, outcomes, duration in ms), under one commit.

        Why: the messages of one connection are answered together; a commit
        each would cost an fsync each, one after the other.
        """
        for attempt, outcomes, duration_ms in results:
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
        """Checkpoint when something moved and it is worth three fsyncs (``_checkpoint_due``); else sleep.

        Why not every ``checkpoint_interval`` under load: at 20 messages a
        second a checkpoint every 2 s alone cost 0.1 fsyncs per message, to
        save recovery the scan of a few hundred kilobytes.
        """
        config = self.core.config
        interval = config.checkpoint_interval
        if not math.isfinite(interval):
            return
        writer = self.core.writer
        last_bytes, last_time = writer.appended_bytes, trio.current_time()
        while True:
            seen = writer.appended_bytes
            await trio.sleep(interval)
            if not self._checkpoint_due(seen, last_bytes, last_time):
                continue
            self._moved = trio.Event()
            self.checkpoint_passes += 1
            last_bytes, last_time = writer.appended_bytes, trio.current_time()
            await self.checkpoint()
            await self._moved.wait()

    def _checkpoint_due(self, seen: int, last_bytes: int, last_time: float) -> bool:
        """Is a checkpoint due, one interval after the log had ``seen`` bytes appended?

        Yes when the relay is quiet: nothing appended during that interval, no
        delivery under way, no session in a mail transaction (the fsyncs compete
        with nothing, and a restart after a burst finds a fresh checkpoint; a
        stall in the middle of work is not quiet). Or when ``checkpoint_bytes``
        were appended since the last checkpoint (recovery's scan stays
        bounded), or when ``checkpoint_max_interval`` passed (a trickle).
        """
        config = self.core.config
        appended = self.core.writer.appended_bytes
        quiet = appended == seen and not self.core.attempts and self._expected == 0
        return (quiet or appended - last_bytes >= config.checkpoint_bytes
                or trio.current_time() - last_time >= config.checkpoint_max_interval)

    async def checkpoint(self) -> list[int]:
        """Write restart positions (if they moved) and reclaim segments behind them."""
        plan = self.core.checkpoint_plan()
        key = (plan.checkpoint.head, plan.checkpoint.working_start, plan.checkpoint.runners)
        if key == self._last_plan:
            return []
        await self._ride_along()
        gone = await trio.to_thread.run_sync(self.core.checkpoint_write, plan)
        self._last_plan = key
        return gone
