"""Failed AUTH attempts per client address: past a limit within a window, the address is refused for a while.

Why: a submission port faces the whole internet, and a password is only as
strong as the number of guesses an attacker gets. Each failure is also answered
after a delay (the shell's ``failure_delay``), which makes guessing slow on one
connection; this limit makes it slow across connections too.

A client address is ``blocked`` once ``max_failures`` failures fall within
``window`` seconds; it is free again when the oldest of them is older than
that. A success forgets the address's failures (a user who mistyped once is
not held to it). Memory is bounded: at most ``max_clients`` addresses are
remembered, the one touched longest ago forgotten first, each with at most
``max_failures`` timestamps.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

__all__ = ["FailureLimiter"]


class FailureLimiter:
    """Counts AUTH failures per client address in a sliding window. Not thread-safe: the trio loop's alone."""

    def __init__(self, max_failures: int, window: float, *, max_clients: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_failures < 1 or window <= 0 or max_clients < 1:
            raise ValueError("max_failures, window and max_clients must be positive")
        self.max_failures = max_failures
        self.window = window
        self.max_clients = max_clients
        self.clock = clock
        self._failures: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def _recent(self, client: str) -> collections.deque[float] | None:
        times = self._failures.get(client)
        if times is None:
            return None
        horizon = self.clock() - self.window
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        return times

    def failures(self, client: str) -> int:
        """Failures of ``client`` within the window."""
        times = self._recent(client)
        return 0 if times is None else len(times)

    def blocked(self, client: str) -> bool:
        return self.failures(client) >= self.max_failures

    def failed(self, client: str) -> int:
        """Count a failure; returns the failures within the window, this one included."""
        times = self._recent(client)
        if times is None:
            times = self._failures[client] = collections.deque(maxlen=self.max_failures)
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)
        self._failures.move_to_end(client)
        times.append(self.clock())
        return len(times)

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)

    def __len__(self) -> int:
        return len(self._failures)
