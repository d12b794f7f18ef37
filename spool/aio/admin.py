"""The trio layer's admin changes: hold, release, delete, flush by queue id, each durable on return.

The change itself is the synchronous spool's (``spool.engine.admin_changes``); here
the lookup runs in a worker thread. While the disk is full no change is begun
(DiskFull at once); a change made as the disk filled raises DiskFull saying
that it is made and will be written when there is room.
"""

from __future__ import annotations

import trio

from spool.aio.group_commit import GroupCommit
from spool.errors import DiskFull, SpoolError
from spool.format.record import HELD_CLASS
from spool.read import listing as admin


class AsyncAdmin(GroupCommit):
    """Admin changes through the group commit."""

    async def find(self, message_id: int) -> admin.LiveMessage:
        return await trio.to_thread.run_sync(admin.find, self.core, message_id)

    async def _find_for_change(self, message_id: int) -> admin.LiveMessage:
        """``find``, refused with DiskFull while the disk is full: then no admin change is even begun."""
        self._raise_if_full()
        msg = await self.find(message_id)
        self._raise_if_full()
        return msg

    async def _admin_commit(self) -> None:
        """Commit an admin change; if the disk filled meanwhile, say that the change waits for room."""
        try:
            await self.commit()
        except DiskFull as exc:
            raise DiskFull(exc.errno, f"{exc.strerror}; the change is made and will be written when there is "
                                      "room") from None

    async def hold(self, message_id: int) -> None:
        msg = await self._find_for_change(message_id)
        if msg.held:
            return
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_replace(attempt, klass=HELD_CLASS, held=True)
        await self._admin_commit()

    async def release(self, message_id: int) -> None:
        msg = await self._find_for_change(message_id)
        if not msg.held:
            return
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_replace(attempt, klass=0, held=False)
        await self._admin_commit()
        self._signal_change()

    async def delete(self, message_id: int) -> None:
        msg = await self._find_for_change(message_id)
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_delete(attempt)
        await self._admin_commit()

    async def change_batch(self, msgs: list[admin.LiveMessage], action: str) -> list[bool | str]:
        """A change to each listed message (``AdminChanges.apply_change``, no lookup), one commit for the batch.

        Each message's result: True (done), False (nothing to do) or the error
        that stopped it (busy, changed since it was listed). DiskFull before
        the batch begins, as for one change.
        """
        self._raise_if_full()
        results: list[bool | str] = []
        for msg in msgs:
            try:
                results.append(self.core.apply_change(msg, action))
            except (SpoolError, OSError) as exc:
                results.append(str(exc))
        if any(r is True for r in results):
            await self._admin_commit()
            if action in ("release", "flush"):
                self._signal_change()
        return results

    async def flush(self, message_id: int) -> None:
        """Make a deferred message due now (the new-mail runner takes it)."""
        msg = await self._find_for_change(message_id)
        if msg.held or msg.klass == 0:
            return
        attempt = self.core.claim_for_admin(msg.pos)
        self.core.admin_replace(attempt, klass=0, held=False)
        await self._admin_commit()
        self._signal_change()
