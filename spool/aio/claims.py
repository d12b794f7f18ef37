"""The trio layer's runners' side: waiting for due mail, recording outcomes, finishing, bodies for delivery.

No polling. ``next_due`` sleeps until a commit changes something, a finish
frees room under ``active_limit``, or a runner's wake time comes; the runners themselves skip a pass that could
find nothing (``Runner.idle``). The claims are written to the log's files
before any delivery begins (``_claims_written``), and a DELIVERY record is
durable before the message's next step (``record_delivery`` commits).

Bodies for delivery. ``read_body`` returns a ``StoredBody``: an iterable read
chunk by chunk as it is iterated (bounded memory, and again from the start on
a retry), served from the spool's body cache when the message was accepted a
moment ago. Iterated with ``async for``, big bodies are read in a worker
thread; small ones inline (one pread from the page cache is cheaper than the
thread hop). A chunk that cannot be read raises DamagedBody (quarantined and
named by then) and is remembered in ``StoredBody.damaged``, so the scheduler
knows which message of a batch it was.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import trio

from spool.aio.group_commit import GroupCommit
from spool.engine.spool import Attempt, Spool
from spool.errors import DamagedBody, DiskFull
from spool.format.record import Outcome, pos_segment

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
        self.start_pos = attempt.start_pos  # the attempt's START: what a delivery worker's mark names
        self.size = attempt.envelope.body_size
        self._cached = core.cached_body(attempt.envelope)
        self.damaged: DamagedBody | None = None  # set when a read found the data damaged

    @property
    def cached(self) -> bool:
        return self._cached is not None

    @property
    def log_dir(self) -> str:
        """Where the segment files holding ``positions`` are (a delivery worker reads them there)."""
        return self._core.log_dir

    @property
    def spool_path(self) -> str:
        """The spool's directory (a delivery worker writes its marks under it: ``spool.format.marks``)."""
        return self._core.path

    def _read(self, pos: int) -> bytes:
        try:
            return self._core.read_chunk(pos)
        except DamagedBody as exc:
            self.damaged = exc
            raise

    def __iter__(self) -> Iterator[bytes]:
        """Blocking reads: for worker threads, or small bodies."""
        if self._cached is not None:
            return iter(self._cached)
        return (self._read(p) for p in self.positions)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._cached is not None:
            for chunk in self._cached:
                yield chunk
            return
        inline = self.size <= INLINE_READ
        for pos in self.positions:
            if inline:
                yield self._read(pos)
            else:
                yield await trio.to_thread.run_sync(self._read, pos)


