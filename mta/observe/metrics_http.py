"""The Prometheus endpoint, served by the relay's own event loop with bounded work per scraper.

Why not prometheus_client's ``start_http_server``: it starts a thread per
connection, with no limit and no deadline, so anyone who can reach the port
can pile up threads by opening connections and sending nothing.

Here the relay's trio loop serves the endpoint itself:

- At most ``metrics_max_connections`` requests are served at once. The
  listener accepts a connection only when a slot is free; the others wait in
  the kernel's listen backlog (bounded by the kernel), costing the relay
  nothing.
- Each request has ``metrics_timeout`` in all: to send its request head (at
  most ``MAX_HEAD`` bytes) and to read the answer. Then the connection is
  closed, whatever state it is in.
- Each request is its own unit of failure: a malformed request gets a 400, a
  peer that resets gets nothing, and an unexpected exception (in a collector,
  say) is logged with the client's address and ends that request only.

The body is prometheus_client's own WSGI app (``make_wsgi_app``), called
in-line: it does the content negotiation (text or OpenMetrics, gzip, the
``name[]`` filter) and takes well under a millisecond for the relay's few
dozen series. One request per connection, ``Connection: close``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

import trio
from prometheus_client import make_wsgi_app

from mta.observe import readiness
from mta.observe.bounded_accept import BoundedAccept

log = logging.getLogger("mta.metrics")

MAX_HEAD = 8192  # request line and headers; a scraper sends a few hundred bytes


class BadRequest(ValueError):
    """The request head cannot be served; ``status`` is the HTTP answer."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


class MetricsServer:
    """Serves ``registry`` over HTTP: at most ``max_connections`` at once (``accept``), ``timeout`` seconds each."""

    def __init__(self, registry: Any, *, max_connections: int, timeout: float,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.app = make_wsgi_app(registry)
        self.ready = ready  # ``GET /ready`` (``mta.observe.readiness``)
        self.timeout = timeout
        self.accept = BoundedAccept("metrics endpoint", max_connections, self._handle)
        self.serve = self.accept.serve

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(self.timeout):
                await self._exchange(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass  # the scraper went away
        except Exception:
            log.exception("metrics request from %s failed", _peer(stream))

    async def _exchange(self, stream: trio.SocketStream) -> None:
        try:
            environ = _environ(await _read_head(stream))
        except BadRequest as e:
            await stream.send_all(_response(e.status, [("Content-Type", "text/plain")], [e.status.encode() + b"\n"]))
            return
        if environ["PATH_INFO"] == readiness.READY_PATH:
            status, headers, payload = readiness.answer(self.ready(), environ["REQUEST_METHOD"])
            await stream.send_all(_response(status, headers, [payload]))
            return
        status_headers: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]]) -> None:
            status_headers[:] = [status, headers]

        try:
            body = self.app(environ, start_response)
        except Exception:
            log.exception("metrics request from %s failed", _peer(stream))
            body, status_headers[:] = [b"the metrics could not be collected\n"], ["500 Internal Server Error", []]
        await stream.send_all(_response(status_headers[0], status_headers[1], body))


async def _read_head(stream: trio.SocketStream) -> bytes:
    buf = bytearray()
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        if len(buf) > MAX_HEAD:
            raise BadRequest("431 Request Header Fields Too Large")
        data = await stream.receive_some(4096)
        if not data:
            break
        buf += data
    return bytes(buf[:MAX_HEAD + 4])


def _environ(head: bytes) -> dict[str, str]:
    """The WSGI environ prometheus_client's app reads: method, path, query and the two Accept headers."""
    lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest("400 Bad Request")
    method, target, _ = parts
    path, _, query = target.partition("?")
    environ = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in ("accept", "accept-encoding"):
            environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
    return environ


def _response(status: str, headers: list[tuple[str, str]], body: Iterable[bytes]) -> bytes:
    payload = b"".join(body)
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers),
             f"Content-Length: {len(payload)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + payload


def _peer(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:
        return "?"
