"""One policy server, over TCP or a unix socket: a request in, its reply out, connections kept for the next.

Resource handling: connections are kept idle (at most ``MAX_IDLE_CONNECTIONS``,
each for at most ``max_idle`` seconds) and reused, as Postfix's smtpd keeps
its policy connections; a connection that broke, timed out or sent something
that is not the protocol is closed and never reused. A reused connection that
the server closed meanwhile is found out on the first read and the request is
sent once more on a new connection.

Failures: everything a server can do wrong (refuse the connection, hang,
close, send garbage) is ``PolicyUnavailable`` with a one-line reason; the
caller applies its failure default. Nothing waits longer than ``timeout``
for one request, connecting included.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping

import attrs
import trio

from mta.config.policy import PolicyAddress
from mta.policy.codec import PolicyProtocolError, ReplyParser, encode_request

__all__ = ["MAX_IDLE_CONNECTIONS", "PolicyClient", "PolicyUnavailable"]

MAX_IDLE_CONNECTIONS = 16
READ_SIZE = 4096


class PolicyUnavailable(Exception):
    """No usable reply from a policy server (down, slow, broken); ``str`` is the reason, one line."""


@attrs.define
class _Connection:
    stream: trio.abc.Stream
    parser: ReplyParser
    idle_since: float = 0.0


class PolicyClient:
    """The client of one policy server (its ``address``); made and used inside one trio loop."""

    def __init__(self, address: PolicyAddress, timeout: float, max_idle: float) -> None:
        self.address = address
        self.timeout = timeout
        self.max_idle = max_idle
        self._idle: list[_Connection] = []

    async def ask(self, attributes: Mapping[str, str]) -> dict[str, str]:
        """The server's reply to one request, as attributes.

        Raises PolicyUnavailable (after at most ``timeout``).
        """
        request = encode_request(attributes)
        with trio.move_on_after(self.timeout):
            try:
                conn = self._reusable()
                if conn is not None:
                    try:
                        return await self._exchange(conn, request)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, _Closed):
                        pass  # closed by the server while idle: once more, on a new connection
                return await self._exchange(await self._connect(), request)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
                raise PolicyUnavailable(f"{self.address}: {exc.strerror or exc}"
                                        if isinstance(exc, OSError) else f"{self.address}: connection broken"
                                        ) from None
            except (_Closed, PolicyProtocolError) as exc:
                raise PolicyUnavailable(f"{self.address}: {exc}") from None
        raise PolicyUnavailable(f"{self.address}: no reply within {self.timeout:g}s")

    def _reusable(self) -> _Connection | None:
        """The most recently used idle connection still within ``max_idle``; older ones are closed."""
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since <= self.max_idle:
                return conn
            _close(conn)
        return None

    async def _connect(self) -> _Connection:
        if self.address.path:
            stream: trio.abc.Stream = await trio.open_unix_socket(self.address.path)
        else:
            stream = await trio.open_tcp_stream(self.address.host, self.address.port)
        return _Connection(stream, ReplyParser())

    async def _exchange(self, conn: _Connection, request: bytes) -> dict[str, str]:
        """Send one request on ``conn`` and read its reply; ``conn`` goes back to the idle list only if the
        exchange ended cleanly, else it is closed (a cancellation included)."""
        done = False
        try:
            if conn.parser.pending:
                raise PolicyProtocolError("the server sent bytes nobody asked for")
            await conn.stream.send_all(request)
            while (reply := conn.parser.next_reply()) is None:
                data = await conn.stream.receive_some(READ_SIZE)
                if not data:
                    raise _Closed("the server closed the connection before its reply ended")
                conn.parser.feed(data)
            done = True
            return reply
        finally:
            if done and len(self._idle) < MAX_IDLE_CONNECTIONS:
                conn.idle_since = trio.current_time()
                self._idle.append(conn)
            else:
                _close(conn)

    def close(self) -> None:
        """Close the idle connections (a reload or a test's end)."""
        while self._idle:
            _close(self._idle.pop())


class _Closed(Exception):
    """The server closed a connection where a reply was due."""


def _close(conn: _Connection) -> None:
    """Close without waiting: a plain socket's close cannot block."""
    socket = getattr(conn.stream, "socket", None)
    if socket is not None:
        socket.close()
