"""The trio layer's checkpoints: when to take one, and retrying one that failed.

The checkpointer sleeps until something changed, so an idle relay makes no
system calls at all; under load it checkpoints when it is worth its fsyncs
(``_checkpoint_due``). A checkpoint that fails (no room, or its temporary
file) is logged and retried with a growing delay: a stale checkpoint only
costs recovery a longer scan. What a checkpoint writes and deletes is the
synchronous spool's (``spool.engine.reclaim``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from spool.aio.group_commit import CHECKPOINT_RETRY_MAX, SPACE_RETRY_MIN, GroupCommit
from spool.engine.spool import Spool
from spool.errors import CheckpointFailed, DiskFull

log = logging.getLogger("spool")


class Checkpointer(GroupCommit):
    """Periodic checkpoints through the group commit."""

    def __init__(self, core: Spool) -> None:
        super().__init__(core)
        self._last_plan: Any = None  # the plan of the last checkpoint taken (``_checkpoint_due``)
        self.checkpoint_passes = 0
        self.checkpoint_failures = 0

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
        delay = SPACE_RETRY_MIN
        while True:
            seen = writer.appended_bytes
            await trio.sleep(interval)
            if not self._checkpoint_due(seen, last_bytes, last_time):
                continue
            self._moved = trio.Event()
            self.checkpoint_passes += 1
            last_bytes, last_time = writer.appended_bytes, trio.current_time()
            while not await self._try_checkpoint(delay):
                await trio.sleep(delay)
                delay = min(delay * 2, CHECKPOINT_RETRY_MAX)
            delay = SPACE_RETRY_MIN
            await self._moved.wait()

    async def _try_checkpoint(self, delay: float) -> bool:
        """``checkpoint``; a failure other than a failed fsync is logged (retried in ``delay``), never raised."""
        try:
            await self.checkpoint()
        except (DiskFull, CheckpointFailed) as exc:
            self.checkpoint_failures += 1
            log.warning("%s: checkpoint not written (%s); retrying in %.2g s (a stale checkpoint only costs "
                        "recovery a longer scan)", self.core.path, exc, delay)
            return False
        finally:
            if not self.core.reserve.held:
                self._reserve_lost.set()
            self._disk_changed()
        return True

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
        """Write restart positions (if they moved) and reclaim segments behind them.

        While records wait for room, the positions name only what is durable
        (``Spool.checkpoint_plan(durable_only=True)``): segments are reclaimed
        even then, and the reserve lets the checkpoint be written on a disk
        full to the last block; the space it frees lets the waiting records in.
        """
        full = self.disk_full
        plan = self.core.checkpoint_plan(durable_only=full)
        key = (plan.checkpoint.head, plan.checkpoint.working_start, plan.checkpoint.runners)
        if key == self._last_plan:
            return []
        if not full:
            await self._ride_along()
        gone = await trio.to_thread.run_sync(self.core.checkpoint_write, plan)
        self._last_plan = key
        return gone
