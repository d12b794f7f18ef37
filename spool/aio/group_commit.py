"""The trio layer's core: group commit, back-pressure, and waiting for room on a full disk.

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

Lazy records. FINISH records and replacement envelopes need no fsync of
their own (docs/design.md, "The log", durability rules), so ``finish`` does
not start a commit: they ride with the next commit someone waits for, or, if
none comes within ``lazy_commit_delay``, the lazy committer takes them. It
fdatasyncs only when a record among them must become durable soon: a
replacement envelope (runners read only the durable part of the log, so a
deferred message would otherwise wait for the next commit to be retried) or
a checkpoint that waits (``_ride_along``). FINISH records alone are written,
not synced: in the file they survive the process being killed, a power cut
that loses them costs recovery the rewriting of them from the durable
DELIVERY records before them, and nothing anybody was told depends on them.
The next commit anybody needs makes them durable. So a burst of mail ends
with no fsync for its last FINISH records, and a relay that takes a message
now and then pays two fsyncs a message (its enqueue, its outcomes), not three.

Crash-only. An exception in the committer (a failed fsync above all) is not
handled: it ends the nursery and the process, and the next start recovers.

No room. A batch whose write finds the disk full (ENOSPC, EDQUOT) is put back
and tried again with a growing delay (``SPACE_RETRY_MIN`` to
``SPACE_RETRY_MAX``) until it fits; meanwhile ``space_ok`` is False, every
waiter for durability (``commit``, ``write_through``, ``wait_flushed``) gets
DiskFull at once, and ``wait_for_space`` returns when a write succeeds again.
``enqueue`` cancels its message before re-raising, so the SMTP side answers
452 and the message is never delivered; the scheduler waits and commits again
(its records are still appended, at their positions). The spool's reserve
(``spool.write.reserve``), if a checkpoint gave it up, is allocated again by a task
that retries likewise (``_reserve_keeper``).

``GroupCommit`` holds the state of the whole trio layer; the other parts of
``spool.aio.async_spool.AsyncSpool`` build on it (``spool.aio.claims``,
``spool.aio.admin``, ``spool.aio.checkpointer``).
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import trio

from spool.aio.idle import wait_idle
from spool.aio.inline_commit import INLINE_MAX_BYTES, INLINE_SYNC_MAX, INLINE_SYNC_SAMPLES, InlineCommit
from spool.engine.spool import BodyWriter, Spool
from spool.errors import DiskFull

log = logging.getLogger("spool")
# After a write or a checkpoint found no room: the first retry after SPACE_RETRY_MIN seconds, then twice as
# long each time up to SPACE_RETRY_MAX (so mail is accepted again within that long of space returning).
SPACE_RETRY_MIN = 0.05
SPACE_RETRY_MAX = 2.0
CHECKPOINT_RETRY_MAX = 30.0
# Delivery outcomes wait for a commit somebody else needs (``commit_riding``) at most twice the recent interval
# between enqueue commits (a moving average), within RIDE_MIN..RIDE_MAX: the next enqueue commit then comes within
# the bound unless the pace changed. At 20 sessions that interval is ~10 ms (~26 ms under strace, where the fsyncs
# are counted; longer under load): a fixed 5 ms let a third of them run out and ask for a sync of their own, a fixed
# 25 ms a few in a run under load (docs/benchmarks.md, "Outcomes ride the next enqueue commit"). The cost
# of the wait: a crash in those milliseconds leaves the recipients in doubt, as it would a moment earlier, before
# the next hop's answer was known.
# With no commit to come (no client connected, nothing announced or appended, no other delivery out) outcomes are
# committed at once.
RIDE_MIN = 0.002
RIDE_MAX = 0.05
RIDE_GAP_WEIGHT = 0.25  # of the newest interval in the moving average


class GroupCommit(InlineCommit):
    """The committer and what waits on it, over one synchronous ``Spool`` (``core``)."""

    def __init__(self, core: Spool) -> None:
        self.core = core
        # The committer (this module).
        self._kick = trio.Event()
        self._synced = trio.Event()
        self._lazy = trio.Event()
        self.batch_sizes: list[int] = []
        # Told, after each commit that made new messages durable, how many (the relay's
        # logspool_commit_batch_messages). Called in the event loop; must not block.
        self.commit_observers: list[Callable[[int], None]] = []
        # Told the log's new durable end after each batch that moved it (a delivery worker writes its own mark
        # for an attempt whose START is durable: mta.delivery.workers). Called in the event loop; must not block.
        self.durable_observers: list[Callable[[int], None]] = []
        self._told_durable = 0
        self._unsynced_messages = 0  # enqueued since the last sync batch was taken
        self.lazy_commits = 0  # lazy batches that were synced (a replacement envelope, a checkpoint waited)
        self.lazy_writes = 0  # lazy batches only written: FINISH records that nothing waits to see durable
        self._lazy_sync = False  # a lazily appended record must be durable soon (see _lazy_committer)
        self._want_sync = False  # someone waits for durability, not only for the bytes to be written
        self._syncing_to = 0  # the log position the sync batch being written now makes durable (0: none)
        self._writing = 0  # bytes of the batch the committer's thread is writing now
        self._sync_tickets: list[int] = []  # what each task in commit() waits to see durable (its ticket)
        self._message_tickets: list[int] = []  # of those, the enqueues' (a sender waits for each: ``_inline``)
        self._sync_seconds: deque[float] = deque(maxlen=INLINE_SYNC_SAMPLES)  # the last sync batches' write+sync
        self._inline_sync_max = INLINE_SYNC_MAX  # off until the owner turns it on (``inline_sync``)
        # How many clients are connected now: the SMTP server's admitted sessions (``count_clients``); with more
        # than one, a session between its greeting and its RCPT (not announced by expect_commit) may be about to
        # need the loop.
        self.connected_clients: Callable[[], int] = lambda: 0
        self.inline_commits = 0  # sync batches written in the event loop's thread
        self.inline_writes = 0  # write-only batches written there (``_inline``)
        self.direct_commits = 0  # of the inline sync batches, those a lone enqueue wrote itself (``_commit_here``)
        self._committing = False  # the committer holds a batch it has taken and not yet written
        self.rides = 0  # commit_riding calls that waited for another commit (outcomes)
        self.rides_run_out = 0  # ...of which none came within the bound: committed on their own
        self.claiming = 0  # attempts claimed whose START records are being written (spool.aio.claims.next_due)
        self._enqueue_synced_at: float | None = None  # trio time of the last sync that made new messages durable
        self.enqueue_gap = RIDE_MAX / 2  # moving average of the intervals between such syncs (seconds)
        core.flush_hook = self._kick.set
        self._running = False
        self._expected = 0  # commits announced as coming (expect_commit) and not yet withdrawn
        self._announcing = False  # someone announces its commits: an unannounced wait is a lone one
        self._expect_round = 0
        self._expected_changed = trio.Event()
        # Wake-ups: something a runner may find changed (spool.aio.claims), or runners moved (the checkpointer).
        self._changed = trio.Event()
        self._moved = trio.Event()
        # Room on disk (this module).
        self._space = trio.Event()  # set (and replaced) whenever space_ok may have become True
        self._disk_state = trio.Event()  # set (and replaced) at every change of room and every checkpoint attempt
        self._full_since: float | None = None
        self._reserve_lost = trio.Event()
        self.space_failures = 0  # writes that found no room

    def inline_sync(self, max_seconds: float) -> None:
        """Let a lone commit write and fdatasync in the event loop's thread while the recent syncs took less than
        ``max_seconds`` (their median; 0: never). Why the caller decides: it pays only when the deliveries' CPU
        work is elsewhere (``spool.aio.inline_commit``), which the relay knows and the spool does not."""
        self._inline_sync_max = max_seconds

    def count_clients(self, connected: Callable[[], int]) -> None:
        """``connected()``: how many clients are connected now (the SMTP server's admitted sessions). The inline
        commit is for a lone client only, and the lazy committer waits while anyone may be about to commit."""
        self.connected_clients = connected

    @property
    def inline_sync_max(self) -> float:
        """The bound ``inline_sync`` set (0: the inline path is off)."""
        return self._inline_sync_max

    # -- room on disk -----------------------------------------------------------

    @property
    def space_ok(self) -> bool:
        """May new mail be taken? Not while a write waits for room, nor while the reserve is not whole."""
        return self.core.writer.full is None and self.core.reserve.held

    @property
    def disk_full(self) -> bool:
        """A write found no room and waits to be retried (deliveries pause; see ``wait_for_space``)."""
        return self.core.writer.full is not None

    def _raise_if_full(self) -> None:
        full = self.core.writer.full
        if full is not None:
            raise DiskFull(errno.ENOSPC, f"the spool's disk is full: {full}")

    async def wait_for_space(self) -> None:
        """Return once no write waits for room (at once if none does)."""
        while self.core.writer.full is not None:
            await self._space.wait()

    def _space_changed(self) -> None:
        event, self._space = self._space, trio.Event()
        event.set()
        self._disk_changed()

    def _disk_changed(self) -> None:
        event, self._disk_state = self._disk_state, trio.Event()
        event.set()

    async def disk_event(self) -> None:
        """Return at the next change of room on disk or checkpoint attempt.

        For whoever watches ``disk_full``, ``space_failures``,
        ``checkpoint_failures`` or ``checkpoint_state`` (tests, above all)
        without polling.
        """
        await self._disk_state.wait()

    async def _no_room(self, delay: float) -> float:
        """A write found no room: tell the waiters, say it once, wait ``delay``; returns the next delay."""
        self.space_failures += 1
        if self._full_since is None:
            self._full_since = trio.current_time()
            log.warning("%s: %s; new mail is refused and deliveries wait; %d bytes wait in memory, retried until "
                        "they fit", self.core.path, self.core.writer.full, self.core.writer.pending_bytes)
        synced, self._synced = self._synced, trio.Event()
        synced.set()  # every waiter sees writer.full and raises DiskFull
        self._disk_changed()
        await trio.sleep(delay)
        return min(delay * 2, SPACE_RETRY_MAX)

    def _room_again(self) -> None:
        """A write that had found no room (here, or in recovery before the relay ran) went through."""
        since = "" if self._full_since is None else f" after {trio.current_time() - self._full_since:.1f} s"
        mail = "mail is accepted" if self.core.reserve.held else \
            "mail is accepted once the spool's reserve is allocated again"
        log.warning("%s: room on disk again%s: the waiting records are written, %s", self.core.path, since, mail)
        self._full_since = None
        self._space_changed()  # the reserve keeper, if it waits to try again, tries now

    async def _reserve_keeper(self) -> None:
        """Allocate the reserve again whenever it is not whole (after a checkpoint used it, or at a full start)."""
        reserve = self.core.reserve
        while True:
            if reserve.held:
                await self._reserve_lost.wait()
                self._reserve_lost = trio.Event()
                continue
            delay = SPACE_RETRY_MIN
            while not await trio.to_thread.run_sync(reserve.ensure):
                # Again after a growing delay, or at once when room came back (a waiting write went through):
                # mail waits for the reserve, so it should not wait out the delay too.
                with trio.move_on_after(delay):
                    await self._space.wait()
                delay = min(delay * 2, SPACE_RETRY_MAX)
            mail = ", mail is accepted" if self.core.writer.full is None else ""
            log.info("%s: the spool's reserve is allocated again%s", self.core.path, mail)
            self._space_changed()

    # -- durability -----------------------------------------------------------

    async def _committer(self) -> None:
        writer = self.core.writer
        delay = SPACE_RETRY_MIN
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            self.core.flush_hook = self._kick.set
            while writer.has_chunks or (self._want_sync and (
                    writer.has_pending or writer.durable_end < writer.written_end)):
                if self._want_sync:
                    await self._gather()
                    if not (writer.has_chunks or self._want_sync):
                        continue  # a lone enqueue made the commit meanwhile (_commit_here): nothing is left
                before = writer.records
                sync, self._want_sync = self._want_sync, False
                if sync:
                    self._lazy_sync = False  # this sync covers every lazy record appended so far
                was_full = writer.full is not None
                if sync:
                    self._syncing_to = writer.head  # the batch takes everything appended: durable up to here
                batch = writer.take_batch(sync=sync)
                messages = 0
                if sync:  # a failed sync batch's messages are cancelled by their enqueue: they are not counted
                    messages, self._unsynced_messages = self._unsynced_messages, 0
                self._writing = batch.size
                self._committing = True
                try:
                    if not (self._inline(batch, messages) and self._write_inline(batch)):
                        await trio.to_thread.run_sync(self._write_timed, batch)
                except DiskFull:
                    writer.restore(batch)
                    self._want_sync = self._want_sync or sync
                    self._writing = 0
                    self._committing = False
                    delay = await self._no_room(delay)
                    continue
                finally:
                    self._writing = 0
                    self._syncing_to = 0
                    self._committing = False
                if was_full:
                    delay = SPACE_RETRY_MIN
                    self._room_again()
                # Written: its buffers go now. Kept until the next take (across the wake-ups and the room's
                # sync below), they were a batch in memory that no longer counted against the threshold.
                del batch
                self._batch_done(before, messages)
                if messages:
                    # The sessions whose messages are now durable answer 250 before the runners are woken:
                    # trio runs the tasks woken here in a batch of its choosing, and a runner's pass
                    # (reading the new envelopes, claiming them, starting their deliveries) would stand
                    # between a lone client and its reply. One step later it overlaps the client's next command.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                self._signal_change()
                if not writer.has_pending and writer.room_wanted():
                    # Nothing waits to be written: zero the room the next commits will write into, so that
                    # their fdatasync has no file size to commit (spool.write.room). Nobody waits for this sync.
                    await trio.to_thread.run_sync(writer.make_room)
            if not writer.has_pending and writer.room_wanted():  # after a lone enqueue's own commit (_commit_here)
                await trio.to_thread.run_sync(writer.make_room)

    def _batch_done(self, records_before: int, messages: int) -> None:
        """A batch is written (a sync batch: durable): count it, time the enqueues' pace, wake its waiters."""
        self.batch_sizes.append(records_before)
        if len(self.batch_sizes) > 1024:
            del self.batch_sizes[:512]
        if messages:
            self._enqueue_synced(messages)
        durable = self.core.writer.durable_end
        if durable != self._told_durable:
            self._told_durable = durable
            for observe in self.durable_observers:
                observe(durable)
        synced, self._synced = self._synced, trio.Event()
        synced.set()

    def _enqueue_synced(self, messages: int) -> None:
        """A sync made ``messages`` new messages durable: tell the observers, and time the pace (``ride_bound``)."""
        for observe in self.commit_observers:
            observe(messages)
        now = trio.current_time()
        if self._enqueue_synced_at is not None:
            gap = min(now - self._enqueue_synced_at, RIDE_MAX)  # a quiet spell counts as the longest wait, no more
            self.enqueue_gap += RIDE_GAP_WEIGHT * (gap - self.enqueue_gap)
        self._enqueue_synced_at = now

    def ride_bound(self) -> float:
        """How long an outcome waits for the next enqueue commit: twice their recent interval, RIDE_MIN..RIDE_MAX."""
        return min(RIDE_MAX, max(RIDE_MIN, 2 * self.enqueue_gap))

    def _commit_here(self) -> bool:
        """Write and fdatasync everything appended, now, in the calling enqueue (a lone client's); False: not
        done (nothing changed), the committer is to do it.

        Why: through the committer a lone client's commit costs two passes of
        the scheduler on its path (the committer woken, then the session
        woken by it), ~0.2 ms of a 1.2 ms transaction (docs/benchmarks.md,
        "A lone client's transaction"). Done here under the conditions of the committer's own
        inline path (``_inline``) and those where its window cuts at once
        (``_lone_message``): sessions announce their commits and none is
        announced, at most one client connected, no other enqueue waiting,
        the recent syncs fast, the batch small and in the current segment,
        the log's files not busy in another thread, and the committer not
        holding a batch it took (batches are written in the order they were
        taken). The waiters whose records this sync covers (a delivery's
        outcome) are woken as by the committer, and the runners told.
        A write that finds the disk full puts the batch back for the
        committer, whose retries and refusals then apply as ever.
        """
        writer = self.core.writer
        if (self._committing or self._inline_sync_max <= 0 or not self._lone_message()
                or writer.pending_bytes > INLINE_MAX_BYTES or writer.full is not None or writer.io_lock.locked()
                or self.connected_clients() > 1 or not self._fast_disk()):
            return False
        durable = writer.durable_end
        if any(t > durable for t in self._message_tickets):
            return False
        before = writer.records
        batch = writer.take_batch(sync=True)
        try:
            written = all(off for _, off, _ in batch.chunks) and self._write_inline(batch)
        except DiskFull:
            writer.restore(batch)
            self._want_sync = True
            self._kick.set()
            return False
        if not written:
            writer.restore(batch)
            return False
        self.direct_commits += 1
        messages, self._unsynced_messages = self._unsynced_messages, 0
        self._lazy_sync = False  # this sync covers every lazy record appended so far
        self._want_sync = False  # nothing is pending: every waiter's records are in this batch
        self._batch_done(before, messages)
        self._signal_change()
        if writer.room_wanted():
            self._kick.set()  # the committer makes the room (spool.write.room)
        return True

    async def _gather(self) -> None:
        """The group-commit window: wait for the commits announced as coming, then for an idle loop.

        Why: a commit cut the moment it is wanted carries one or two messages
        when each takes a millisecond or more of CPU to receive: the sessions
        whose data is arriving (announced with ``expect_commit``) and the
        deliveries already answered would each need an fsync of their own a
        moment later. So the committer waits until no announced commit is
        outstanding and no task can run (everything that could append has), or
        ``commit_delay`` at most. With nothing announced it returns once the
        loop is idle; or at once if a message waits and its caller announces
        commits (the relay's sessions do): nothing else is coming, a lone client.

        A session that keeps the window open until the bound (a slow client
        in the middle of its data) is not waited for again in the same
        transaction: its announcement is dropped (``_expect_round``).
        """
        delay = self.core.config.commit_delay
        if delay <= 0:
            return
        if self._lone_message():
            # A message waits and, where sessions announce their commits, no other is announced (no session
            # between an accepted RCPT and its end of data): a lone client. Cut now; what the other tasks
            # append meanwhile (outcomes, claims) goes with the next commit. Waiting for an idle loop put
            # the client behind the deliveries' CPU work, before its fsync instead of beside it
            # (docs/benchmarks.md). Callers that never announce keep the idle-loop rule.
            return
        writer, limit = self.core.writer, self.core.config.flush_threshold
        with trio.move_on_after(delay) as window:
            while self._expected > 0 and writer.pending_bytes < limit:
                await self._expected_changed.wait()
            if writer.pending_bytes < limit:  # else a session waits in wait_flushed: it cannot join
                # A lone client's message that arrives meanwhile is not kept waiting for the idle loop either.
                await wait_idle(self._lone_message)
        if window.cancelled_caught and self._expected > 0:
            self._expect_round += 1
            self._expected = 0

    def _lone_message(self) -> bool:
        """A message waits and, where sessions announce their commits, no other is announced: a lone client."""
        return self._announcing and self._expected == 0 and self._unsynced_messages > 0

    def expect_commit(self) -> int:
        """Announce a commit that is coming soon (a session in a mail transaction); withdraw it with the token.

        The group-commit window waits for announced commits, within
        ``commit_delay``, so that a message whose data is still arriving joins
        this fsync instead of needing the next one.
        """
        self._expected += 1
        self._announcing = True
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

    async def commit(self, *, message: bool = False) -> None:
        """Return once everything appended before the call is durable; ``message``: an enqueue's (``_inline``).

        Raises DiskFull while a write waits for room: the records stay appended
        and become durable when it fits (``wait_for_space``, then commit again).
        """
        writer = self.core.writer
        ticket = writer.head
        if writer.durable_end >= ticket or (message and self._commit_here()):
            return
        await self._commit_to(ticket, message=message)

    async def _commit_to(self, ticket: int, *, message: bool = False) -> None:
        """Return once the log up to ``ticket`` is durable, asking the committer for a sync until it is."""
        writer = self.core.writer
        if writer.durable_end >= ticket:
            return
        tickets = self._sync_tickets
        tickets.append(ticket)
        if message:
            self._message_tickets.append(ticket)
        try:
            while writer.durable_end < ticket:
                self._raise_if_full()
                if self._syncing_to < ticket:
                    # Not while a sync batch that covers the ticket is being written: woken by a pass before it
                    # (a write-only one), the ticket asked again for a sync that came after, for nobody
                    # (FINISH and START records only; docs/benchmarks.md, "Outcomes ride the next enqueue commit").
                    self._want_sync = True
                    self._kick.set()
                await self._synced.wait()
        finally:
            tickets.remove(ticket)
            if message:
                self._message_tickets.remove(ticket)

    async def commit_riding(self, upto: int | None = None, within: float | None = None, *,
                            more_coming: bool = False) -> None:
        """Return once the log up to ``upto`` (default: everything appended before the call) is durable;
        ride another commit if one comes soon.

        For delivery outcomes. Their rule is order (durable before the
        message's next step), not speed: nobody is waiting for a reply. With a
        delivery worker they come back after the enqueue commit they used to
        ride with, and a commit of their own was an fsync for a handful of
        records (docs/benchmarks.md, "Outcomes ride the next enqueue commit"). So while a
        commit somebody needs may come (a client is connected, a session has
        announced one, a message or a sync waits), they wait for it, at most
        ``within`` seconds (default ``ride_bound``: twice the recent interval
        between enqueue commits, at most RIDE_MAX); then, or at once on a relay
        where none can come, they ask for their own (``commit``).
        ``more_coming``: the caller knows of more such records on their way
        (other deliveries out), so that a burst's last outcomes share one
        commit; so are the outcomes of attempts being claimed now
        (``claiming``). Either way this returns only when they are durable,
        and raises DiskFull as ``commit`` does.
        """
        writer = self.core.writer
        ticket = writer.head if upto is None else upto
        if writer.durable_end >= ticket:
            return
        if within is None:
            within = self.ride_bound()
        if within > 0 and (more_coming or self.claiming or self._commit_may_come()):
            self.rides += 1
            with trio.move_on_after(within):
                while writer.durable_end < ticket:
                    self._raise_if_full()
                    await self._synced.wait()
            if writer.durable_end >= ticket:
                return
            self.rides_run_out += 1
        await self._commit_to(ticket)

    def _commit_may_come(self) -> bool:
        """Might somebody need a commit soon (so that a record in no hurry can wait to ride with it)?"""
        return bool(self._want_sync or self._unsynced_messages or self._expected or self.connected_clients() > 0)

    async def _ride_along(self) -> None:
        """Return once everything appended before the call is durable, without a sync of its own.

        For waiters that are in no hurry (the checkpoint): under load the next
        commit somebody needs covers it; otherwise the lazy commit does, within
        ``lazy_commit_delay``.
        """
        writer = self.core.writer
        ticket = writer.head
        while writer.durable_end < ticket:
            self._raise_if_full()
            self._lazy_sync = True
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
            self._raise_if_full()
            self._kick.set()
            await self._synced.wait()

    def lazy_needs_sync(self) -> None:
        """A record appended without a commit must become durable within ``lazy_commit_delay`` (not only written).

        For a replacement envelope: its runner reads only the durable log.
        """
        self._lazy_sync = True
        self._lazy.set()

    async def _lazy_committer(self) -> None:
        """Write (and, if a record needs it, sync) what nobody waits for, unless a commit somebody waits for
        takes it first.

        Why not always sync: a batch of FINISH records protects nothing anybody
        was told (docs/design.md, durability rules), and at the end of every
        burst, and after every message of a relay that takes one now and then,
        it was an fsync of its own. Written, it survives a killed process; the
        next commit somebody needs syncs it.
        """
        delay = self.core.config.lazy_commit_delay
        writer = self.core.writer
        while True:
            await self._lazy.wait()
            await trio.sleep(delay)
            self._lazy = trio.Event()
            if self._lazy_sync and (writer.has_pending or writer.durable_end < writer.written_end):
                self.lazy_commits += 1
                self._want_sync = True
                self._kick.set()
            elif writer.has_chunks:
                self.lazy_writes += 1
                self._kick.set()  # a pass that writes without fdatasync (nobody set _want_sync)

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
            self._raise_if_full()
            self._kick.set()
            self._wake_window()
            await self._synced.wait()

    # -- enqueue ----------------------------------------------------------------

    def begin_body(self, first: Callable[[int], bytes] | None = None) -> BodyWriter:
        """A body to stream into; ``first``: decide the message's id now (``spool.write.bodies.BodyWriter.begin``)."""
        return self.core.begin_body(first)

    async def enqueue(self, sender: str, recipients: Iterable[str], body: bytes | BodyWriter | Iterable[bytes], *,
                      extra: dict[str, Any] | None = None, held: bool = False) -> int:
        """Append and wait for durability: the caller may answer 250 when this returns.

        Raises DiskFull (the caller answers 452) with the message cancelled:
        it will not be delivered once the disk has room again.
        """
        msg = self.core.append_message(sender, recipients, body, extra=extra, held=held)
        self._unsynced_messages += 1
        try:
            await self.commit(message=True)
        except DiskFull:
            self.core.cancel(msg)
            raise
        return msg.message_id

    async def enqueue_many(self, messages: Iterable[tuple[str, Iterable[str], bytes]], *,
                           extras: Iterable[dict[str, Any] | None] | None = None) -> list[int]:
        """``enqueue`` for many messages and one commit; ``extras``: each message's extra map, in order.

        All or none: on DiskFull every message is cancelled (the caller answers that none was taken).
        """
        if extras is None:
            appended = [self.core.append_message(s, r, b) for s, r, b in messages]
        else:
            appended = [self.core.append_message(s, r, b, extra=x) for (s, r, b), x in zip(messages, extras,
                                                                                           strict=True)]
        self._unsynced_messages += len(appended)
        try:
            await self.commit(message=True)
        except DiskFull:
            for msg in appended:
                self.core.cancel(msg)
            raise
        return [m.message_id for m in appended]
