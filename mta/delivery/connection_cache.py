"""Idle connections to next hops, kept a while for the next batch to the same hop (the SMTP transport's).

Why a module of its own: what is kept, for how long, and when it is closed is
one job; how a kept connection is checked and used is the transport's
(``mta.delivery.smtp_transport``). The cache holds any session that says how
long it sat idle and can close itself (``Cached``).
"""

from __future__ import annotations

import math
from typing import Generic, Protocol, TypeVar

import trio

from mta.delivery.transport import Destination

# A cached connection idle at least this long is checked with RSET before it carries mail; one idle less
# is checked without a round trip (nothing arrived on it while idle). Why: docs/design.md, "Reusing a connection".
PROBE_AFTER = 1.0


class Cached(Protocol):
    """What the cache needs of a session: where to say how long it was idle, and a close."""

    idled: float

    async def close(self) -> None: ...


S = TypeVar("S", bound=Cached)

CacheKey = tuple[Destination, str, int]  # the destination (its TLS mode included), the hop's address and port


class ConnectionCache(Generic[S]):
    """Idle connections to next hops, kept ``idle_limit`` seconds for the next batch to the same hop.

    Why: a relay that hands a smarthost one message at a time would otherwise
    pay a TCP connect, the greeting, EHLO (and a TLS handshake) and QUIT for
    every message: about an eighth of the relay's CPU with a lone client
    (docs/bench_relay.md), and as much again on the next hop. Postfix keeps
    such connections 2 s (smtp_connection_cache_time_limit); so do we.

    Nothing is cached until ``run`` runs: it closes (QUIT) what has been idle
    too long, so a connection is never left open on a quiet relay. A connection
    taken from the cache is checked before it carries mail (``SmtpTransport._connect``, smtp_transport.py):
    one on which the server said anything while it was idle is closed; one idle
    ``probe_after`` seconds or more is also checked with RSET (``_Session.alive``, smtp_transport.py);
    one idle less goes straight to MAIL, and if it dies before its first reply
    the batch goes over a new connection (``StaleConnection``): no message was
    sent on it. At most ``per_key`` connections wait per hop.

    Resource handling: connections in the cache belong to it; ``take`` hands
    one over to the caller, who closes it or gives it back with ``put``.
    """

    def __init__(self, idle_limit: float, per_key: int) -> None:
        self.idle_limit = idle_limit
        self.per_key = per_key
        self.running = False
        self.probe_after = PROBE_AFTER
        self.reused = 0  # connections taken from the cache and found alive (tests, benchmarks)
        self.probed = 0  # of those, checked with an RSET
        self.stale = 0  # connections reused without an RSET that died before their first reply
        self._idle: dict[CacheKey, list[tuple[float, S]]] = {}
        self._changed = trio.Event()
        self._wake_at = math.inf  # when the keeper next looks without being told (inf: it sleeps until told)

    def __len__(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def put(self, key: CacheKey, session: S) -> bool:
        """Keep ``session`` (True), or refuse it (False: the caller closes it)."""
        if not self.running or self.idle_limit <= 0 or len(self._idle.get(key, ())) >= self.per_key:
            return False
        self._idle.setdefault(key, []).append((trio.current_time(), session))
        if self._wake_at == math.inf:
            # The keeper sleeps with nothing to expire: it must learn of this one. Otherwise it wakes for an
            # older one first (a new connection expires last) and sees this one then: no task switch per put.
            self._changed.set()
        return True

    def take(self, key: CacheKey) -> S | None:
        """The connection to this hop that was idle the shortest time, if it is still within the limit."""
        waiting = self._idle.get(key)
        if not waiting:
            return None
        idled = trio.current_time() - waiting[-1][0]
        if idled >= self.idle_limit:
            return None  # an expired one stays for run() to close
        session = waiting.pop()[1]
        session.idled = idled
        return session

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close connections idle for ``idle_limit``; caching is on while this runs."""
        self.running = True
        task_status.started()
        try:
            while True:
                now = trio.current_time()
                expired: list[S] = []
                for key, waiting in list(self._idle.items()):
                    keep = [(t, sess) for t, sess in waiting if now - t < self.idle_limit]
                    expired += [sess for t, sess in waiting if now - t >= self.idle_limit]
                    if keep:
                        self._idle[key] = keep
                    else:
                        del self._idle[key]
                for session in expired:
                    await session.close()
                oldest = min((t for waiting in self._idle.values() for t, _ in waiting), default=None)
                self._changed = trio.Event()
                self._wake_at = math.inf if oldest is None else oldest + self.idle_limit
                with trio.move_on_at(self._wake_at):
                    await self._changed.wait()
        finally:
            self.running = False
