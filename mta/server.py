"""The SMTP server shell: sockets, timeouts and policy around the sans-IO core.

The core (``mta.smtp_server``) owns the protocol; this module owns what needs
the outside world: the relay decision (``Config.may_relay``), routes, free
disk space, the spool, TLS, time limits and session limits. The ``250`` after
DATA is sent only once ``AsyncSpool.enqueue`` has returned, which is after
the group commit's fdatasync covered the message.

Failures: a client that misbehaves gets a reply and, at worst, a closed
connection. An unexpected exception in a session (a bug its input reached)
ends that session only: it is logged once with its traceback and the
client's address, and the client gets ``421 4.3.0`` if it still listens
(``_Session.fail``; ``_serve_connection`` is the last line for what happens
outside a session). A spool failure (a failed fsync above all, or anything
once the log writer is poisoned: ``mta.containment.is_fatal``) is not
contained: it ends the relay, crash-only, and the next start recovers.
"""

from __future__ import annotations

import logging
import math
import os
import ssl
import time
from collections.abc import Callable
from typing import Any

import trio

from mta.config import Config, NoRoute
from mta.containment import is_fatal, local_error
from mta.listen import open_listeners
from mta.metrics import Metrics
from mta.smtp_common import Reply, received_header, received_protocol
from mta.smtp_server import (
    ConnectionClosed,
    DataAborted,
    DataChunk,
    DataStart,
    Ehlo,
    EndOfData,
    Helo,
    MailFrom,
    NeedData,
    Quit,
    RcptTo,
    Rset,
    ServerConnection,
    StartTls,
)
from spool.commit import AsyncSpool
from spool.spool import BodyWriter

log = logging.getLogger("mta.smtpd")

R_RELAY_DENIED = Reply(554, "5.7.1", "Relay access denied")
R_NO_ROUTE = Reply(550, "5.1.2", "No route to this domain")
R_DISK_FULL = Reply(452, "4.3.1", "Insufficient system storage, try again later")
R_TOO_MANY_SESSIONS = Reply(421, "4.7.0", "Too many connections, try again later")
R_TIMEOUT = Reply(421, "4.4.2", "Timeout, closing connection")
R_NO_TLS = Reply(454, "4.7.0", "TLS not available")
R_TOO_BIG = Reply(552, "5.3.4", "Message size exceeds fixed limit")
R_LOCAL_ERROR = Reply(421, "4.3.0", "Local error, closing connection; try again later")
READ_SIZE = 65536


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class CachedFreeSpace:
    """``free_bytes`` that reuses a reading for up to ``ttl`` seconds while the disk has plenty.

    Why: a statvfs per MAIL FROM (and per end of DATA) was 2% of the relay's
    CPU. A reading is reused only while it is at least ``margin`` bytes above
    ``minfree``; nearer the limit every check reads afresh, so the 452 starts
    and ends exactly where it did. What the cache can miss is a fall of more
    than ``margin`` within ``ttl`` seconds.
    """

    def __init__(self, minfree: int, *, ttl: float = 1.0, margin: int | None = None,
                 measure: Callable[[str], int] = free_bytes, clock: Callable[[], float] = time.monotonic) -> None:
        self.minfree = minfree
        self.ttl = ttl
        self.margin = max(minfree, 64 << 20) if margin is None else margin
        self.measure = measure
        self.clock = clock
        self._path = ""
        self._value = 0
        self._until = -math.inf

    def __call__(self, path: str) -> int:
        now = self.clock()
        if path != self._path or now >= self._until:
            self._path, self._value = path, self.measure(path)
            plenty = self._value >= self.minfree + self.margin
            self._until = now + self.ttl if plenty else -math.inf
        return self._value


