"""A small HTTPS server for tests: MTA-STS policies by Host name, on 127.0.0.1, its certificate from trustme.

h11 parses the requests (as the relay's fetch does the answers); every
request is answered and the connection closed. ``policies`` maps a host name
(``mta-sts.example.test``) to the body served at ``/.well-known/mta-sts.txt``;
a host not in it gets 404. ``requests`` lists the (host, target) asked for.

    server = PolicyServer(ca.issue_cert("mta-sts.a.test", "mta-sts.b.test"))
    port = await nursery.start(server.serve)
"""

from __future__ import annotations

import functools
import ssl

import h11
import trio
import trustme


class PolicyServer:
    def __init__(self, cert: trustme.LeafCert) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(self.ctx)
        self.policies: dict[str, str] = {}
        self.content_type = "text/plain"
        self.requests: list[tuple[str, str]] = []
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = int(listeners[0].socket.getsockname()[1])
        task_status.started(self.port)
        await trio.serve_listeners(functools.partial(self._handle), listeners)

    async def _handle(self, tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, self.ctx, server_side=True, https_compatible=True)
        try:
            with trio.fail_after(30):
                await self._answer(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, ssl.SSLError,
                h11.RemoteProtocolError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _answer(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
                continue
            if isinstance(ev, h11.Request):
                host = dict(ev.headers).get(b"host", b"").decode().partition(":")[0]
                target = ev.target.decode()
                self.requests.append((host, target))
                body = self.policies.get(host) if target == "/.well-known/mta-sts.txt" else None
                status, data = (200, body.encode()) if body is not None else (404, b"not here\n")
                headers = [("Content-Type", self.content_type if status == 200 else "text/plain"),
                           ("Content-Length", str(len(data))), ("Connection", "close")]
                out = conn.send(h11.Response(status_code=status, headers=headers))
                out += conn.send(h11.Data(data=data)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                return
            if isinstance(ev, h11.ConnectionClosed):
                return
