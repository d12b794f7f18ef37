"""The trio layer: group commit, runner wake-ups, periodic checkpoints.

Group commit. Tasks append records at once (positions are assigned in the
event loop's thread) and then ``await commit()``. One committer task takes
everything pending, writes and fdatasyncs it in a worker thread, and wakes
every waiter whose records are now durable. While that fsync runs, more
appends pile up for the next one, so fsyncs per message fall as concurrency
rises: at 100 concurrent enqueues one fsync covers dozens of messages.

Crash-only. An exception in the committer (a failed fsync above all) is not
handled: it ends the nursery and the process, and the next start recovers.

Resource handling: ``run()`` must be started in a nursery (``await
nursery.start(aspool.run)``); it owns the committer and checkpointer tasks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import trio

from spool import admin
from spool.config import SpoolConfig
from spool.fileio import FileIO
from spool.record import HELD_CLASS, Outcome
from spool.spool import Attempt, BodyWriter, Spool


class AsyncSpool:
    def __init__(self, core: Spool) -> None:
        self.core = core
        self._kick = trio.Event()
        self._synced = trio.Event()
        self._changed = trio.Event()
        self._last_plan: Any = None
        self.batch_sizes: list[int] = []
        core.flush_hook = self._kick.set
        self._running = False

    @classmethod
    async def open(cls, path: str, config: SpoolConfig | None = None, io: FileIO | None = None) -> AsyncSpool:
        core = await trio.to_thread.run_sync(lambda: Spool.open(path, config, io))
        return cls(core)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._committer)
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
            while writer.has_pending:
                before = writer.records
                batch = writer.take_batch()
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
        while writer.durable_end < ticket or (writer.has_pending and writer.durable_end < ticket):
            self._kick.set()
            await self._synced.wait()

    def _signal_change(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

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
        """Wait until something is due, then claim it (new and deferred mail alternately)."""
        while True:
            attempts = self.core.poll_due(limit=limit)
            if attempts:
                # The STARTs reach the disk before any delivery begins: then a crash, even a
                # power cut, leaves a record of every attempt that may have reached a remote,
                # and recovery can name its recipients as in doubt. One commit per batch of claims.
                await self.commit()
                return attempts
            wake = self.core.next_wake()
            now = self.core.config.clock()
            timeout = 1.0 if wake is None else min(1.0, max(0.01, wake - now))
            changed = self._changed
            with trio.move_on_after(timeout):
                await changed.wait()

    async def record_delivery(self, attempt: Attempt, outcomes: Iterable[Outcome], duration_ms: int = 0) -> None:
        """Append the outcomes and wait until they are durable (before the message's next step)."""
        self.core.record_delivery(attempt, outcomes, duration_ms)
        await self.commit()

    def finish(self, attempt: Attempt, *, next_class: int | None = None,
               extra: dict[str, Any] | None = None) -> int | None:
        """End the attempt. No fsync of its own: recovery rebuilds a lost FINISH or replacement."""
        result = self.core.finish(attempt, next_class=next_class, extra=extra)
        self._kick.set()  # let the marks and records reach the disk soon, without anyone waiting
        self._signal_change()
        return result

    async def read_body(self, attempt: Attempt) -> list[bytes]:
        return await trio.to_thread.run_sync(lambda: list(self.core.read_body(attempt.envelope)))

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
        interval = self.core.config.checkpoint_interval
        while True:
            await trio.sleep(interval if math.isfinite(interval) else 3600)
            await self.checkpoint()

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
