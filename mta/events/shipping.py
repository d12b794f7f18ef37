"""The loop every shipper runs: read the stream after its cursor, cut batches, hand each to a sender, and
store the cursor only once the sender says the receiver acknowledged the batch.

A shipper is a process of its own (``mta events ship webhook|kafka``)
reading the spool's files like ``mta events``, so a receiver that is down
or slow costs the relay nothing but the disk its cursor pins (``[spool]
cursor_pin_max``). Batches go one at a time, in log order; a batch that
fails is sent again, whole, after a wait that doubles from 0.5 s to the
sender's ``retry_max``, and nothing after it is sent meanwhile. So every
event arrives at least once and one message's events arrive in order; after
a crash of the shipper, what followed the stored cursor is sent again with
the same ids, for the receiver to drop what it has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import attrs

from mta.bounce_class import Classifier
from mta.events.batching import Batch, Batcher
from mta.events.cursors import Cursors
from mta.events.source import event_dict
from spool import EventStream, format_pos

__all__ = ["POLL", "RETRY_FIRST", "Answer", "Sender", "Shipper"]

log = logging.getLogger("mta.events")

POLL = 0.2  # seconds between looks at the durable horizon when nothing is waiting
RETRY_FIRST = 0.5


@attrs.frozen
class Answer:
    """What became of one batch: ``ok`` only when the receiver acknowledged all of it."""

    ok: bool
    why: str


class Sender(Protocol):
    """Where a shipper sends: ``send`` blocks until the receiver acknowledged the whole batch or failed."""

    def send(self, batch: Batch, shard: int) -> Answer: ...


@attrs.define
class Shipper:
    """One shard's stream shipped through ``sender`` as consumer ``name``; ``where`` names the receiver in logs."""

    stream: EventStream
    cursors: Cursors
    name: str
    shard: int
    sender: Sender
    batcher: Batcher
    retry_max: float
    where: str
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    classes: Classifier | None = None

    def run(self) -> None:
        """Ship until the process ends."""
        stored = read_after = self.cursors.load(self.name, self.shard)
        log.info("shipping events of shard %d to %s as consumer %s, from %s", self.shard, self.where, self.name,
                 "the oldest record" if stored is None else format_pos(stored))
        batcher, clock = self.batcher, self.clock
        delay, idle_since = 0.0, clock()
        while True:
            moved = False
            if not batcher.full():
                got = self.stream.read(read_after, max_records=batcher.max_events)
                if got.lagged and got.gap is not None:
                    log.warning("consumer %s lags: the log no longer holds %s up to %s (past [spool] "
                                "cursor_pin_max, not archived); those events are lost to it", self.name,
                                format_pos(got.gap[0]), format_pos(got.gap[1]))
                batcher.add([event_dict(e, self.shard, self.classes) for e in got.events], clock())
                moved, read_after = got.after != read_after, got.after
            now = clock()
            if batcher.due(now):
                batch = batcher.take()
                answer = self.sender.send(batch, self.shard)
                if answer.ok:
                    self.cursors.store(self.name, self.shard, batch.cursor)
                    stored, delay, idle_since = batch.cursor, 0.0, now
                    batcher.acked(batch, clock())
                    continue
                delay = min(max(RETRY_FIRST, delay * 2), self.retry_max)
                log.warning("sending %d events (%s..) to %s failed: %s; again in %.1fs", len(batch.events),
                            batch.events[0]["id"], self.where, answer.why, delay)
                self.sleep(delay)
                continue
            if not batcher.waiting and read_after is not None and read_after != stored and \
                    now - idle_since >= batcher.max_age:
                # Caught up past records that make no event (STARTs, FINISHes): the cursor moves too, so it
                # pins no segment it has no need of.
                self.cursors.store(self.name, self.shard, read_after)
                stored, idle_since = read_after, now
            if not moved:
                self.sleep(min(POLL, batcher.wait(now)) if batcher.waiting else POLL)
