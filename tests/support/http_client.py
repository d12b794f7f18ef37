"""A small HTTP/1.1 client for tests of the relay's HTTP API: h11 over a real trio TCP connection.

One request per connection (``Connection: close``) unless a test passes its
own stream; every read is bounded by the caller's deadline.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import h11
import trio


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def request(port: int, method: str, target: str, body: bytes = b"", *, headers: dict[str, str] | None = None,
                  timeout: float = 60) -> Response:
    """One request to 127.0.0.1:``port`` and its whole answer (the connection closed after it)."""
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            hdrs = [("Host", "relay.test"), ("Connection", "close"), ("Content-Length", str(len(body))),
                    *(headers or {}).items()]
            data = conn.send(h11.Request(method=method, target=target, headers=hdrs))
            try:
                await stream.send_all(data + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            except trio.BrokenResourceError:
                pass  # answered (413, 401) and closed before the whole body was sent: read the answer
            return await _response(stream, conn)


async def _response(stream: trio.SocketStream, conn: h11.Connection) -> Response:
    status, headers, parts = 0, {}, []
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive_some(65536))
            except trio.BrokenResourceError:
                conn.receive_data(b"")
            continue
        if isinstance(ev, h11.Response):
            status = ev.status_code
            headers = {k.decode().lower(): v.decode() for k, v in ev.headers}
        elif isinstance(ev, h11.Data):
            parts.append(bytes(ev.data))
        elif isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed):
            return Response(status, headers, b"".join(parts))


async def inject(port: int, payload: Any, *, token: str | None = "secret-token", key: str | None = None,
                 timeout: float = 60) -> Response:
    """``POST /api/inject/v1`` with ``payload`` as JSON."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if key is not None:
        headers["Idempotency-Key"] = key
    return await request(port, "POST", "/api/inject/v1", json.dumps(payload).encode(), headers=headers,
                         timeout=timeout)
