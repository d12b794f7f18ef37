"""How many deferred messages may be claimed now: new mail first, the backlog never starved.

Theory of operation. Retrying a deferred message costs about as much as
accepting a new one (a claim, a DELIVERY record, a replacement envelope with
its body copied forward, a FINISH), and a due backlog is work that is always
ready: left alone it takes every cycle the accept path leaves, and new mail's
acceptance rate halves (docs/bench_backlog.md). Postfix's qmgr gives the
incoming queue priority but never starves the deferred one; this budget does
the same for the claims of one spool:

- While new mail is flowing (a class-0 message was claimed within the last
  ``quiet`` seconds), deferred claims are limited to ``share`` of all claims:
  each new-mail claim earns ``share / (1 - share)`` deferred claims.
- A trickle of ``trickle`` deferred claims per second is allowed whatever the
  new mail does, so the backlog still drains under a flood of new mail.
  The two allowances do not add up: the larger one applies.
- When no new mail has been claimed for ``quiet`` seconds, deferred mail is
  claimed at full rate (the budget says "unlimited").
- ``share`` 1.0 turns the budget off (deferred claims are never limited).

Both allowances are buckets capped at ``burst`` claims, so a quiet minute does
not bank a flood. Everything is driven by the times the caller passes in (the
spool's injectable clock), never by a timer: the budget is deterministic, and
``next_allowed`` tells the caller when to look again instead of polling.
"""

from __future__ import annotations

import attrs

DEFAULT_SHARE = 0.2
TRICKLE = 10.0  # deferred claims per second allowed even while new mail floods in
QUIET = 1.0  # seconds without a new-mail claim after which the backlog runs at full rate
BURST = 64.0


def _share(_inst: object, _attr: object, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"deferred_share must be between 0 and 1, got {value}")


@attrs.define(on_setattr=attrs.setters.NO_OP)
class DeferredBudget:
    """The allowance of deferred claims; see the module docstring for the rules.

    Only ``share`` is checked when set: the buckets change on every poll that
    claims, and attrs' default hooks on each set were a fifth of the budget's cost.
    """

    share: float = attrs.field(default=DEFAULT_SHARE, validator=_share, on_setattr=attrs.setters.validate)
    trickle: float = TRICKLE
    quiet: float = QUIET
    burst: float = BURST
    earned: float = 0.0  # from new-mail claims
    timed: float = 0.0  # from the trickle
    last_new: float | None = None
    _accrued_at: float | None = None

    def note_new(self, count: int, now: float) -> None:
        """``count`` new-mail messages were just claimed."""
        if count <= 0:
            return
        self.last_new = now
        if self.share < 1.0:
            self.earned = min(self.burst, self.earned + count * self.share / (1.0 - self.share))

    def limited(self, now: float) -> bool:
        """Is new mail flowing, so that deferred claims are rationed?"""
        return self.share < 1.0 and self.last_new is not None and now - self.last_new < self.quiet

    def allowance(self, now: float) -> int | None:
        """Deferred claims allowed now; None when unlimited."""
        self._accrue(now)
        if not self.limited(now):
            return None
        # The epsilon: at the time next_allowed names, the trickle must have earned a whole claim,
        # not 0.99999 of one (the clock's floats), or the caller wakes to find nothing allowed.
        return int(max(self.earned, self.timed) + 1e-6)

    def reset(self) -> None:
        """Empty both buckets (a test's or a tool's fresh start; the rules are unchanged)."""
        self.earned = self.timed = 0.0

    def spend(self, count: int) -> None:
        """``count`` deferred messages were claimed (a no-op cost while unlimited, where buckets are moot)."""
        if count > 0:
            self.earned = max(0.0, self.earned - count)
            self.timed = max(0.0, self.timed - count)

    def next_allowed(self, now: float) -> float:
        """When a deferred claim will be allowed if no new mail comes: ``now`` if it is already."""
        allowed = self.allowance(now)
        if allowed is None or allowed >= 1:
            return now
        assert self.last_new is not None
        times = [self.last_new + self.quiet]
        if self.trickle > 0:
            # Only the trickle grows with time, and the buckets do not add up: it is the timed bucket
            # that must reach a whole claim, however much the share has earned short of one.
            times.append(now + (1.0 - self.timed) / self.trickle)
        return max(now, min(times))

    def _accrue(self, now: float) -> None:
        if self._accrued_at is not None and self.trickle > 0:
            elapsed = now - self._accrued_at
            if elapsed > 0:  # a clock set back earns nothing, and costs nothing either
                self.timed = min(self.burst, self.timed + elapsed * self.trickle)
        if self._accrued_at is None or now > self._accrued_at:
            self._accrued_at = now