class SmtpServer:
    def __init__(self, config: Config, aspool: AsyncSpool, metrics: Metrics,
                 ssl_context: ssl.SSLContext | None = None,
                 free_space: Callable[[str], int] | None = None) -> None:
        """``free_space`` (tests inject one) is asked at every check; the default is a ``CachedFreeSpace``."""
        self.config = config
        self.aspool = aspool
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.free_space = free_space or CachedFreeSpace(config.spool.queue_minfree)
        self.sessions = 0
        self.per_client: dict[str, int] = {}
        self.reuse_port = False  # set when several relay processes share the listening addresses

    async def serve(self, *, task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        listeners = await open_listeners(self.config.server.listen, reuse_port=self.reuse_port)
        async with trio.open_nursery() as nursery:
            task_status.started(listeners)
            for listener in listeners:
                nursery.start_soon(trio.serve_listeners, self._serve_connection, [listener])

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        """The last boundary of one connection: nothing raised while serving it ends the listener.

        Sessions contain their own failures (``handle``); this catches what
        happens around them (a peer gone before it was answered, say).
        """
        try:
            await self.handle(stream)
        except Exception as exc:
            if is_fatal(exc, self.aspool.core):  # before the network errors: SyncFailed is an OSError
                raise
            if not isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError)):
                log.error("connection failed: %s", local_error(exc), exc_info=exc)

    def _disk_ok(self) -> bool:
        return self.free_space(self.aspool.core.path) >= self.config.spool.queue_minfree

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            peer: Any = stream.socket.getpeername()
            client_ip = str(peer[0])
        except OSError:
            return
        s = self.config.server
        if self.sessions >= s.max_sessions or self.per_client.get(client_ip, 0) >= s.max_sessions_per_client:
            with trio.move_on_after(5):
                await stream.send_all(R_TOO_MANY_SESSIONS.to_bytes())
            await trio.aclose_forcefully(stream)
            return
        self.sessions += 1
        self.per_client[client_ip] = self.per_client.get(client_ip, 0) + 1
        self.metrics.sessions.inc()
        session = _Session(self, stream, client_ip)
        try:
            await session.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, ConnectionError):
            pass
        except Exception as exc:
            if is_fatal(exc, self.aspool.core):
                raise
            await session.fail(exc)
        finally:
            session.abort_body()
            self.sessions -= 1
            left = self.per_client[client_ip] - 1
            if left:
                self.per_client[client_ip] = left
            else:
                del self.per_client[client_ip]
            await trio.aclose_forcefully(session.stream)