class AsyncClaims(GroupCommit):
    """Claims, outcomes and finishes through the group commit."""

    # The durable end at the last wake-up of ``next_due`` by a commit (-1: none yet).
    _wake_end: int = -1

    def _signal_change(self) -> None:
        """Wake ``next_due`` after a batch only when a runner could find something in it.

        Why: the committer signals after every batch, and at one message a
        connection most batches bring the runners nothing: the START written
        before a delivery, the DELIVERY commit, the FINISH written lazily. Each
        woke the feeder for a poll that found every runner idle (a task step of
        the event loop's, ~3 a message for 1). The runners read only the
        durable log, and only an ENVELOPE is work for them: so a batch wakes
        them only if it moved the durable end after an envelope was appended
        since the last wake-up (``SpoolCore.envelope_head``; conservative: an
        envelope appended but not yet durable wakes them once for nothing).
        Room freed under ``active_limit`` wakes them by ``finish``; admin
        changes append envelopes and commit, which wakes them here.
        Two more reasons wake them, for the space a pass frees rather than
        for claims: the durable end crossed into a new segment, and the disk
        is short of room. A segment is deleted only once every runner has
        passed it, so runners left asleep in front of bytes that hold no
        envelope (the body of a message refused at its end of data, garbage
        marks) would keep a full disk full.
        """
        core = self.core
        durable = core.writer.durable_end
        if durable == self._wake_end or (core.envelope_head < self._wake_end and self.space_ok
                                         and pos_segment(durable) == pos_segment(self._wake_end)):
            self._moved.set()  # the checkpointer still hears of every batch
            return
        self._wake_end = durable
        super()._signal_change()

    async def next_due(self, limit: int | None = None) -> list[Attempt]:
        """Wait until something is due, then claim it (new and deferred mail alternately).

        Sleeps until a commit or a finish changes something, or until the
        earliest runner wake time; never on a polling timer.
        """
        core = self.core
        while True:
            await self.wait_for_space()  # no claims while the disk is full: deliveries pause
            changed = self._changed
            before = [r.pos for r in core.runners]
            attempts = core.poll_due(limit=limit)
            if [r.pos for r in core.runners] != before:
                self._moved.set()
            if attempts:
                self.claiming = len(attempts)  # their outcomes are coming (commit_riding)
                try:
                    await self._claims_written()
                finally:
                    self.claiming = 0
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

    async def _claims_written(self) -> None:
        """The STARTs reach the log's file before any delivery begins.

        Then a killed process leaves a record of every attempt that may have
        reached a remote, and recovery can name its recipients as in doubt. A
        START needs no fsync of its own (docs/design.md, "The log", durability
        rules): the DELIVERY commit that follows covers it. With sync_claims, a
        power cut leaves them too, at one more fsync per batch of claims. When
        the disk is full the claims wait in memory, like the deliveries they
        start.
        """
        while True:
            try:
                if self.core.config.sync_claims:
                    await self.commit()
                else:
                    await self.write_through()
                return
            except DiskFull:
                await self.wait_for_space()

    async def record_delivery(self, attempt: Attempt, outcomes: Iterable[Outcome], duration_ms: int = 0) -> None:
        """Append the outcomes and wait until they are durable (before the message's next step)."""
        await self.record_deliveries([(attempt, outcomes, duration_ms)])

    def append_delivery(self, attempt: Attempt, outcomes: Iterable[Outcome], duration_ms: int = 0,
                        source: str = "") -> int:
        """Append the outcomes and have them written soon, without waiting and without an fsync.

        For outcomes known before the rest of their batch: written, they survive
        the process being killed, so the message is not delivered again after a
        restart. They are durable only once a ``commit`` returns, which must come
        before the message's next step (the FINISH). Returns the record's position.
        """
        pos = self.core.record_delivery(attempt, outcomes, duration_ms, source)
        self._kick.set()
        return pos

    async def pass_point_of_no_return(self, attempt: Attempt, recipients: Iterable[str]) -> None:
        """Make the attempt's point of no return for ``recipients`` durable; the caller then writes the final dot.

        A DELIVERY naming them in ``sending`` (``Claims.record_sending``),
        through the group commit: a plain ``commit``, not a riding one, since
        the next hop is waiting for the dot. After a crash, recovery holds in
        doubt exactly the recipients so named that have no outcome; a claim
        alone is due again (docs/design.md, "The point of no return").
        Raises DiskFull when the record cannot be made durable: the dot must
        not be sent (the batch is deferred; the record, written later, is
        followed by the deferral's outcomes).
        """
        self.core.record_sending(attempt, recipients)
        await self.commit()

    async def record_deliveries(self, results: Iterable[tuple[Attempt, Iterable[Outcome], int]]) -> None:
        """``record_delivery`` for several attempts (attempt, outcomes, duration in ms), under one commit.

        Why: the messages of one connection are answered together; a commit
        each would cost an fsync each, one after the other.
        """
        for attempt, outcomes, duration_ms in results:
            self.core.record_delivery(attempt, outcomes, duration_ms)
        await self.commit()

    def finish(self, attempt: Attempt, *, next_class: int | None = None,
               extra: dict[str, Any] | None = None, in_doubt: tuple[str, ...] = ()) -> int | None:
        """End the attempt. No fsync of its own: recovery rebuilds a lost FINISH or replacement.

        The records ride with the next commit. If none comes within
        ``lazy_commit_delay``, a replacement envelope is synced then (its
        runner reads only the durable log); a FINISH alone is only written.
        """
        was_full = not self.core.has_room
        result = self.core.finish(attempt, next_class=next_class, extra=extra, in_doubt=in_doubt)
        if result is not None:
            self.lazy_needs_sync()  # a replacement envelope: durable soon, so that its runner sees it
        else:
            self._lazy.set()  # a FINISH alone: written soon, durable with the next commit somebody needs
        if was_full:
            super()._signal_change()  # a claim waits for this room (next_due), whatever the log did
        else:
            # Nothing a claim waits for changed (its records become visible to the runners with the commit,
            # which signals): only the checkpointer is told. Waking next_due for nothing cost a task switch
            # and an empty poll per message.
            self._moved.set()
        return result

    async def read_body(self, attempt: Attempt) -> StoredBody:
        """The body, read lazily as it is iterated (see StoredBody); nothing is read here."""
        return StoredBody(self.core, attempt)
