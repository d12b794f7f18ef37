"""A simple in-memory model of the spool, for the differential tests of the engine.

The model knows nothing of records, segments or positions: a message is its
remaining recipients, body, runner class, held flag, arrival time and the
recipients recovery marked in doubt. A delivery attempt is the recipients it
was claimed with and the outcomes recorded so far.

Crash semantics (docs/design.md, "The log", durability rules): everything appended since the last commit is lost;
what was committed survives. ``commit()`` snapshots the state; ``crash()`` rolls
back to the snapshot and then applies what recovery does to the attempts that
were in flight: recipients with a committed final outcome are done, the rest go
on in a replacement of the same class, and recipients past the point of no
return (a committed ``sending``) with no outcome at all are *in doubt* (and
their message held, with the engine's default ``in_doubt = "hold"``); a claim
alone is not doubt.
"""

from __future__ import annotations

import copy

import attrs

from spool.format.record import HELD_CLASS, Status


@attrs.define
class Msg:
    recipients: tuple[str, ...]
    body: bytes
    klass: int
    held: bool
    arrival: float
    in_doubt: frozenset[str] = frozenset()
    attempts: int = 0  # delivery attempts finished (a flush or release keeps the backoff they earned)


@attrs.define
class Flight:
    mid: int
    recipients: tuple[str, ...]
    klass: int
    attempts: int = 0
    outcomes: dict[str, Status] = attrs.field(factory=dict)
    sending: set[str] = attrs.field(factory=set)  # past the point of no return

    @property
    def remaining(self) -> tuple[str, ...]:
        return tuple(r for r in self.recipients if r not in self.outcomes or not self.outcomes[r].final)

    @property
    def in_doubt(self) -> tuple[str, ...]:
        return tuple(r for r in self.recipients if r in self.sending and r not in self.outcomes)


@attrs.define
class State:
    msgs: dict[int, Msg] = attrs.field(factory=dict)
    flights: dict[int, Flight] = attrs.field(factory=dict)  # start position -> attempt
    done: set[int] = attrs.field(factory=set)


class SpoolModel:
    def __init__(self, classes: int, *, hold_in_doubt: bool = True) -> None:
        self.classes = classes  # runner classes, new mail included
        self.hold_in_doubt = hold_in_doubt  # the engine's ``in_doubt = "hold"``: recovery holds them
        self.state = State()
        self.committed = State()

    # -- queries ----------------------------------------------------------------

    @property
    def msgs(self) -> dict[int, Msg]:
        return self.state.msgs

    @property
    def flights(self) -> dict[int, Flight]:
        return self.state.flights

    def in_flight(self) -> set[int]:
        return {f.mid for f in self.flights.values()}

    def eligible(self) -> set[int]:
        """Messages a runner may start: live, not held, not being delivered."""
        busy = self.in_flight()
        return {mid for mid, m in self.msgs.items() if not m.held and mid not in busy}

    # -- changes ------------------------------------------------------------------

    def enqueue(self, mid: int, recipients: tuple[str, ...], body: bytes, now: float) -> None:
        assert mid not in self.msgs and mid not in self.state.done, f"queue id {mid:X} reused"
        self.msgs[mid] = Msg(recipients, body, 0, False, now)

    def start(self, start_pos: int, mid: int) -> None:
        m = self.msgs[mid]
        assert start_pos not in self.flights
        self.flights[start_pos] = Flight(mid, m.recipients, m.klass, m.attempts)

    def record(self, start_pos: int, outcomes: dict[str, Status]) -> None:
        self.flights[start_pos].outcomes.update(outcomes)

    def send(self, start_pos: int, recipients: tuple[str, ...]) -> None:
        self.flights[start_pos].sending.update(recipients)

    def finish(self, start_pos: int) -> None:
        f = self.flights.pop(start_pos)
        remaining = f.remaining
        if remaining:
            m = self.msgs[f.mid]
            m.recipients = remaining
            base = min(f.attempts, self.classes - 1) if f.klass == 0 and f.attempts else f.klass
            m.klass = min(base + 1, self.classes - 1)
            m.attempts = f.attempts + 1
            m.in_doubt = m.in_doubt & set(remaining)
        else:
            self._done(f.mid)

    def _done(self, mid: int) -> None:
        del self.msgs[mid]
        self.state.done.add(mid)

    def hold(self, mid: int) -> None:
        m = self.msgs[mid]
        m.held, m.klass = True, HELD_CLASS

    def release(self, mid: int) -> None:
        m = self.msgs[mid]
        m.held, m.klass = False, 0

    def delete(self, mid: int) -> None:
        self._done(mid)

    def commit(self) -> None:
        self.committed = copy.deepcopy(self.state)

    def crash(self) -> tuple[int, int]:
        """Roll back to the last commit and recover. Returns (attempts in flight, recipients in doubt)."""
        self.state = copy.deepcopy(self.committed)
        in_flight = len(self.flights)
        doubt = 0
        for f in list(self.flights.values()):
            remaining = f.remaining
            doubt += len(f.in_doubt)
            if remaining:
                m = self.msgs[f.mid]
                m.recipients = remaining
                m.klass = f.klass
                m.in_doubt = (m.in_doubt | set(f.in_doubt)) & set(remaining)
                if f.in_doubt and self.hold_in_doubt:
                    m.held, m.klass = True, HELD_CLASS
            else:
                self._done(f.mid)
        self.flights.clear()
        self.commit()  # recovery commits what it wrote
        return in_flight, doubt
