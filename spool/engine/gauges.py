"""The queue's gauges, kept as the spool goes: how many messages wait in each state, and the oldest.

Every live message has one live envelope, or is being worked on (its attempt
in ``SpoolCore.by_envelope``). So the counts change at two places only: an
envelope appended (new mail, a retry's or an admin change's replacement,
recovery's) adds one to its state, a claim takes one away. ``seed`` counts
the live log once, when the relay starts (one walk, constant memory); after
that nothing walks the log but ``oldest``'s refresh, and only when the
oldest message has left the queue (``stale``).
"""

from __future__ import annotations

import attrs

from spool.format.record import HELD_CLASS
from spool.read import listing as admin

NEVER = 1 << 62  # no message: an arrival later than any


@attrs.define
class QueueGauges:
    """Messages waiting (not being delivered) by state, and those naming recipients in doubt."""

    new: int = 0  # due now: new mail, released or flushed
    deferred: int = 0  # waiting for a retry class's runner
    held: int = 0
    in_doubt: int = 0  # messages (any state but active) with recipients perhaps delivered before a crash
    in_doubt_recipients_seeded: int = 0  # recipients in doubt in the queue when the relay started
    oldest_ms: int = NEVER  # the oldest live message's arrival
    oldest_id: int = -1
    stale: bool = False  # the oldest message has left: ``oldest_ms`` is only a lower bound until a refresh

    def added(self, message_id: int, klass: int, held: bool, in_doubt: bool, arrival_ms: int) -> None:
        self._bump(klass, held, in_doubt, 1)
        if arrival_ms < self.oldest_ms:
            self.oldest_ms, self.oldest_id = arrival_ms, message_id

    def claimed(self, klass: int, held: bool, in_doubt: bool) -> None:
        self._bump(klass, held, in_doubt, -1)

    def gone(self, message_id: int) -> None:
        """A message left the queue (delivered, bounced, deleted): perhaps the oldest."""
        if message_id == self.oldest_id:
            self.stale = True

    def _bump(self, klass: int, held: bool, in_doubt: bool, by: int) -> None:
        if held or klass == HELD_CLASS:
            self.held += by
        elif klass == 0:
            self.new += by
        else:
            self.deferred += by
        if in_doubt:
            self.in_doubt += by

    def seed(self, listable: admin.Listable) -> None:
        """Count every live message once (the relay's start, before it serves)."""
        for m in admin.iter_live(listable):
            env = m.envelope
            if m.state == "active":  # counted by its attempt; still perhaps the oldest
                if env.arrival_ms < self.oldest_ms:
                    self.oldest_ms, self.oldest_id = env.arrival_ms, m.message_id
                continue
            self.added(m.message_id, m.klass, m.held, bool(env.in_doubt), env.arrival_ms)
            self.in_doubt_recipients_seeded += len(env.in_doubt)

    def refreshed(self, oldest: tuple[int, int] | None) -> None:
        """A walk's oldest (arrival, id), or None for an empty queue."""
        self.oldest_ms, self.oldest_id = oldest if oldest is not None else (NEVER, -1)


def oldest_live(listable: admin.Listable) -> tuple[int, int] | None:
    """(arrival, id) of the oldest live message, active ones included: one walk, constant memory."""
    return min((admin.arrival_key(m) for m in admin.iter_live(listable)), default=None)
