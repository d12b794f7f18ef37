"""The trio layer: ``AsyncSpool``, the synchronous spool under group commit, for the relay.

One ``AsyncSpool`` wraps one ``spool.engine.spool.Spool`` (``core``) and runs its
I/O off the event loop. It is made of parts, one module each, all built on
``GroupCommit``:

- ``spool.aio.group_commit``: the committer (group commit, written-not-synced
  batches, lazy records), back-pressure, enqueue, and waiting for room on a
  full disk;
- ``spool.aio.claims``: ``next_due``, recording outcomes, ``finish``, and
  bodies for delivery (``StoredBody``);
- ``spool.aio.admin``: hold, release, delete, flush;
- ``spool.aio.checkpointer``: periodic checkpoints, retried when they fail.

Resource handling: ``run()`` must be started in a nursery (``await
nursery.start(aspool.run)``); it owns the committer, lazy-committer,
checkpointer and reserve-keeper tasks.
"""

from __future__ import annotations

import trio

from spool.aio.admin import AsyncAdmin
from spool.aio.checkpointer import Checkpointer
from spool.aio.claims import INLINE_READ, AsyncClaims, StoredBody
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.fileio import FileIO

__all__ = ["INLINE_READ", "AsyncSpool", "StoredBody"]


class AsyncSpool(AsyncClaims, AsyncAdmin, Checkpointer):
    """The relay's spool: the synchronous ``Spool`` with group commit, wake-ups and checkpoints."""

    @classmethod
    async def open(cls, path: str, config: SpoolConfig | None = None, io: FileIO | None = None) -> AsyncSpool:
        core = await trio.to_thread.run_sync(lambda: Spool.open(path, config, io))
        return cls(core)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._committer)
            nursery.start_soon(self._lazy_committer)
            nursery.start_soon(self._checkpointer)
            nursery.start_soon(self._reserve_keeper)
            self._running = True
            if self.core.writer.full is not None:  # recovery's records found no room: try until they fit
                self._want_sync = True
                self._kick.set()
            task_status.started()
