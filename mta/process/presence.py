"""The relay's connected clients over all its shards: one page of counters that every shard process maps.

Theory of operation
-------------------
A shard's group commit lets delivery outcomes wait, within the ride bound
(2–50 ms), for the next enqueue commit while a client is connected, so that
they cost no fsync of their own (``spool.aio.group_commit.commit_riding``).
With several shards a client's next connection goes to any of them
(SO_REUSEPORT hashes each connection), so after a lone client's message the
shard that delivered it usually sees no client of its own and syncs the
outcomes alone: 1.99 fsyncs a message against 1.08 with one process
(docs/benchmarks.md, "Several processes"). Told that a client is connected
to the relay, the outcomes wait, and that client's next message in this
shard carries them.

The page. ``spool.dir/shards/sessions``: one 32-bit count per shard, each
written only by its own shard (on every session admitted and released) and
read by all: a sum of a few integers, no lock (an aligned 4-byte store is
seen whole). It is not state: nothing is fsynced, and a start writes its own
count as 0 (a crashed shard's stale count can only make another shard's
outcomes wait their bound, a few milliseconds, until it is restarted).

With one shard there is no page and nothing changes: the counts are the
server's own.
"""

from __future__ import annotations

import mmap
import os

from mta.config import Config
from mta.config.values import MAX_PROCESSES
from mta.inbound.admission import Refusal, SessionSlots, Slot
from mta.shards import SHARDS_DIR

__all__ = ["Presence", "SharedSlots", "presence_path"]

SLOT_BYTES = 4
PAGE_BYTES = SLOT_BYTES * MAX_PROCESSES


def presence_path(spool_dir: str, shard: int) -> str:
    """The page's path from a shard's own spool directory (shard 0's is the relay's ``spool.dir``)."""
    shards_dir = os.path.join(spool_dir, SHARDS_DIR) if shard == 0 else os.path.dirname(spool_dir)
    return os.path.join(shards_dir, "sessions")


class Presence:
    """This shard's view of the page: write its own count, read the sum."""

    def __init__(self, path: str, shard: int, shards: int) -> None:
        if not 0 <= shard < shards <= MAX_PROCESSES:
            raise ValueError(f"shard {shard} of {shards}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < PAGE_BYTES:
                os.ftruncate(fd, PAGE_BYTES)  # zeros; two shards doing this at once agree
            self._map = mmap.mmap(fd, PAGE_BYTES)
        finally:
            os.close(fd)
        self._counts = memoryview(self._map).cast("i")
        self.shard, self.shards = shard, shards
        self._counts[shard] = 0

    def publish(self, count: int) -> None:
        self._counts[self.shard] = count

    def total(self) -> int:
        """Clients connected to every shard; a stale negative slot (never written so) counts as none."""
        return sum(max(0, self._counts[k]) for k in range(self.shards))


class SharedSlots(SessionSlots):
    """The server's session counts, each change also published to the page (``Presence``)."""

    def __init__(self, config: Config, presence: Presence) -> None:
        super().__init__(config)
        self.presence = presence

    def admit(self, client_ip: str) -> Slot | Refusal:
        slot = super().admit(client_ip)
        if isinstance(slot, Slot):
            self.presence.publish(self.total)
        return slot

    def release(self, slot: Slot) -> None:
        super().release(slot)
        self.presence.publish(self.total)
