"""Planned stops and reloads of a running relay: SIGTERM drains, SIGHUP reloads, systemd is told.

Theory of operation
-------------------
Crash-only stays the rule: nothing here is needed for correctness, and a
kill -9 at any instant (during a drain or a reload too) leaves a spool the
next start recovers. What this adds is politeness to the peers.

SIGTERM: the listeners keep accepting, but each new connection gets
``421 4.3.2`` and is closed; a session between transactions gets
``421 4.3.2`` at once; a session inside a transaction finishes it and gets
``421 4.3.2`` at its next MAIL. The scheduler claims nothing more and
delivers what it had claimed. When both are done, or at ``[server]
drain_timeout``, the process logs the counts and ends with ``os._exit(0)``:
what is still running then ends exactly as a crash ends it.

SIGHUP (and ``mta reload``, which sends it): ``mta.process.reload``.

systemd: with ``NOTIFY_SOCKET`` set, ``READY=1`` once the listeners are up,
``STOPPING=1`` when a drain begins, ``RELOADING=1`` then ``READY=1`` around a
reload (``notify``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING

import trio

from mta.observe.logline import event
from mta.process.reload import reload

if TYPE_CHECKING:
    from mta.process.relay import Relay

log = logging.getLogger("mta")

DRAIN_POLL = 0.02  # seconds between looks at what is still in flight during a drain


def notify(state: str) -> bool:
    """Send ``state`` (``READY=1``...) to the service manager at ``$NOTIFY_SOCKET``; False if there is none.

    A leading ``@`` names a socket in the abstract namespace. A manager that
    is gone is not our failure: the error is logged once here and ignored.
    """
    where = os.environ.get("NOTIFY_SOCKET")
    if not where:
        return False
    address = "\0" + where[1:] if where.startswith("@") else where
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("cannot notify the service manager at %s (%s): %s", where, state, exc.strerror or exc)
        return False
    return True


class Lifecycle:
    """The relay's signal handling: one task that owns SIGTERM and SIGHUP for the process."""

    def __init__(self, relay: Relay, drain_timeout: float) -> None:
        self.relay = relay
        self.drain_timeout = drain_timeout
        self.draining = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
            task_status.started()
            async with trio.open_nursery() as nursery:
                async for signum in signals:
                    if signum == signal.SIGTERM and not self.draining:
                        self.draining = True
                        nursery.start_soon(self.drain)
                    elif signum == signal.SIGHUP and not self.draining:
                        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
                        notify(f"RELOADING=1\nMONOTONIC_USEC={now_usec}")
                        reload(self.relay)
                        notify("READY=1")

    async def drain(self) -> None:
        """Stop taking work, let what is in flight finish within the deadline, log the counts, exit 0."""
        relay = self.relay
        server, scheduler = relay.server, relay.scheduler
        assert server is not None
        started = time.monotonic()
        sessions, deliveries = server.in_transaction(), scheduler.in_flight
        delivered_before = scheduler.delivered
        notify("STOPPING=1")
        event(log, "drain_start", signal="SIGTERM", deadline=f"{self.drain_timeout:g}s", transactions=sessions,
              deliveries=deliveries)
        server.drain()
        scheduler.drain()
        with trio.move_on_after(self.drain_timeout):
            # Two counts owned by the server and the scheduler, polled at DRAIN_POLL for the drain alone.
            while server.in_transaction() or not scheduler.idle():  # noqa: ASYNC110
                await trio.sleep(DRAIN_POLL)
        left_sessions, left_deliveries = server.in_transaction(), scheduler.in_flight
        event(log, "drain_end", level=logging.WARNING if left_sessions or left_deliveries else logging.INFO,
              seconds=f"{time.monotonic() - started:.2f}", transactions_in_flight_at_start=sessions,
              delivered=scheduler.delivered - delivered_before, transactions_cut=left_sessions,
              deliveries_cut=left_deliveries,
              status="exiting" if not (left_sessions or left_deliveries) else "deadline reached, exiting as a crash")
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(0)
