"""A listener that accepts a connection only while a slot is free, for the relay's HTTP endpoints.

Why: the metrics endpoint, the event stream and the injection API are served
by the relay's own event loop, so what a client can make the relay hold must
be bounded. A connection is accepted only when one of ``max_connections``
slots is free; the others wait in the kernel's listen backlog, costing the
relay nothing. A failed accept (out of descriptors or memory) waits
``ACCEPT_BACKOFF`` and tries again: the endpoint pauses, the relay goes on.
Each connection is its handler's unit of failure: the slot comes back and
the stream is closed whatever the handler did.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from mta.config import ListenAddress

log = logging.getLogger("mta.http")

ACCEPT_BACKOFF = 0.1  # seconds to wait after a failed accept (EMFILE and the like) before the next


class BoundedAccept:
    """Serves ``handle`` on each accepted connection, at most ``max_connections`` at once.

    ``active`` is the number of connections being served and ``peak`` the
    most there ever were at once (tests read them).
    """

    def __init__(self, what: str, max_connections: int,
                 handle: Callable[[trio.SocketStream], Awaitable[None]]) -> None:
        self.what = what  # "metrics endpoint": how a log line names it
        self.handle = handle
        self._slots = trio.Semaphore(max_connections)
        self.active = 0
        self.peak = 0

    async def serve(self, address: ListenAddress, *,
                    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(address.port, host=address.host)
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            task_status.started(listeners)

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            await self._slots.acquire()
            try:
                stream = await listener.accept()
            except OSError as e:
                self._slots.release()
                log.warning("%s cannot accept: %s", self.what, e.strerror or e)
                await trio.sleep(ACCEPT_BACKOFF)
                continue
            self.active += 1
            self.peak = max(self.peak, self.active)
            nursery.start_soon(self._served, stream)

    async def _served(self, stream: trio.SocketStream) -> None:
        try:
            await self.handle(stream)
        finally:
            self.active -= 1
            self._slots.release()
            await trio.aclose_forcefully(stream)
