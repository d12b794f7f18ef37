"""A token bucket: at most ``rate.count`` messages at once, refilled at ``rate.per_second``."""

from __future__ import annotations

import math

__all__ = ["TokenBucket"]


class TokenBucket:
    """Tokens are messages. ``take`` never blocks: the scheduler asks how many it may send now, and when the
    next one may go (``ready_at``), and does something else meanwhile."""

    def __init__(self, per_second: float, burst: float, now: float) -> None:
        self.per_second = per_second
        self.burst = max(1.0, burst)
        self.tokens = self.burst
        self.stamp = now

    def retune(self, per_second: float, burst: float) -> None:
        """A changed rate (an override began or ramps): tokens kept, never above the new burst."""
        self.per_second, self.burst = per_second, max(1.0, burst)
        self.tokens = min(self.tokens, self.burst)

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.per_second)
            self.stamp = now

    def available(self, now: float) -> int:
        self._refill(now)
        return int(self.tokens)

    def take(self, count: int, now: float) -> None:
        self._refill(now)
        self.tokens -= count

    def ready_at(self, now: float) -> float:
        """When one whole token is there."""
        self._refill(now)
        if self.tokens >= 1:
            return now
        return now + (1 - self.tokens) / self.per_second if self.per_second > 0 else math.inf
