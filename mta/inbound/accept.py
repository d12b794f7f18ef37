"""The accept loop: each connection a listener takes becomes a task of its own.

Why not ``trio.serve_listeners``: for every connection it does a checkpoint
after the accept (a pass of the scheduler) and, once the handler returns, an
``aclose_forcefully`` of a stream the session has already closed (a cancelled
cancel scope and another checkpoint), ~30 us of the event loop's CPU a
connection, which at 20 concurrent one-message sessions is ~5 % of the
relay's CPU a message. Here the loop waits until the listening
socket is readable, then takes every connection already queued (a burst of
clients costs one wake-up), and hands each handler the peer's address that
``accept`` returned (no ``getpeername`` a connection).

What ``serve_listeners`` guards against is kept: a full file table or
memory (EMFILE, ENFILE, ENOMEM, ENOBUFS) is logged and retried after 0.1 s,
any other error of the listening socket ends the loop (and the relay), and
the handler's stream is closed forcefully if the handler did not (it raised
before it closed it).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from mta.observe.logline import event

log = logging.getLogger("mta.smtpd")

# The errors of a listening socket that mean "out of a resource for now", not "broken" (as trio's list).
CAPACITY_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
CAPACITY_PAUSE: Final = 0.1  # seconds before accepting again after one of them
BURST: Final = 64  # connections taken at one wake-up before the loop lets the others run

Admit = Callable[[Any], object]
Handler = Callable[[trio.SocketStream, Any, Any], Awaitable[object]]


async def accept_loop(listener: trio.SocketListener, admit: Admit, handler: Handler) -> None:
    """Accept on ``listener`` forever; each connection runs ``handler(stream, peer_address, admit(peer_address))``
    in a task of its own.

    ``admit`` is called here, in the order the connections were accepted: tasks started together run in no
    set order, and the session limits are first come, first served. The handler owns the stream; if it
    returns with the socket still open, it is closed here.
    """
    async with trio.open_nursery() as nursery:
        tsock = listener.socket
        raw = getattr(tsock, "_sock", None)  # trio's socket wraps a stdlib one; without it, trio's own accept
        while True:
            if not isinstance(raw, socket.socket):
                stream = await listener.accept()
                try:
                    peer = stream.socket.getpeername()
                except OSError:  # the client has gone already: that connection only
                    await trio.aclose_forcefully(stream)
                    continue
                nursery.start_soon(_run, handler, stream, peer, admit(peer))
                continue
            await trio.lowlevel.wait_readable(tsock)
            for _ in range(BURST):
                try:
                    conn, peer = raw.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno not in CAPACITY_ERRNOS:
                        raise
                    event(log, "accept_failed", level=logging.ERROR, error=errno.errorcode[exc.errno],
                          retry_in=CAPACITY_PAUSE)
                    await trio.sleep(CAPACITY_PAUSE)
                    break
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
                nursery.start_soon(_run, handler, stream, peer, admit(peer))


async def _run(handler: Handler, stream: trio.SocketStream, peer: Any, admitted: object) -> None:
    try:
        await handler(stream, peer, admitted)
    finally:
        if stream.socket.fileno() != -1:
            await trio.aclose_forcefully(stream)
