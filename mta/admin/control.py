"""The control socket: how ``mta queue ...`` reaches a running relay.

A Unix socket (mode 0600, in the spool directory by default) speaking one
JSON object per line: one request, one answer, then the connection closes.
Only the relay writes the spool, so every change an operator makes goes
through here and into the log like any other record.

Every request is checked field by field (``mta.admin.queue_ops.parse_request``)
before anything runs: a line that is not UTF-8 JSON, a number that overflows
(``1e400``), a field of the wrong type or range, or a line over 64 KiB gets
``{"ok": false, "error": ..., "code": "bad_request"}``. ``code`` says what
kind of failure it is, for the client to tell its operator (``ERROR_CODES``).
One request is the unit that fails: an
unexpected exception while serving it is logged once with its traceback and
answered with an error, and the relay goes on (``ControlServer.handle``).

Every request is logged once (``event=admin``): the operation, the ids it
named, what came of it, and who asked: the uid and pid of the client
process, from the kernel (SO_PEERCRED), not from anything the client says.
Changes (hold, release, delete, flush) and refused requests are logged at
INFO, reads at DEBUG.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import trio

from mta.admin.queue_ops import (
    CHANGES,
    Request,
    RequestError,
    change_op,
    parse_request,
    read_op,
    selection_batches,
    shown,
)
from mta.config import Config
from mta.observe.logline import event
from spool import AsyncSpool, NotFound, SpoolError
from spool import listing as admin

log = logging.getLogger("mta.control")
MAX_REQUEST = 64 * 1024
MAX_DISCARD = 16 * MAX_REQUEST  # what is read and dropped of an over-long request before its error is answered
REQUEST_TIMEOUT = 30.0  # a client that has not sent its line and read its answer by then is dropped
SELECTION_TIMEOUT = 3600.0  # a selection's change, batch by batch over the whole queue: its own, longer deadline
# The ``code`` of an error answer: a malformed request, no such message, a spool error (busy, disk), a bug.
SELECTION_BATCH = 200  # messages changed between two commits (and two turns of the loop) by a selection
ERROR_CODES = ("bad_request", "not_found", "failed", "internal")


def socket_path(config: Config) -> str:
    return config.server.control_socket or os.path.join(config.spool.dir, "control.sock")


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    """The first line (without its LF), or all that came before EOF.

    An over-long line is read to its end (up to ``MAX_DISCARD`` bytes) and
    dropped before the error is answered, so a client that writes its whole
    request before it reads gets the answer rather than a reset connection.

    Raises:
        RequestError: more than ``MAX_REQUEST`` bytes without a line end.
    """
    buf = bytearray()
    while b"\n" not in buf and len(buf) <= MAX_REQUEST:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        buf += chunk
    line, newline, _ = bytes(buf).partition(b"\n")
    if len(line) <= MAX_REQUEST:
        return line
    seen = len(buf)
    while not newline and seen <= MAX_DISCARD:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        newline = b"\n" if b"\n" in chunk else b""
        seen += len(chunk)
    raise RequestError(f"request too large (over {MAX_REQUEST} bytes)")


def _no_constant(name: str) -> Any:
    raise RequestError(f"{name} is not a number here")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestError(f"number out of range: {shown(text)}")
    return value


def decode(raw: bytes) -> Any:
    """One UTF-8 JSON value; NaN, Infinity and numbers that overflow a float (``1e400``) are refused.

    Raises:
        RequestError: anything that is not such a value.
    """
    try:
        return json.loads(raw.decode("utf-8"), parse_float=_finite, parse_constant=_no_constant)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError("request nested too deeply") from None
    except ValueError as exc:  # bad UTF-8, bad JSON, an integer of thousands of digits
        raise RequestError(f"not a JSON request: {exc}") from None


def encode(answer: dict[str, Any]) -> bytes:
    return json.dumps(answer, allow_nan=False).encode() + b"\n"


def error_answer(message: str, code: str) -> dict[str, Any]:
    return {"ok": False, "error": message, "code": code}


def internal_error(exc: BaseException) -> dict[str, Any]:
    return error_answer(f"internal error ({type(exc).__name__}); see the relay's log", "internal")


def peer_credentials(stream: trio.SocketStream) -> tuple[int, int] | None:
    """``(uid, pid)`` of the process at the other end of the Unix socket, from the kernel; None where unknown."""
    option = getattr(socket, "SO_PEERCRED", None)  # Linux
    if option is None:
        return None
    try:
        raw = stream.socket.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
    except (OSError, struct.error):
        return None
    return uid, pid


def log_request(req: Request | None, answer: dict[str, Any], peer: tuple[int, int] | None) -> None:
    """The admin line: ``event=admin command=hold ids=... uid=... peer_pid=... result=ok done=... failed=...``."""
    changes = req is not None and req.op in CHANGES
    ok = bool(answer.get("ok"))
    ids = list(req.ids) if req is not None and req.ids else [req.id] if req is not None and req.id else []
    done = answer.get("done")
    select = req.select if req is not None else None
    everything = changes and not ids and (select is None or select == admin.Filter())
    event(log, "admin", ids[0] if len(ids) == 1 else None,
          level=logging.INFO if changes or not ok else logging.DEBUG,
          command=req.op if req is not None else "-", ids=ids or None, all=everything or None,
          domain=select.domain if select else None, sender=select.sender if select else None,
          in_doubt=(select.in_doubt or None) if select else None,
          uid=peer[0] if peer else None, peer_pid=peer[1] if peer else None,
          result="ok" if ok else str(answer.get("code", "failed")),
          done=done if isinstance(done, int) else list(done) if isinstance(done, list) and done else None,
          skipped=_ids_or_count(answer.get("skipped")), failed=answer.get("failed") or
          list(answer.get("errors") or {}) or None,
          error=None if ok else str(answer.get("error", "")))


def _ids_or_count(value: Any) -> Any:
    return value or None if isinstance(value, int) else list(value or []) or None


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
        # Linux gives the socket file the mode of the unbound socket: 0600 from its first instant,
        # whatever the umask (the chmod after bind covers systems that ignore this).
        os.fchmod(sock.fileno(), 0o600)
        await sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self.handle, [listener])

    async def handle(self, stream: trio.SocketStream) -> None:
        """One request, one answer: the boundary where a control request fails alone.

        Whatever goes wrong inside one request (a bug included) is logged once
        with its traceback and answered with an error; the relay goes on.
        """
        try:
            with trio.move_on_after(REQUEST_TIMEOUT) as deadline:
                await stream.send_all(encode(await self.serve_one(stream, peer_credentials(stream), deadline)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client left before its answer
        except Exception as exc:
            log.exception("control request failed; the relay goes on")
            with trio.move_on_after(1):
                try:
                    await stream.send_all(encode(internal_error(exc)))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        finally:
            await trio.aclose_forcefully(stream)

    async def serve_one(self, stream: trio.abc.ReceiveStream, peer: tuple[int, int] | None = None,
                        deadline: trio.CancelScope | None = None) -> dict[str, Any]:
        """The answer to the one request on ``stream`` (logged, with ``peer``'s uid and pid); the client's
        mistakes are answers, not exceptions. A change of a selection (every message of a large queue,
        perhaps) gets ``SELECTION_TIMEOUT`` rather than ``REQUEST_TIMEOUT`` on ``deadline``."""
        req: Request | None = None
        try:
            req = parse_request(decode(await read_line(stream)))
            if deadline is not None and req.op in CHANGES and not req.ids:
                deadline.deadline = max(deadline.deadline, trio.current_time() + SELECTION_TIMEOUT)
            answer = {"ok": True, **await self.dispatch(req)}
        except RequestError as exc:
            answer = error_answer(str(exc), "bad_request")
        except NotFound as exc:
            answer = error_answer(str(exc), "not_found")
        except SpoolError as exc:
            answer = error_answer(str(exc), "failed")
        log_request(req, answer, peer)
        return answer

    async def dispatch(self, req: Request) -> dict[str, Any]:
        if req.op == "reload":  # the signal's own path, so SIGHUP and ``mta reload`` are one thing
            os.kill(os.getpid(), signal.SIGHUP)
            return {"pid": os.getpid()}
        core = self.aspool.core
        await self.aspool.commit()  # what finished a moment ago is durable, so the walk sees it
        if req.op in CHANGES:
            return await change_op(req, self._apply, self._matching, self._apply_batch, self.shard)
        return await trio.to_thread.run_sync(lambda: read_op(core, req, core.read_body, self.shard))

    async def _apply(self, op: str, mid: int) -> bool:
        msg = await self.aspool.find(mid)
        if (op == "hold" and msg.held) or (op == "release" and not msg.held) or \
                (op == "flush" and (msg.held or msg.klass == 0)):
            return False
        await getattr(self.aspool, op)(mid)
        if op == "delete":
            qid = self.aspool.core.queue_id(mid)
            for rcpt in msg.envelope.recipients:  # as a delivery line, so that a search by status finds it
                event(log, "delivery", qid, to=f"<{rcpt}>", relay="none", status="deleted",
                      reply="deleted by the operator (mta queue delete)")
        return True

    async def _apply_batch(self, op: str, msgs: list[admin.LiveMessage]) -> list[bool | str]:
        return await self.aspool.change_batch(msgs, op)

    async def _matching(self, flt: admin.Filter) -> AsyncIterator[list[admin.LiveMessage]]:
        """The selection's batches, each page read in a worker thread (the loop goes on serving)."""
        batches = selection_batches(self.aspool.core, flt, SELECTION_BATCH)
        while (batch := await trio.to_thread.run_sync(next, batches, None)) is not None:
            yield batch