class _Session:
    def __init__(self, server: SmtpServer, stream: trio.SocketStream, client_ip: str) -> None:
        self.server = server
        self.config = server.config
        self.stream: trio.abc.Stream = stream
        self.client_ip = client_ip
        s = self.config.server
        self.conn = ServerConnection(
            s.hostname, max_message_size=s.max_message_size, max_line_length=s.line_length_limit,
            max_recipients=s.max_recipients, max_errors=s.max_errors, normalize_bare_lf=s.normalize_bare_lf,
            tls_available=server.ssl_context is not None)
        self.sender = ""
        self.recipients: list[str] = []
        self.body: BodyWriter | None = None
        self.mail_params: dict[str, Any] = {}
        self._timer = trio.CancelScope()  # the read timeout: one scope per session, its deadline moved per read
        self._expected: int | None = None  # the token of this session's announced commit (``expect_commit``)

    def abort_body(self) -> None:
        if self.body is not None:
            self.body.abort()
            self.body = None
        self._transaction(False)

    def _transaction(self, active: bool) -> None:
        """Tell the group commit whether this session's commit is coming (a recipient accepted, data not ended)."""
        if active and self._expected is None:
            self._expected = self.server.aspool.expect_commit()
        elif not active and self._expected is not None:
            self.server.aspool.withdraw_commit(self._expected)
            self._expected = None

    async def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            await self.stream.send_all(out)

    async def fail(self, exc: Exception) -> None:
        """The session's boundary: an unexpected exception ends this session only.

        Logged once, with its traceback and the client's address; the client
        gets the replies already decided and then ``421 4.3.0``, if the
        connection still takes them (within 5 s).
        """
        log.error("session from %s ended by an unexpected error: %s", self.client_ip, local_error(exc),
                  exc_info=exc)
        with trio.move_on_after(5):
            try:
                await self.stream.send_all(self.conn.data_to_send() + R_LOCAL_ERROR.to_bytes())
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                pass

    async def run(self) -> None:
        with self._timer:
            await self._serve()
        if self._timer.cancelled_caught:
            await self.stream.send_all(R_TIMEOUT.to_bytes())

    async def _receive(self) -> bytes | bytearray:
        """Read under the command or data timeout (the session's one cancel scope, re-armed)."""
        s = self.config.server
        self._timer.deadline = trio.current_time() + (s.data_timeout if self.body is not None else s.command_timeout)
        data = await self.stream.receive_some(READ_SIZE)
        self._timer.deadline = math.inf
        return data

    async def _serve(self) -> None:
        """The session's event loop.

        Replies are sent in batches (RFC 2920): they collect in the core while
        it has input to work through and go out in one write when it needs
        more input, and before anything that blocks (the enqueue's commit, the
        back-pressure commit, the TLS handshake, closing). A reply is never
        held while we wait for the client, who may be waiting for it.
        """
        while True:
            ev = self.conn.next_event()
            if isinstance(ev, NeedData):
                await self._flush()
                self.conn.receive_data(await self._receive())
            elif isinstance(ev, MailFrom):
                self._mail(ev)
            elif isinstance(ev, RcptTo):
                self._rcpt(ev)
            elif isinstance(ev, DataStart):
                self._data_start()
            elif isinstance(ev, DataChunk):
                assert self.body is not None
                self.body.write(ev.data)
                await self._drain()
            elif isinstance(ev, EndOfData):
                await self._flush()
                await self._end_of_data()
            elif isinstance(ev, DataAborted):
                self.abort_body()
                self.server.metrics.rejected.labels("content").inc()
            elif isinstance(ev, StartTls):
                if not await self._starttls():
                    return
            elif isinstance(ev, (Rset, Ehlo, Helo)):
                self._reset()
            elif isinstance(ev, (Quit, ConnectionClosed)):
                await self._flush()
                return

    async def _drain(self) -> None:
        """Back-pressure: stop reading while the spool's unwritten backlog is over its flush threshold.

        Why: the body goes to the log as it arrives, but the committer writes in
        a worker thread; a client faster than the disk would otherwise pile the
        message up in memory, the very thing streaming is for.
        """
        spool = self.server.aspool
        if spool.unflushed_bytes >= spool.core.config.flush_threshold:
            await self._flush()
            await spool.wait_flushed()

    def _reset(self) -> None:
        self.abort_body()
        self.sender = ""
        self.recipients = []
        self.mail_params = {}

    def _mail(self, ev: MailFrom) -> None:
        self._reset()
        if not self.server._disk_ok():
            self.server.metrics.rejected.labels("disk").inc()
            self.conn.reject(R_DISK_FULL)
            return
        size = ev.params.get("SIZE")
        if isinstance(size, str) and size.isdigit() and int(size) > self.config.server.max_message_size:
            self.conn.reject(R_TOO_BIG)
            return
        self.sender = ev.address
        self.mail_params = {k: v for k, v in ev.params.items() if k in ("BODY", "SMTPUTF8", "ENVID", "RET")}
        self.conn.accept()

    def _rcpt(self, ev: RcptTo) -> None:
        address = self.config.postmaster_alias(ev.address)
        if address is None:
            address = ev.address
            domain = address.rpartition("@")[2].lower()
            if not domain or not self.config.may_relay(self.client_ip, domain):
                self.server.metrics.rejected.labels("relay").inc()
                self.conn.reject(R_RELAY_DENIED)
                return
            if isinstance(self.config.route_for(domain), NoRoute):
                self.conn.reject(R_NO_ROUTE)
                return
        # else <postmaster> or <postmaster@HOSTNAME>: from anyone (RFC 5321 §4.5.1), to the configured postmaster
        if address not in self.recipients:  # one copy per address, as Postfix's cleanup keeps (aliases meet here)
            self.recipients.append(address)
        self._transaction(True)
        self.conn.accept()

    def _data_start(self) -> None:
        self.body = self.server.aspool.begin_body()
        tls = isinstance(self.stream, trio.SSLStream)
        proto = received_protocol(esmtp=self.conn.esmtp, tls=tls, smtputf8="SMTPUTF8" in self.mail_params)
        self.body.write(received_header(helo=self.conn.helo_name or "unknown", client_ip=self.client_ip,
                                        by=self.config.server.hostname, protocol=proto,
                                        recipient=self.recipients[0] if len(self.recipients) == 1 else None))

    async def _end_of_data(self) -> None:
        body, self.body = self.body, None
        assert body is not None
        self._transaction(False)  # arrived: from here the commit waits for this message, not for the session
        if not self.server._disk_ok():
            body.abort()
            self.conn.reject(R_DISK_FULL)
            return
        extra: dict[str, Any] = {"client": self.client_ip}
        if self.mail_params:
            extra["params"] = {k: (v if isinstance(v, str) else True) for k, v in self.mail_params.items()}
        mid = await self.server.aspool.enqueue(self.sender, self.recipients, body, extra=extra)
        self.server.metrics.accepted.inc()
        queue_id = self.server.aspool.core.queue_id(mid)
        if log.isEnabledFor(logging.INFO):  # skip building the arguments when nobody listens
            log.info("%s: from=<%s>, size=%d, nrcpt=%d, client=%s", queue_id, self.sender, body.size,
                     len(self.recipients), self.client_ip)
        self.conn.accept(Reply(250, "2.0.0", f"Ok: queued as {queue_id}"))
        self.recipients = []

    async def _starttls(self) -> bool:
        ctx = self.server.ssl_context
        if ctx is None or isinstance(self.stream, trio.SSLStream):
            self.conn.reject(R_NO_TLS)
            return True
        self.conn.accept()
        await self._flush()
        tls = trio.SSLStream(self.stream, ctx, server_side=True)
        with trio.move_on_after(self.config.server.command_timeout) as scope:
            await tls.do_handshake()
        if scope.cancelled_caught:
            return False
        self.stream = tls
        self.conn.tls_started()
        self._reset()
        return True
