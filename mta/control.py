"""The control socket: how ``mta queue ...`` reaches a running relay.

A Unix socket (mode 0600, in the spool directory by default) speaking one
JSON object per line: one request, one answer, then the connection closes.
Only the relay writes the spool, so every change an operator makes goes
through here and into the log like any other record.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import trio

from mta.config import Config
from mta.queue_ops import CHANGES, RequestError, change_op, read_op
from spool import admin
from spool.commit import AsyncSpool
from spool.errors import SpoolError

log = logging.getLogger("mta.control")
MAX_REQUEST = 64 * 1024


def socket_path(config: Config) -> str:
    return config.server.control_socket or os.path.join(config.spool.dir, "control.sock")


class ControlServer:
    """One shard's control socket: its ids are ``HEX-K`` for shard K >= 1 (``mta.shards``)."""

    def __init__(self, aspool: AsyncSpool, config: Config, shard: int = 0) -> None:
        self.aspool = aspool
        self.path = socket_path(config)
        self.shard = shard

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            os.unlink(self.path)  # left by a previous life of the relay: we hold the spool lock now
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self.handle, [listener])

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(30):
                raw = await self._read_line(stream)
                answer = await self.answer(raw)
                await stream.send_all(json.dumps(answer).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _read_line(self, stream: trio.SocketStream) -> bytes:
        buf = bytearray()
        while b"\n" not in buf:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_REQUEST:
                raise RequestError("request too large")
        return bytes(buf.split(b"\n", 1)[0])

    async def answer(self, raw: bytes) -> dict[str, Any]:
        try:
            req = json.loads(raw)
            if not isinstance(req, dict):
                raise RequestError("a request is a JSON object")
            result = await self.dispatch(req)
            return {"ok": True, **result}
        except (RequestError, SpoolError, ValueError) as exc:
            return {"ok": False, "error": str(exc)}

    async def dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        core = self.aspool.core
        await self.aspool.commit()  # what finished a moment ago is durable, so the walk sees it
        if req.get("op") in CHANGES:
            return await change_op(req, self._apply, self._deferred_ids, self.shard)
        return await trio.to_thread.run_sync(lambda: read_op(core, req, core.read_body, self.shard))

    async def _apply(self, op: str, mid: int) -> bool:
        msg = await self.aspool.find(mid)
        if (op == "hold" and msg.held) or (op == "release" and not msg.held) or \
                (op == "flush" and (msg.held or msg.klass == 0)):
            return False
        await getattr(self.aspool, op)(mid)
        return True

    async def _deferred_ids(self) -> AsyncIterator[int]:
        core = self.aspool.core
        cursor: int | None = None
        while True:
            msgs, cursor = await trio.to_thread.run_sync(admin.page, core, None, cursor, 1000)
            for m in msgs:
                if m.state == "queued" and m.klass > 0:
                    yield m.message_id
            if cursor is None:
                return
