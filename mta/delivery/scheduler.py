"""The delivery scheduler: one subscriber to the spool's runners, a bounded pool of workers.

Theory of operation. A feeder task takes due messages from the spool (new and
deferred alternately, the spool's own fairness) only while fewer than
``max_pending`` jobs wait, so memory is bounded by the pool, not the queue.
Each message's recipients are grouped by destination (transport + next hop);
each group is a *job* in that destination's queue. Workers (``concurrency``
of them, never one per message) pick the destination whose oldest job is
oldest among those below their per-destination limit, and take up to
``max_messages_per_connection`` jobs for it at once, so one SMTP connection
carries several messages.

Wake-ups. Idle workers park in one ``ParkingLot``. New work unparks one
worker, and only if no other is already on its way; a worker that takes a
batch and sees more work it could take wakes the next one. So a dispatch
costs one task switch, not one per idle worker, and a burst of work fans out
to as many workers as it can use. A worker that ends a batch looks for more
itself before it parks.

Outcomes. For each job the worker appends its outcomes as a DELIVERY record
and waits for the commit: the outcome is durable before the message's next
step. The commit is the next one somebody needs if it comes soon (an
enqueue's, while clients are connected: within twice the recent interval
between enqueue commits, at most 50 ms), else its own. A
bounce (DSN) is enqueued in the same commit as the DELIVERY that reports it,
so a crash can lose neither without the other. When every job of a message
is done, ``finish`` writes the replacement envelope (remaining recipients,
next class) with no fsync of its own.

A full disk. A DELIVERY record that cannot be written (DiskFull) stays
appended at its position; the worker waits for the spool to have room and
commits again, and only then finishes the message: the outcome is durable
before the next step, as always. Meanwhile workers start no new delivery and
the feeder claims nothing (``AsyncSpool.next_due`` waits too), so the
scheduler pauses and resumes by itself. A crash while it waits makes the
recipients in doubt: a remote's 250 not yet recorded may be delivered again,
the known duplicate window.

A damaged body. A message whose data the spool cannot read back (a DATA
record that fails its checksum, a segment gone: the spool has quarantined
and named it by then, ``spool.damage.policy``) is bounced to its sender with
the reason (``5.3.0``), or held for the administrator with
``delivery.on_damaged_body = "hold"``; never retried as if the next attempt
could read it, and never the relay's end. Found while a batch is being sent
(``StoredBody.damaged``), the jobs of the batch the transport had not reached
go back to their destination's queue untried; found
when the body was copied forward on a deferral (the envelope's
``damaged_body``), the message goes straight to its fate.

Dead destinations. When every recipient of a batch failed to even connect,
the destination is backed off (doubling from 2 s up to 5 min); while it is,
its jobs are deferred at once without a connection attempt, as Postfix's
qmgr does with a dead site.

Suspended providers. A destination whose provider a shaping rule has
suspended has its jobs deferred at once, without a connection (no reply code,
so no rule counts them); the message goes into the retry class that brings it
back at the first runner pass after the suspension's end (``retry_class``).

Egress. When ``[egress]`` names a pool (or an address) for a recipient's
route or the message's sender, the message's group for that destination is
given one address of the pool as it is dispatched (``mta.delivery.egress``):
the address is part of the destination, so its queue, its connections and
its backoff are its own. A pool with no room today defers the recipients at
once, like a routing failure, without a connection. A message whose
egress a shaping provider may name first waits (a task of its own) for its
``mx`` domains' MX lookups (``Egress.lookups_wanted``), the same lookups
their shapes wait for; it counts against ``max_pending`` meanwhile, so a
slow DNS server holds the feeder back.

Containment. An unexpected exception while one message or batch is routed,
read, handed to its transport, or while its bounce is built, defers those
messages only: each gets a DEFERRED outcome whose reply says ``local error:``
and why (recorded like any other), with one log line and its traceback; the
workers, the feeder and the relay go on. A spool failure that must end the
process (``mta.containment.is_fatal``) is re-raised, never contained. The
spool bookkeeping around it (appending outcomes, committing, finishing) is
shared state, where a bug ends the process.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs
import trio

from mta.bounce_class import classifier_for
from mta.config import Config, NoRoute
from mta.containment import is_fatal, local_error
from mta.delivery import dsn as dsnmod
from mta.delivery import dsn_notify
from mta.delivery.egress import AllCapped, Egress
from mta.delivery.retry_class import class_after_suspension
from mta.delivery.routing import destination_for
from mta.delivery.scheduler_state import DestState, Tracker, last_error, lifetime_text
from mta.delivery.transport import Destination, Job, Transport, TransportLost, passes_dot
from mta.observe.logline import FieldValue, event
from mta.observe.metrics import Metrics
from mta.shaping.gate import Shaper, require_tls
from mta.smtp import dsn_params
from spool import (
    DAMAGED_BODY,
    HELD_CLASS,
    AsyncSpool,
    Attempt,
    DamagedBody,
    DiskFull,
    Envelope,
    Outcome,
    Status,
    StoredBody,
)

log = logging.getLogger("mta.delivery")

BACKOFF_MIN = 2.0
BACKOFF_MAX = 300.0
# An outcome as the delivery line says it (Postfix's words).
STATUS_WORDS = {Status.DELIVERED: "sent", Status.DEFERRED: "deferred", Status.BOUNCED: "bounced",
                Status.EXPIRED: "expired", Status.DELETED: "deleted"}


class Scheduler:
    def __init__(self, aspool: AsyncSpool, config: Config, transports: Mapping[str, Transport],
                 metrics: Metrics, clock: trio.abc.Clock | None = None, shaper: Shaper | None = None) -> None:
        self.aspool = aspool
        self.config = config
        self.transports = transports
        self.metrics = metrics
        self.shaper = shaper  # [shaping]: per-provider limits and adaptive rules (mta.shaping); None: off
        self.dests: dict[Destination, DestState] = {}
        self.pending = 0
        d = config.delivery
        self.concurrency = d.concurrency
        self.per_destination = d.per_destination
        self.batch = max(1, d.max_messages_per_connection)
        self.max_pending = max(4 * self.concurrency, 64)
        self._idle = trio.lowlevel.ParkingLot()
        self._waking = 0  # workers unparked that have not yet looked for work
        self._room = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._lookups: dict[str, trio.Event] = {}  # domain -> set once the shaper's MX lookup of it is done
        self.waiting_lookup = 0  # messages claimed that wait for a lookup before they are dispatched
        # Called with (queue id, outcome) once an outcome is durable: the delivery
        # log and metrics are two readers; tests wait on it instead of sleeping.
        self.observers: list[Callable[[str, Outcome], None]] = []
        self._riding = 0  # batches whose outcomes wait in _commit_outcomes to ride another commit
        bc = config.bounce_classes
        self.classes = classifier_for(bc.rules_file, bc.defaults)  # each outcome's class, in its delivery line
        self.egress = Egress(config.egress, shaper=shaper)  # the source addresses chosen, and each one's messages today
        self.in_flight = 0  # messages claimed and not yet finished (their FINISH or replacement appended)
        self.delivered = 0  # messages finished since the start (a drain's count at exit)
        self.draining = False

    def drain(self) -> None:
        """A planned stop: claim nothing more; what is claimed is delivered (``in_flight`` falls to 0).

        A claim already under way (``AsyncSpool.claiming``) is dispatched, then the feeder ends.
        """
        self.draining = True

    def idle(self) -> bool:
        """Nothing claimed that is not finished, and no claim under way."""
        return self.in_flight == 0 and not self.aspool.claiming

    def _finish(self, tracker: Tracker, extra: dict[str, Any] | None = None, next_class: int | None = None,
                in_doubt: tuple[str, ...] = ()) -> None:
        self.aspool.finish(tracker.attempt, extra=extra, next_class=next_class, in_doubt=in_doubt)
        self.in_flight -= 1
        self.delivered += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.egress.active and any(s.warmup for s in self.config.egress.sources):
            counted = await trio.to_thread.run_sync(self.egress.rebuild, self.config.spool.dir)
            event(log, "egress_counts", None, records=counted,
                  counts=",".join(f"{a}={n}" for a, n in sorted(self.egress.counts.items())) or None)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self.concurrency):
                nursery.start_soon(self._worker)
            nursery.start_soon(self._feeder)
            if self.shaper is not None:
                nursery.start_soon(self._shaping_clock, self.shaper)
            task_status.started()

    # -- feeding ------------------------------------------------------------

    async def _feeder(self) -> None:
        while not self.draining:
            room = self.max_pending - self.pending - self.waiting_lookup
            if room <= 0:
                await self._room.wait()
                continue
            for attempt in await self.aspool.next_due(limit=min(room, 256)):
                self._dispatch(attempt)

    def _dispatch(self, attempt: Attempt) -> None:
        assert self._nursery is not None
        tracker = Tracker(attempt)
        self.in_flight += 1
        env = attempt.envelope
        if attempt.expired:
            self._nursery.start_soon(self._expire, tracker)
            return
        damaged = env.extra.get(DAMAGED_BODY)
        if damaged:
            self._nursery.start_soon(self._damaged, tracker, str(damaged))
            return
        domains = self._lookups_wanted(attempt)
        if domains:
            self.waiting_lookup += 1
            self._nursery.start_soon(self._dispatch_after, tracker, domains)
            return
        self._route(tracker)

    def _lookups_wanted(self, attempt: Attempt) -> list[str]:
        """The domains of the message's ``mx`` recipients that must be looked up before its egress is chosen."""
        if self.shaper is None or not self.egress.section.providers:
            return []
        env, mx = attempt.envelope, []
        for rcpt in attempt.remaining:
            if not self.egress.section.needs_provider(env.sender, rcpt.rpartition("@")[2].lower()):
                continue  # a sender or route rule decides: no route to look at
            try:
                dest = destination_for(self.config, rcpt, env.extra.get("filter"))
            except Exception as exc:
                if is_fatal(exc, self.aspool.core):
                    raise
                continue  # _route meets the same failure and defers the recipient with its reason
            if isinstance(dest, Destination) and dest.kind == "mx":
                mx.append(dest.target)
        return self.egress.lookups_wanted(env.sender, mx)

    async def _dispatch_after(self, tracker: Tracker, domains: list[str]) -> None:
        """Dispatch the message once the MX lookups of ``domains`` are done (each shared with its shape's)."""
        assert self.shaper is not None
        try:
            events = [self._lookup(domain, self.shaper) for domain in domains]
            for done in events:
                await done.wait()
        finally:
            self.waiting_lookup -= 1
            self._make_room()
        self._route(tracker)

    def _route(self, tracker: Tracker) -> None:
        """Group the message's recipients by destination (each marked with its egress) and queue each group."""
        assert self._nursery is not None
        attempt = tracker.attempt
        env = attempt.envelope
        groups: dict[Destination, list[str]] = {}
        unroutable: list[str] = []
        failed: list[Outcome] = []  # routing raised: deferred, with the reason
        qid = self.aspool.core.queue_id(env.message_id)
        for rcpt in attempt.remaining:
            try:
                dest = self.egress.mark(env.sender, rcpt, destination_for(self.config, rcpt, env.extra.get("filter")))
            except Exception as exc:
                if is_fatal(exc, self.aspool.core):
                    raise
                event(log, "routing_error", qid, level=logging.ERROR, exc_info=exc, to=f"<{rcpt}>",
                      error=local_error(exc), status="deferred")
                failed.append(Outcome(rcpt, Status.DEFERRED, 0, "4.3.0", f"{local_error(exc)} (routing)", ""))
                continue
            if isinstance(dest, NoRoute):
                unroutable.append(rcpt)
            elif isinstance(dest, AllCapped):
                failed.append(Outcome(rcpt, Status.DEFERRED, 0, "4.4.5", dest.text, ""))
            else:
                groups.setdefault(dest, []).append(rcpt)
        groups = self.egress.choose_sources(groups, failed)
        tracker.outstanding = len(groups) + (1 if unroutable else 0) + (1 if failed else 0)
        if unroutable:
            outs = [Outcome(r, Status.BOUNCED, 550, "5.1.2", "no route to this domain", "") for r in unroutable]
            self._nursery.start_soon(self._complete, tracker, Job(qid, env.sender, tuple(unroutable), (), 0), outs)
        if failed:
            job = Job(qid, env.sender, tuple(o.recipient for o in failed), (), 0)
            self._nursery.start_soon(self._complete, tracker, job, failed)
        if not groups and not unroutable and not failed:
            self._nursery.start_soon(self._finish_only, tracker)
        for dest, rcpts in groups.items():
            job = Job(qid, env.sender, tuple(rcpts), (), env.body_size, dict(env.extra), dest.source)
            state = self.dests.setdefault(dest, DestState())
            state.queue.append((job, tracker))
            self.pending += 1
            if self.shaper is not None and state.shape is None and dest.kind == "mx":
                self._shape(dest, state, self.shaper)
        self._wake()

    def _shape(self, dest: Destination, state: DestState, shaper: Shaper) -> None:
        """Give the destination its shape: known, or once its MX hosts are looked up (it waits until then)."""
        state.shape = shaper.known(dest.target)
        if state.shape is None:
            self._lookup(dest.target, shaper)

    def _lookup(self, domain: str, shaper: Shaper) -> trio.Event:
        """The MX lookup of ``domain`` under way (started here if none is): set once its shape is settled."""
        done = self._lookups.get(domain)
        if done is None:
            assert self._nursery is not None
            done = self._lookups[domain] = trio.Event()
            self._nursery.start_soon(self._classify, domain, shaper, done)
        return done

    async def _classify(self, domain: str, shaper: Shaper, done: trio.Event) -> None:
        try:
            shape = await shaper.classify(domain)
        finally:
            del self._lookups[domain]
            done.set()
        for dest, state in self.dests.items():
            if dest.kind == "mx" and dest.target == domain:
                state.shape = shape
        self._wake()

    async def _shaping_clock(self, shaper: Shaper) -> None:
        """Look again when a destination held back by its rate, or an override's effect, changes."""
        while True:
            now = time.time()
            wake = shaper.next_wake(now)
            await trio.sleep(min(max(0.005, wake - now), 1.0))
            shaper.adaptive.expire(time.time())  # what is gone costs nothing more
            shaper.wake_at = math.inf
            self._wake()

    def _wake(self) -> None:
        """Wake one idle worker if there is work for it and none is already on its way."""
        if self._waking or not self._idle or self._pick() is None:
            return
        self._waking += len(self._idle.unpark(count=1))

    def _make_room(self) -> None:
        event, self._room = self._room, trio.Event()
        event.set()

    async def _finish_only(self, tracker: Tracker) -> None:
        self._finish(tracker)

    async def _expire(self, tracker: Tracker) -> None:
        env = tracker.attempt.envelope
        rcpts = tuple(tracker.attempt.remaining)
        lifetime = self.config.spool.max_queue_lifetime
        text = f"message expired after {lifetime_text(lifetime)} in the queue"
        if tracker.attempt.envelope.extra.get("last_error"):
            text += f"; last error: {tracker.attempt.envelope.extra['last_error']}"
        outs = [Outcome(r, Status.EXPIRED, 0, "4.4.7", text, "") for r in rcpts]
        tracker.outstanding = 1
        await self._complete(tracker, Job(self.aspool.core.queue_id(env.message_id), env.sender, rcpts, (), 0), outs)

    async def _damaged(self, tracker: Tracker, reason: str) -> None:
        """A message whose data was found damaged when it was copied forward: bounced or held now."""
        env = tracker.attempt.envelope
        rcpts = tuple(tracker.attempt.remaining)
        tracker.outstanding = 1
        job = Job(self.aspool.core.queue_id(env.message_id), env.sender, rcpts, (), 0)
        await self._complete(tracker, job, self._damaged_outcomes(tracker, job, reason))

    def _damaged_outcomes(self, tracker: Tracker, job: Job, reason: str) -> list[Outcome]:
        """The outcomes of a message whose data cannot be read: bounced, or (``on_damaged_body = "hold"``)
        deferred into the held class. One log line says which, and why."""
        if self.config.delivery.on_damaged_body == "hold":
            tracker.hold = True
            text = f"the message's data in the spool is damaged ({reason}); held for the administrator"
            event(log, "damaged_body", job.queue_id, level=logging.ERROR, reason=reason, action="held")
            return [Outcome(r, Status.DEFERRED, 0, "4.3.0", text, "") for r in job.recipients]
        text = f"the message's data in the spool is damaged ({reason}); it cannot be delivered, please send it again"
        event(log, "damaged_body", job.queue_id, level=logging.ERROR, reason=reason, action="bounced",
              sender=f"<{job.sender}>")
        return [Outcome(r, Status.BOUNCED, 0, "5.3.0", text, "") for r in job.recipients]

    # -- delivering -----------------------------------------------------------

    def _pick(self) -> tuple[Destination, DestState] | None:
        """The destination below its limit whose oldest waiting job is the oldest.

        Its limits are asked only of a destination older than the best so far: the table's checks cost more
        than the comparison, and the destinations come in about the order their mail did. When none is
        admitted every one was asked, so the shaper's ``wake_at`` has heard of each refusal.
        """
        best: tuple[Destination, DestState] | None = None
        oldest = 0
        shaper, now = self.shaper, time.time()
        for dest, state in self.dests.items():
            if not state.queue:
                continue
            arrival = state.queue[0][1].attempt.envelope.arrival_ms
            if best is not None and arrival >= oldest:
                continue
            if shaper is not None and dest.kind == "mx":
                if state.shape is None or not shaper.admits(state.shape, state.active, now):
                    continue
            elif state.active >= self.per_destination:
                continue
            best, oldest = (dest, state), arrival
        return best

    async def _worker(self) -> None:
        while True:
            picked = self._pick()
            if picked is None:
                await self._idle.park()
                self._waking -= 1
                continue
            if self.aspool.disk_full:  # an outcome could not be recorded now: start nothing until there is room
                await self.aspool.wait_for_space()
                continue
            dest, state = picked
            shape = state.shape if self.shaper is not None and dest.kind == "mx" else None
            size = self.batch if shape is None or self.shaper is None else \
                self.shaper.take(shape, len(state.queue), time.time())
            batch = [state.queue.popleft() for _ in range(min(size, len(state.queue)))]
            self.pending -= len(batch)
            self._make_room()
            state.active += 1
            if shape is not None and self.shaper is not None:
                self.shaper.opened(shape)
            self._wake()  # more work than this batch: the next worker takes it
            try:
                await self._deliver(dest, state, batch)
            finally:
                state.active -= 1
                if shape is not None and self.shaper is not None:
                    self.shaper.closed(shape)
                if not state.queue and not state.active:
                    self.dests.pop(dest, None)

    async def _deliver(self, dest: Destination, state: DestState, batch: list[tuple[Job, Tracker]]) -> None:
        now = time.time()
        if state.shape is not None and self.shaper is not None:
            verdict = self.shaper.verdict(state.shape, now)
            if verdict is not None:  # no connection: these outcomes carry no reply code, so no rule counts them
                status, code = (Status.DEFERRED, "4.7.0") if verdict.action == "suspend" else (Status.BOUNCED, "5.7.0")
                if verdict.action == "suspend":  # the message's class is chosen to return after the end
                    for job, tracker in batch:
                        tracker.suspended.update(dict.fromkeys(job.recipients, verdict.override.ends))
                await self._complete_all([(tracker, job, [Outcome(r, status, 0, code, verdict.reply(), "")
                                                          for r in job.recipients]) for job, tracker in batch],
                                         in_batch=True)
                return
            if self.shaper.tls_required(state.shape):
                dest = attrs.evolve(dest, tls=require_tls(dest.tls))
        if now < state.backoff_until:
            reply = f"destination {dest} not reachable, retry postponed: {state.last_error}"
            await self._complete_all([(tracker, job, [Outcome(r, Status.DEFERRED, 0, state.last_enhanced, reply,
                                                              str(dest))
                                                      for r in job.recipients]) for job, tracker in batch],
                                     in_batch=True)
            return
        jobs = [job for job, _tracker in batch]
        started = last = time.monotonic()
        early: dict[int, list[Outcome]] = {}

        def on_outcome(i: int, outcomes: list[Outcome]) -> None:
            """Record a job's outcomes the moment the next hop has answered for it (transport.py)."""
            nonlocal last
            if i in early:
                return
            now = time.monotonic()
            job, tracker = batch[i]
            early[i] = self._append(tracker, job, outcomes, int((now - last) * 1000))
            last = now

        passed: dict[int, tuple[str, ...]] = {}  # job -> its recipients past their point of no return (durable)

        async def before_dot(i: int, recipients: Sequence[str]) -> None:
            """The point of no return of job ``i``'s ``recipients``, durable before the transport sends them."""
            job, tracker = batch[i]
            if not set(recipients) <= set(job.recipients):
                raise ValueError(f"before_dot for recipients not in job {i}: {sorted(set(recipients))}")
            await self.aspool.pass_point_of_no_return(tracker.attempt, recipients)
            self.metrics.points.labels(by="relay").inc()
            passed[i] = tuple(dict.fromkeys(passed.get(i, ()) + tuple(recipients)))

        local_failure = False
        requeue: list[int] = []  # jobs of the batch sent back to the queue untried (a damaged body stopped it)
        transport = self.transports[dest.kind]
        try:  # the batch's boundary: reading, the transport, its callbacks
            for job, tracker in batch:
                job.body = await self.aspool.read_body(tracker.attempt)
            if passes_dot(transport):
                results = await transport.deliver(dest, jobs, on_outcome, before_dot=before_dot)
            else:  # it cannot say when: every job passes its point of no return now (a claim is doubt)
                for i, job in enumerate(jobs):
                    await before_dot(i, job.recipients)
                results = await transport.deliver(dest, jobs, on_outcome)
            if len(results) != len(jobs):
                raise RuntimeError(f"transport {dest.kind} returned {len(results)} results for {len(jobs)} messages")
        except Exception as exc:
            if is_fatal(exc, self.aspool.core):
                raise
            local_failure = True  # our fault, not the destination's: no backoff
            damaged = {i: job.body.damaged for i, job in enumerate(jobs)
                       if isinstance(job.body, StoredBody) and job.body.damaged is not None}
            if damaged:
                # A message's data could not be read: its fate is decided here. The jobs the transport had
                # not reached (no outcome yet) were never sent: back to the queue, tried again at once.
                requeue = [i for i in range(len(jobs)) if i not in damaged and i not in early]
                results = [self._damaged_outcomes(batch[i][1], job, damaged[i].reason) if i in damaged else []
                           for i, job in enumerate(jobs)]
            else:
                event(log, "delivery_error", None, level=logging.ERROR,
                      exc_info=None if isinstance(exc, TransportLost) else exc,
                      qids=[job.queue_id for job in jobs], relay=str(dest), error=local_error(exc), status="deferred")
                results = [[Outcome(r, Status.DEFERRED, 0, "4.3.0", local_error(exc), str(dest))
                            for r in job.recipients] for job in jobs]
                if isinstance(exc, TransportLost):
                    for i, rcpts in exc.marked.items():  # marked in a dead worker's own file
                        passed[i] = tuple(dict.fromkeys(passed.get(i, ()) + rcpts))
                    self._lost_in_doubt(batch, {i: r for i, r in passed.items() if i not in early})
        results = [early.get(i, outs) for i, outs in enumerate(results)]  # what was recorded stands
        duration = time.monotonic() - started
        for i in reversed(requeue):
            job, tracker = batch[i]
            job.body = ()
            state.queue.appendleft((job, tracker))
            self.pending += 1
        if requeue:
            batch = [b for i, b in enumerate(batch) if i not in requeue]
            kept = [i for i in range(len(results)) if i not in requeue]
            results = [results[i] for i in kept]
            early = {k: early[i] for k, i in enumerate(kept) if i in early}
            self._wake()
        unreachable = not local_failure and all(o.code == 0 and o.status is Status.DEFERRED
                                                for outs in results for o in outs)
        if unreachable:
            state.failures += 1
            state.backoff_until = time.time() + min(BACKOFF_MAX, BACKOFF_MIN * 2 ** (state.failures - 1))
            state.last_error = results[0][0].reply if results and results[0] else ""
            state.last_enhanced = results[0][0].enhanced or "4.4.1" if results and results[0] else "4.4.1"
        elif not local_failure:
            state.failures = 0
            state.backoff_until = 0.0
        for job, _tracker in batch:
            job.body = ()
        await self._complete_all([(tracker, job, outs) for (job, tracker), outs in zip(batch, results, strict=True)],
                                 duration, recorded=set(early), in_batch=True)

    async def _complete(self, tracker: Tracker, job: Job, outcomes: list[Outcome], duration: float = 0.0) -> None:
        await self._complete_all([(tracker, job, outcomes)], duration)

    async def _complete_all(self, done: list[tuple[Tracker, Job, list[Outcome]]], duration: float = 0.0,
                            recorded: Collection[int] = (), in_batch: bool = False) -> None:
        """Make the outcomes durable (with any DSNs) in one commit, then log them and finish what is done.

        One commit for a connection's messages, not one each: the durability
        rule is about order (outcome durable before the message's next step,
        the FINISH), and it holds for all of them after the one fsync.
        ``recorded``: the indexes in ``done`` whose outcomes were appended as
        they came (``on_outcome``); they only wait for the commit here.
        ``in_batch``: called by a batch's own task (counted in its destination's ``active``).
        """
        done = [(tracker, job, outcomes if i in recorded else
                 self._append(tracker, job, outcomes, int(duration * 1000)))
                for i, (tracker, job, outcomes) in enumerate(done)]
        await self._commit_outcomes(len(done), max(tracker.appended_to for tracker, _job, _outs in done), in_batch)
        for tracker, job, outcomes in done:
            self._after_durable(tracker, job, outcomes, duration)

    async def _commit_outcomes(self, count: int, upto: int, in_batch: bool = False) -> None:
        """Commit the appended outcomes; while the disk is full, wait for room and commit again.

        They ride with the next commit somebody needs if one comes soon
        (``AsyncSpool.commit_riding``: an enqueue's, while clients are
        connected; ``ride_bound``, at most 50 ms), else get their own: with a delivery worker they come
        back after the enqueue commit they used to share, and a commit of their
        own cost an fsync for a handful of records. They also wait (as long)
        while other batches are out (or queued) and not yet waiting here, so that at the
        end of a burst the last batches' outcomes share one commit. Nothing of
        the messages' next step happens before this returns. ``upto``: the log
        position their records end at; what others appended since (claims,
        FINISH records) need not wait for this commit, nor make one.

        The records stay appended at their positions (spool.write.log), so the same
        commit covers them once it fits; nothing is finished before that.
        """
        out = sum(state.active for state in self.dests.values()) - self._riding - (1 if in_batch else 0) + self.pending
        self._riding += 1
        try:
            while True:
                try:
                    await self.aspool.commit_riding(upto, more_coming=out > 0)
                    return
                except DiskFull as exc:
                    event(log, "no_room", None, level=logging.WARNING, outcomes=count, error=str(exc),
                          action="delivery pauses until there is room")
                    await self.aspool.wait_for_space()
        finally:
            self._riding -= 1

    def _append(self, tracker: Tracker, job: Job, outcomes: list[Outcome], duration_ms: int) -> list[Outcome]:
        """Append a DELIVERY record, after the DSN for its failures (no fsync; the commit follows).

        The DSN comes first in the log, so no crash keeps the bounce without
        its DSN: a log cut anywhere keeps both, or neither, or only the DSN
        (and the recipient, still in doubt, is tried again). Returns the
        outcomes as recorded: a DSN that cannot be built turns its bounces
        into deferrals.
        """
        attempt = tracker.attempt
        extra = attempt.envelope.extra
        notices = dsnmod.should_bounce(attempt.envelope.sender) and not extra.get("dsn")
        failed = dsn_notify.failures_to_report(extra, [o for o in outcomes if o.status in (Status.BOUNCED,
                                                                                           Status.EXPIRED)])
        if failed and notices:
            try:
                tracker.dsns.append((job, self._enqueue_dsn(attempt, failed), len(failed)))
            except Exception as exc:
                if is_fatal(exc, self.aspool.core):
                    raise
                # No bounce without its DSN: the failed recipients are deferred and tried again later.
                qid = self.aspool.core.queue_id(attempt.envelope.message_id)
                event(log, "dsn_error", qid, level=logging.ERROR, exc_info=exc, error=local_error(exc),
                      status="deferred")
                reason = f"{local_error(exc)} (building the DSN)"
                outcomes = [Outcome(o.recipient, Status.DEFERRED, 0, "4.3.0", f"{reason}; was: {o.reply}",
                                    o.next_hop) if o in failed else o for o in outcomes]
        if notices:
            self._report_success(tracker, outcomes)
        self._warn_of_delay(tracker, outcomes)
        pos = self.aspool.append_delivery(attempt, outcomes, duration_ms, job.source)
        tracker.appended_to = self.aspool.core.writer.head
        if self.shaper is not None:
            now = time.time()
            for o in outcomes:
                for override in self.shaper.record(pos, now, o.recipient, o.code, o.enhanced, o.reply, o.next_hop):
                    event(log, "shaping_override", self.aspool.core.queue_id(attempt.envelope.message_id),
                          level=logging.WARNING, rule=override.rule.name, scope=override.scope,
                          action=override.rule.action, until=round(override.ends, 3),
                          reply=override.hits[-1].describe())
        return outcomes

    def _warn_of_delay(self, tracker: Tracker, outcomes: list[Outcome]) -> None:
        """Append a delay notice (RFC 3464, ``Action: delayed``) for the deferred recipients, once a message.

        Sent when the message has been queued ``delivery.delay_warning`` or
        longer, to the recipients whose DSN request allows it
        (``dsn_notify.delay_due``: NOTIFY=DELAY is told even without the
        setting), never to the null sender nor for a DSN; the replacement
        envelope records it (``delay_warned``), so later attempts send none.
        A crash before that replacement is written may send it once more.
        """
        env = tracker.attempt.envelope
        if tracker.delay_warned or env.extra.get("delay_warned") or env.extra.get("dsn") \
                or not dsnmod.should_bounce(env.sender):
            return
        warn_after, age = self.config.delivery.delay_warning, time.time() - env.arrival_ms / 1000
        deferred = [o for o in outcomes if o.status is Status.DEFERRED
                    and dsn_notify.delay_due(env.extra, o.recipient, warn_after, age)]
        if not deferred:
            return
        qid = self.aspool.core.queue_id(env.message_id)
        try:
            notice = self._enqueue_dsn(tracker.attempt, deferred, "delayed")
        except Exception as exc:
            if is_fatal(exc, self.aspool.core):
                raise
            event(log, "dsn_error", qid, level=logging.ERROR, exc_info=exc, error=local_error(exc), action="delayed")
            return
        tracker.delay_warned = True
        event(log, "delay_notice", qid, to=f"<{env.sender}>", dsn=notice, nrcpt=len(deferred))

    def _report_success(self, tracker: Tracker, outcomes: list[Outcome]) -> None:
        """Append the success notice (``delivered`` or ``relayed``) the recipients that asked for one are owed.

        It rides the DELIVERY record's commit like a bounce. One that cannot be
        built is logged and not sent: the delivery itself stands.
        """
        owed = dsn_notify.successes_to_report(tracker.attempt.envelope.extra, outcomes)
        if not owed:
            return
        qid = self.aspool.core.queue_id(tracker.attempt.envelope.message_id)
        try:
            notice = self._enqueue_dsn(tracker.attempt, [o for o, _action in owed],
                                       actions=[action for _o, action in owed])
        except Exception as exc:
            if is_fatal(exc, self.aspool.core):
                raise
            event(log, "dsn_error", qid, level=logging.ERROR, exc_info=exc, error=local_error(exc), action="success")
            return
        event(log, "success_notice", qid, to=f"<{tracker.attempt.envelope.sender}>", dsn=notice, nrcpt=len(owed))

    def _after_durable(self, tracker: Tracker, job: Job, outcomes: list[Outcome], duration: float) -> None:
        """Log and report the (durable) outcomes; finish the message when all its jobs are in."""
        attempt = tracker.attempt
        env = attempt.envelope
        now = time.time()
        if job.source and not any(o.code for o in outcomes):
            self.egress.give_back(job.source)  # no next hop answered: nothing was sent from it
        for o in outcomes:
            self._log(job.queue_id, env, o, now, duration, job.source)
        for dsn_qid, count in [(q, n) for j, q, n in tracker.dsns if j is job]:  # durable with these outcomes
            event(log, "bounce", job.queue_id, to=f"<{env.sender}>", dsn=dsn_qid, nrcpt=count)
        tracker.dsns = [d for d in tracker.dsns if d[0] is not job]
        for o in outcomes:
            for observe in self.observers:
                try:
                    observe(job.queue_id, o)
                except Exception as exc:  # a reader of outcomes must not stop the message's next step
                    if is_fatal(exc, self.aspool.core):
                        raise
                    event(log, "observer_error", job.queue_id, level=logging.ERROR, exc_info=exc,
                          error=local_error(exc))
            if o.status is Status.DEFERRED:
                tracker.last_error = last_error(o)
        tracker.outstanding -= 1
        if tracker.outstanding <= 0:
            extra: dict[str, Any] = {"last_error": tracker.last_error} if tracker.last_error else {}
            if tracker.delay_warned:
                extra["delay_warned"] = True
            self._finish(tracker, extra=extra or None, next_class=self._next_class(tracker), in_doubt=tracker.in_doubt)

    def _next_class(self, tracker: Tracker) -> int | None:
        """The held class for a damaged body held; for mail of a suspended provider, the class that brings it
        back at the first runner pass after the suspension's end (``retry_class``); else None, the spool's own."""
        if tracker.hold:
            return HELD_CLASS
        if not tracker.suspended:
            return None
        attempt = tracker.attempt
        return class_after_suspension(self.aspool.core.config.retry_intervals, time.time(), attempt.remaining,
                                      tracker.suspended, self.aspool.core.retry_class(attempt))

    def _lost_in_doubt(self, batch: list[tuple[Job, Tracker]], lost: dict[int, tuple[str, ...]]) -> None:
        """The process sending ``batch`` died (a delivery worker killed): its jobs ``lost`` were past their point
        of no return with no outcome heard, so they are in doubt, exactly as after the relay's own crash
        (``spool.engine.recovery``): one line each, and held with ``in_doubt = "hold"`` when their message
        finishes. The batch's other jobs never sent their final dot: deferred, due again."""
        hold = self.aspool.core.config.in_doubt == "hold"
        for i, rcpts in sorted(lost.items()):
            job, tracker = batch[i]
            tracker.in_doubt = tuple(dict.fromkeys(tracker.in_doubt + rcpts))
            event(log, "in_doubt", job.queue_id, level=logging.WARNING, to=",".join(rcpts),
                  reason="the delivery worker died after the final dot was written, before the reply",
                  action="held: mta queue release" if hold else "delivered again")

    def _enqueue_dsn(self, attempt: Attempt, failed: list[Outcome], action: dsnmod.Action = "failed",
                     actions: Sequence[dsnmod.Action] | None = None) -> str:
        """Append the DSN for ``failed`` (no commit: the caller's covers it); returns the DSN's queue id.

        ``action`` ``delayed``: a delay notice (``delivery.delay_warning``) for deferred recipients;
        ``actions``: one per outcome (a success notice's ``delivered`` or ``relayed``). A failure notice
        of a message sent with RET=FULL returns the whole message (up to ``dsn.FULL_RETURN_LIMIT``).
        """
        env = attempt.envelope
        params = env.extra.get("params")
        full = (action == "failed" and actions is None and isinstance(params, dict) and params.get("RET") == "FULL"
                and env.body_size <= dsnmod.FULL_RETURN_LIMIT)
        whole: bytes | None = None
        try:
            if full:
                whole = b"".join(self.aspool.core.read_body(env))
            headers = b"" if whole is not None else dsnmod.extract_headers(self.aspool.core.read_body(env))
        except DamagedBody:
            headers, whole = b"", None  # the bounce of a damaged message says why, without its headers
        failures = [dsnmod.RecipientFailure(
            recipient=o.recipient, status=o.enhanced or ("5.0.0" if o.status is Status.BOUNCED else
                                                         "4.4.7" if o.status is Status.EXPIRED else
                                                         "2.0.0" if o.status is Status.DELIVERED else "4.0.0"),
            action=actions[i] if actions is not None else action,
            diagnostic=f"smtp; {o.code} {o.enhanced} {o.reply}".replace("  ", " ") if o.code
            else f"x-logspool; {o.reply}", remote_mta=dsnmod.remote_mta_name(o.next_hop) if o.code else "",
            original_recipient=dsn_params.orcpt_of(env.extra, o.recipient) or "")
            for i, o in enumerate(failed)]
        envid = params.get("ENVID") if isinstance(params, dict) else None
        qid = self.aspool.core.queue_id(env.message_id)
        message = dsnmod.build_dsn(
            reporting_mta=self.config.server.hostname, original_sender=env.sender,
            original_envelope_id=envid if isinstance(envid, str) else None,
            arrival_time=dt.datetime.fromtimestamp(env.arrival_ms / 1000, dt.UTC), failed=failures,
            original_headers=headers, from_address=self.config.delivery.bounce_sender, queue_id=qid,
            original_message=whole)
        dsn_id = self.aspool.core.enqueue("", [env.sender], message, extra={"dsn": True, "dsn_for": qid})
        if action == "failed" and actions is None:  # a bounce, not a success notice
            self.metrics.bounced_dsn.inc()
        return self.aspool.core.queue_id(dsn_id)

    def _log(self, qid: str, env: Envelope, o: Outcome, now: float, duration: float, source: str = "") -> None:
        """The delivery line, Postfix's ``to=<...>, relay=..., delay=..., dsn=..., status=...`` as key=value."""
        delay = max(0.0, now - env.arrival_ms / 1000)
        klass = self.classes.of(o)
        relay, _, tls = (dsn_notify.strip_passed(o.next_hop) or "none").partition(" tls=")
        message_id = env.extra.get("message_id")
        fields: dict[str, FieldValue] = {
            "message_id": message_id if isinstance(message_id, str) else None, "to": f"<{o.recipient}>",
            "relay": relay, "tls": tls or None, "source": source or None, "delay": delay,
            "attempts": env.attempts + 1, "dsn": o.enhanced or "-", "status": STATUS_WORDS[o.status],
            "class": klass, "reply": f"{o.code} {o.reply}" if o.code else o.reply}
        event(log, "delivery", qid, fields)
        self.metrics.outcome(o.status, delay if math.isfinite(delay) else 0.0, klass)
