"""How a shipper cuts the stream into batches: by count, by size and by time, never inside a record.

No I/O and no clock of its own (the caller passes ``now``), so the rules
are tested alone. Events come in log order; a batch is the oldest events
not yet acknowledged; ``acked`` drops them and names the cursor to store
(the position of the last record the batch held whole).
"""

from __future__ import annotations

import json
from typing import Any

import attrs


@attrs.frozen
class Batch:
    """``events`` to send as one body; ``cursor`` the record position acknowledging them all makes durable."""

    events: tuple[dict[str, Any], ...]
    cursor: int
    size: int


class Batcher:
    """Events in, batches out: at most ``max_events`` events and about ``max_bytes`` of JSON; a batch that
    is not full is due ``max_age`` seconds after its first event came in."""

    def __init__(self, max_events: int, max_bytes: int, max_age: float) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._events: list[tuple[dict[str, Any], int]] = []  # (event, its JSON size)
        self._bytes = 0
        self._since: float | None = None

    def add(self, events: list[dict[str, Any]], now: float) -> None:
        for e in events:
            size = len(json.dumps(e)) + 1
            self._events.append((e, size))
            self._bytes += size
        if self._events and self._since is None:
            self._since = now

    @property
    def waiting(self) -> int:
        return len(self._events)

    def full(self) -> bool:
        return len(self._events) >= self.max_events or self._bytes >= self.max_bytes

    def due(self, now: float) -> bool:
        """A batch should be sent now: it is full, or its oldest event has waited ``max_age``."""
        return bool(self._events) and (self.full() or (self._since is not None and now - self._since >= self.max_age))

    def wait(self, now: float) -> float:
        """Seconds until the waiting events are due by age (0: now; ``max_age``: nothing waits)."""
        if self._since is None:
            return self.max_age
        return max(0.0, self._since + self.max_age - now)

    def take(self) -> Batch:
        """The oldest batch (not removed until ``acked``). Cut at a record's end: the events of one record
        (one position) stay together, even past the bounds."""
        count, size = 0, 0
        for e, n in self._events:
            if count and (count >= self.max_events or size + n > self.max_bytes) and e["pos"] != self._events[
                    count - 1][0]["pos"]:
                break
            count, size = count + 1, size + n
        events = tuple(e for e, _ in self._events[:count])
        return Batch(events, int(events[-1]["pos"]), size)

    def acked(self, batch: Batch, now: float) -> None:
        n = len(batch.events)
        self._bytes -= sum(size for _, size in self._events[:n])
        del self._events[:n]
        self._since = now if self._events else None
