"""The runners' side: claiming due messages, recording their outcomes, finishing attempts.

A claim is a START record naming the envelope (``Attempt``, ``spool.engine.core``);
the envelope's garbage mark is written once the START is durable
(``LogWriter.mark_after_sync``). An attempt ends with a FINISH and, for the
recipients that have no final outcome, a replacement envelope of the next
retry class (``SpoolCore._end``, ``_write_replacement``).

Which runner goes first: new mail first, up to half the room; then the
deferred classes in turn, up to what ``spool.config.fairness`` allows while new mail
flows; then new mail again (``poll_due``). The runners themselves are
``spool.engine.runner``: cursors that trail the head of the log by their interval.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from spool.engine.core import Attempt, SpoolCore
from spool.engine.runner import Candidate
from spool.errors import CorruptRecord, SpoolError
from spool.format.record import (
    GARBAGE,
    HELD_CLASS,
    Delivery,
    Envelope,
    Outcome,
    RecordType,
    Start,
    StartKind,
    decode_payload,
    pos_segment,
)
from spool.format.segment import segment_path
from spool.read.anomaly import Anomaly
from spool.read.lost import find_lost
from spool.read.reader import bad_payload


class Claims(SpoolCore):
    """Claims of due messages by the runners, their outcomes and their end."""

    def poll_due(self, now: float | None = None, limit: int | None = None, *,
                 rationed: bool | None = None) -> list[Attempt]:
        """Claim due messages; respects the active limit and (``rationed``) the deferred budget.

        New mail first, up to half the room; then the deferred classes (in
        turn) up to what ``self.budget`` allows while new mail flows (all the
        rest of the room when it does not); then new mail again for what is
        left. The half kept back lets the trickle through even when new mail
        alone would fill every poll.

        ``rationed`` defaults to ``now is None``: polls at the spool's own
        clock (the relay's, through ``next_due``) are budgeted, and may return
        nothing while deferred mail is due (``next_wake`` says when to look
        again). A caller that names its own time (a checker draining the queue
        at a simulated instant) gets everything due, as before the budget.
        """
        if rationed is None:
            rationed = now is None
        now = self._now() if now is None else now
        room = self.config.active_limit - len(self.attempts)
        if limit is not None:
            room = min(room, limit)
        out: list[Attempt] = []
        if room <= 0:
            return out
        durable = self.writer.durable_end
        if all(r.idle(durable, now) for r in self.runners):
            # Every scan below would return at once with nothing (Runner.idle), and the rest is the
            # budget's bookkeeping of zero claims. The relay polls after every commit, and most commits
            # (outcomes, claims) bring no new mail: this is the common poll, at a fraction of the cost.
            if rationed and len(self.runners) > 1:
                self.budget.allowance(now)  # its timed bucket accrues from the same instants as before
            self._rr += 1
            return out
        budget = self.budget if rationed else None
        self._take(0, (room + 1) // 2, now, out)
        if budget is not None:
            budget.note_new(len(out), now)
        n = len(self.runners)
        if n > 1:
            allowed = budget.allowance(now) if budget is not None else None
            cap = room if allowed is None else len(out) + min(allowed, room - len(out))
            rot = self._rr % (n - 1)
            self._rr += 1
            before = len(out)
            # Only the deferred runners a pass could find work for: an idle one stays idle through this
            # poll (the durable end and ``now`` do not move in it), and at one message a poll the calls
            # that return nothing were most of a poll's cost.
            runners = self.runners
            for k in (*range(1 + rot, n), *range(1, 1 + rot)):
                if not runners[k].idle(durable, now):
                    self._take(k, cap - len(out), now, out)
            if budget is not None:
                budget.spend(len(out) - before)
        if len(out) < room and not self.runners[0].idle(durable, now):
            before = len(out)
            self._take(0, room - len(out), now, out)
            if budget is not None:
                budget.note_new(len(out) - before, now)
        return out

    def _take(self, klass: int, count: int, now: float, out: list[Attempt]) -> None:
        if count <= 0:
            return
        runner = self.runners[klass]
        for cand in runner.scan(self.writer, now, count, self.by_envelope):
            if self._gone(cand.pos):
                continue
            try:
                if cand.klass == HELD_CLASS:
                    self._carry_held(cand)
                    continue
                out.append(self._claim(cand, now))
            except CorruptRecord as exc:
                # A frame whose checksum passes but whose payload does not decode (written by a bug or a
                # newer version): quarantined and named like any damage; the runner has moved past it.
                anomaly = bad_payload(cand, segment_path(self.log_dir, pos_segment(cand.pos)), exc)
                self.damage.report(anomaly, f"runner {klass}")
                self._name_candidate(anomaly, cand.pos)

    def _name_candidate(self, anomaly: Anomaly, pos: int) -> None:
        """Name the message of a live envelope a runner chose and could not decode. The runner has moved past
        it, so the finder, which takes what lies behind every runner as claimed, is told it was live."""
        ctx = self.damage_context()
        if ctx is not None:
            self.damage.name_more(anomaly, find_lost(attrs.evolve(ctx, live_from=min(ctx.live_from, pos)), anomaly))

    def _gone(self, pos: int) -> bool:
        """Was the envelope claimed since the runner read it into its window?

        A runner reads ahead in 1 MiB windows; a garbage mark written after that
        (an admin change, an attempt that ended) is only on disk, or still
        waiting for its START's sync. One small read per candidate settles it.
        """
        return self.writer.mark_pending(pos) or self.writer.read_flags(pos) & GARBAGE != 0

    def _claim(self, cand: Candidate, now: float, kind: StartKind = StartKind.DELIVERY) -> Attempt:
        """Raises CorruptRecord (before appending anything) when the envelope's payload does not decode."""
        env = self.fresh.take(cand.pos, cand.payload)
        if env is None:
            decoded = decode_payload(RecordType.ENVELOPE, cand.payload)
            assert isinstance(decoded, Envelope)
            env = decoded
        start = self._append(RecordType.START, Start(cand.pos, int(now * 1000), kind))
        self.writer.mark_after_sync(cand.pos)
        if self.gauges is not None:
            self.gauges.claimed(cand.klass, env.held, bool(env.in_doubt))
        expired = (kind is StartKind.DELIVERY
                   and now * 1000 - env.arrival_ms >= self.config.max_queue_lifetime * 1000)
        attempt = Attempt(start, cand.pos, env, cand.klass, kind, expired)
        self.attempts[start] = attempt
        self.by_envelope[cand.pos] = attempt
        return attempt

    def _carry_held(self, cand: Candidate) -> None:
        attempt = self._claim(cand, self._now(), StartKind.CARRY)
        self._end(attempt, self._write_replacement(attempt.envelope, attempt.envelope_pos, HELD_CLASS,
                                                   attempt.remaining,
                                                   attempts=attempt.envelope.attempts, held=True))

    def _backoff_of(self, attempt: Attempt) -> int:
        """The class a failed attempt goes on from: its own, or for a message back in new mail's class after
        earlier attempts (flushed or released), the class those attempts had earned. A flush retries now; it
        does not reset the backoff, so a flushed message that fails again waits as long as before."""
        if attempt.klass == 0 and attempt.envelope.attempts > 0:
            return min(attempt.envelope.attempts, self.config.classes - 1)
        return attempt.klass

    def retry_class(self, attempt: Attempt) -> int:
        """The class ``finish`` gives the attempt's remaining recipients when its caller names none: the class
        after the one its backoff has reached (``_backoff_of``), so that a caller with a class of its own in
        mind can take the earlier of the two."""
        return self.config.next_class(self._backoff_of(attempt))

    def next_wake(self) -> float | None:
        """Earliest time a runner may find something new (None: only new appends wake them).

        Now, if a runner stopped at its limit with more perhaps due; but a
        deferred runner waits for the budget to allow a claim, so that a caller
        that polls at this time does not spin while the budget says no.
        """
        now = self._now()
        gate = self.budget.next_allowed(now)
        durable = self.writer.durable_end
        times = []
        for r in self.runners:
            t = now if r.has_more else r.wake_at
            if t is None and not r.idle(durable, now):
                # The log grew past where it last looked, but the poll did not let it look (a deferred
                # runner while the budget allowed none): its turn comes when the budget allows one. Without
                # this the caller slept until some later commit happened to wake it.
                t = now
            if t is not None:
                times.append(t if r.klass == 0 else max(t, gate))
        return min(times) if times else None

    @property
    def has_room(self) -> bool:
        """May another message be claimed, under ``active_limit``?"""
        return len(self.attempts) < self.config.active_limit

    def record_delivery(self, attempt: Attempt, outcomes: Iterable[Outcome], duration_ms: int = 0,
                        source: str = "") -> int:
        """Append a DELIVERY delta (``source``: the local address it was sent from, if chosen). The caller must
        commit before the message's next step."""
        outs = tuple(outcomes)
        for o in outs:
            if o.recipient not in attempt.envelope.recipients:
                raise ValueError(f"{o.recipient!r} is not a recipient of this attempt")
            attempt.outcomes[o.recipient] = o
        return self._append(RecordType.DELIVERY, Delivery(attempt.start_pos, self._now_ms(), outs, duration_ms,
                                                             source=source))

    def record_sending(self, attempt: Attempt, recipients: Iterable[str]) -> int:
        """Append the attempt's point of no return for ``recipients``: a DELIVERY with ``sending`` and no outcomes.

        The caller commits it (durable) before it writes the final dot for
        them; recovery then holds in doubt exactly these recipients, if they
        have no outcome (docs/design.md, "The point of no return").
        """
        rcpts = tuple(recipients)
        for r in rcpts:
            if r not in attempt.envelope.recipients:
                raise ValueError(f"{r!r} is not a recipient of this attempt")
        return self._append(RecordType.DELIVERY, Delivery(attempt.start_pos, self._now_ms(), (), 0, rcpts))

    def finish(self, attempt: Attempt, *, next_class: int | None = None,
               extra: dict[str, Any] | None = None, in_doubt: tuple[str, ...] = ()) -> int | None:
        """End an attempt: recipients without a final outcome go on in a replacement envelope.

        ``in_doubt``: recipients whose delivery may have happened (past the
        point of no return, and the process that sent them died before their
        outcome): kept in the replacement's ``in_doubt``, and with
        ``in_doubt = "hold"`` the replacement is held (class and flag), as
        recovery does after a crash. Returns the replacement's position, or
        None when the message is done.
        """
        if attempt.start_pos not in self.attempts:
            raise SpoolError("attempt already finished")
        remaining = attempt.remaining
        replacement = None
        if remaining:
            klass = self.retry_class(attempt) if next_class is None else next_class
            merged = {**attempt.envelope.extra, **(extra or {})}
            doubt = [r for r in in_doubt if r in remaining]
            hold = bool(doubt) and self.config.in_doubt == "hold"
            replacement = self._write_replacement(
                attempt.envelope, attempt.envelope_pos, HELD_CLASS if hold else klass, remaining,
                attempts=attempt.envelope.attempts + 1, extra=merged, held=hold,
                in_doubt=tuple(dict.fromkeys(attempt.envelope.in_doubt + tuple(doubt))) if doubt else None)
        self._end(attempt, replacement)
        return replacement
