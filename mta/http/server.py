"""The HTTP API listener: h11 (the sans-IO HTTP/1.1 core) over trio, with bounded work per connection.

- At most ``max_connections`` connections are served at once; the listener
  accepts only when a slot is free, the others wait in the kernel's backlog.
- Each request has ``timeout`` seconds in all (head, body, the commit, the
  answer); then the connection is closed. Keep-alive: the next request on a
  connection gets a new deadline.
- A body is read only after its head passed: the route, the token
  (``401``), the declared size (``413`` before a byte of it is read; a
  chunked body is counted and cut at the limit), and the disk (``503`` with
  ``Retry-After`` while the spool is short of room, as SMTP answers 452).
  Nothing is buffered beyond ``max_request_size``.
- Each connection is its own unit of failure: a malformed request gets a 400
  and the connection is closed, a peer that resets gets nothing, and an
  unexpected exception is logged with the client's address and answered 500,
  ending that connection only.
"""

from __future__ import annotations

import logging
import ssl
from http import HTTPStatus
from typing import Any

import h11
import trio

from mta.containment import is_fatal
from mta.http.idempotency import KeyMismatch
from mta.http.inject import Injector, Outcome, dumps
from mta.http.inject_request import BadInjection, check_key
from mta.http.metrics import ApiMetrics
from mta.http.tokens import Tokens
from mta.inbound.disk import DiskCheck
from mta.observe.bounded_accept import BoundedAccept
from spool import DiskFull

__all__ = ["ApiServer"]

log = logging.getLogger("mta.http")

INJECT_PATH = b"/api/inject/v1"
MAX_HEAD = 16384
RETRY_AFTER = "10"  # seconds: the SMTP side's 452 is retried by clients within minutes; an API client sooner
SERVER = "logspool"


class _Refused(Exception):
    """An answer decided before the body was read; the connection is closed after it."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.status)
        self.outcome = outcome


def _error(status: int, text: str, *headers: tuple[str, str]) -> Outcome:
    return Outcome(status, {"error": text}, headers)


class ApiServer:
    """Serves ``POST /api/inject/v1``, at most ``max_connections`` at once (``accept``)."""

    def __init__(self, injector: Injector, tokens: Tokens, disk: DiskCheck, *, max_connections: int,
                 timeout: float, max_request_size: int, metrics: ApiMetrics | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.injector = injector
        self.metrics = metrics if metrics is not None else ApiMetrics(None)
        self.ssl_context = ssl_context  # replaced on reload (a renewed certificate): new connections take it
        self.tokens = tokens
        self.disk = disk
        self.timeout = timeout
        self.max_request_size = max_request_size
        self.accept = BoundedAccept("HTTP API", max_connections, self._handle)
        self.serve = self.accept.serve

    async def _handle(self, sock: trio.SocketStream) -> None:
        client = _peer(sock)
        stream: trio.abc.Stream = sock
        try:
            if self.ssl_context is not None:
                tls = trio.SSLStream(sock, self.ssl_context, server_side=True)
                with trio.move_on_after(self.timeout) as handshake:
                    await tls.do_handshake()
                if handshake.cancelled_caught:
                    return  # no handshake within the deadline: closed
                stream = tls
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
            while True:
                with trio.move_on_after(self.timeout):
                    if not await self._one(stream, conn, client):
                        return
                    continue
                return  # the deadline passed: the connection is closed whatever its state
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass  # a TLS client that fails the handshake lands here too: its connection only
        except Exception:
            log.exception("HTTP API request from %s failed", client)

    async def _one(self, stream: trio.abc.Stream, conn: h11.Connection, client: str) -> bool:
        """One request and its answer; whether the connection may carry another."""
        try:
            request = await _next(stream, conn)
            if request is None:
                return False
            outcome = await self._answer(stream, conn, request, client)
        except h11.RemoteProtocolError as exc:
            if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
                return False
            outcome = _error(exc.error_status_hint, f"bad request: {exc}")
        except _Refused as refused:
            outcome = refused.outcome
        except Exception as exc:
            if is_fatal(exc):  # a failed fsync ends the relay, as at every other boundary
                raise
            log.exception("HTTP API request from %s failed", client)
            outcome = _error(500, "internal error; the request may be retried")
        self.metrics.answered(outcome.status, int(outcome.body.get("success_count", 0) or 0))
        await _send(stream, conn, outcome)
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
            return False
        conn.start_next_cycle()
        return True

    async def _answer(self, stream: trio.abc.Stream, conn: h11.Connection, request: h11.Request,
                      client: str) -> Outcome:
        headers = {name.lower(): value for name, value in request.headers}
        path = request.target.split(b"?", 1)[0]
        if path != INJECT_PATH:
            raise _Refused(_error(404, "no such endpoint; the API is POST /api/inject/v1"))
        if request.method != b"POST":
            raise _Refused(_error(405, "POST only", ("Allow", "POST")))
        if not self.tokens.accepts(headers.get(b"authorization")):
            raise _Refused(_error(401, "a valid bearer token is needed", ("WWW-Authenticate", 'Bearer')))
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.max_request_size:
            raise _Refused(_error(413, f"the body is larger than this relay takes ({self.max_request_size} bytes)"))
        if not self.disk.ok():
            raise _Refused(_error(503, "insufficient system storage, try again later", ("Retry-After", RETRY_AFTER)))
        try:
            key = check_key(headers.get(b"idempotency-key"))
        except BadInjection as exc:
            raise _Refused(_error(400, str(exc))) from None
        body = await _body(stream, conn, self.max_request_size)
        try:
            return await self.injector.inject(body, key, client)
        except BadInjection as exc:
            return _error(400, str(exc))
        except KeyMismatch as exc:
            return _error(422, str(exc))
        except DiskFull:
            return _error(503, "insufficient system storage, try again later", ("Retry-After", RETRY_AFTER))


async def _next(stream: trio.abc.Stream, conn: h11.Connection) -> h11.Request | None:
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            conn.receive_data(bytes(data))
            continue
        if isinstance(ev, h11.Request):
            return ev
        return None  # ConnectionClosed, or PAUSED after an answer we sent while they had more


async def _body(stream: trio.abc.Stream, conn: h11.Connection, limit: int) -> bytes:
    if conn.they_are_waiting_for_100_continue:  # curl's Expect: 100-continue for bodies over 1 KiB
        await stream.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
    parts: list[bytes] = []
    size = 0
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(65536)))
        elif isinstance(ev, h11.Data):
            size += len(ev.data)
            if size > limit:
                raise _Refused(_error(413, f"the body is larger than this relay takes ({limit} bytes)"))
            parts.append(bytes(ev.data))
        elif isinstance(ev, h11.EndOfMessage):
            return b"".join(parts)
        else:
            raise h11.RemoteProtocolError("the request ended before its body", 400)


async def _send(stream: trio.abc.Stream, conn: h11.Connection, outcome: Outcome) -> None:
    if conn.our_state is not h11.SEND_RESPONSE:
        return
    payload = dumps(outcome.body)
    headers: list[tuple[str, str]] = [("Content-Type", "application/json"), ("Content-Length", str(len(payload))),
                                      ("Server", SERVER), *outcome.headers]
    if conn.their_state is not h11.DONE:  # answered before its body was read: close, do not drain it
        headers.append(("Connection", "close"))
    reason = HTTPStatus(outcome.status).phrase.encode()
    data: Any = conn.send(h11.Response(status_code=outcome.status, headers=headers, reason=reason))
    data += conn.send(h11.Data(data=payload))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)


def _peer(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:
        return "?"


