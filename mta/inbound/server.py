"""The SMTP server shell: sockets, timeouts and policy around the sans-IO core.

The core (``mta.smtp.server``) owns the protocol; this module owns what needs
the outside world: the relay decision (``Config.may_relay``), routes, free
disk space, the spool, TLS, time limits (``mta.inbound.deadlines``) and session
limits (``mta.inbound.admission``). The ``250`` after DATA is sent only once
``AsyncSpool.enqueue`` has returned, which is after the group commit's
fdatasync covered the message.

Failures: a client that misbehaves gets a reply and, at worst, a closed
connection. An unexpected exception in a session (a bug its input reached)
ends that session only: it is logged once with its traceback and the
client's address, and the client gets ``421 4.3.0`` if it still listens
(``_Session.fail``; ``_serve_connection`` is the last line for what happens
outside a session). A spool failure (a failed fsync above all, or anything
once the log writer is poisoned: ``mta.containment.is_fatal``) is not
contained: it ends the relay, crash-only, and the next start recovers.

Submission (``[submission]``, docs/security.md "SMTP AUTH"): the same
sessions serve the submission listeners, with AUTH offered once TLS is up
and MAIL refused before it (``Port``); port 465's sessions do the TLS
handshake before the greeting (RFC 8314). Whether an AUTH succeeds is
``mta.inbound.submission``'s to decide (the password checked in a worker
thread, failures limited per client address). An authenticated session may
relay anywhere, as a client in ``mynetworks`` may; its user is logged and
kept in the envelope (``extra["auth"]``).

Disk space (``mta.inbound.disk``): new mail is refused with ``452 4.3.1``
while the spool's disk is short, checked at MAIL, at every chunk of DATA (a
message being received is then read to its end and dropped) and before the
enqueue. A commit that finds the disk full (DiskFull) gets the same reply,
and the spool cancels the message.
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Callable
from typing import Any

import dns.asyncresolver
import trio

from mta.config import Config, ListenAddress
from mta.containment import is_fatal, local_error
from mta.delivery.mx import make_resolver
from mta.dkim.accept import AcceptSigner
from mta.inbound.accept import accept_loop
from mta.inbound.admission import Refusal, SessionSlots, Slot
from mta.inbound.checks import Checks
from mta.inbound.disk import DiskCheck
from mta.inbound.listen import open_listeners
from mta.inbound.proxy_intake import receive_header
from mta.inbound.session import FAREWELL_TIMEOUT, R_SHUTTING_DOWN, Port, _Session
from mta.inbound.submission import Authenticator
from mta.limits.limiter import Over
from mta.observe.logline import event
from mta.observe.metrics import Metrics
from mta.recipients.check import RecipientCheck
from mta.smtp.common import Reply
from spool import AsyncSpool

log = logging.getLogger("mta.smtpd")

R_TOO_MANY_SESSIONS = Reply(421, "4.7.0", "Too many connections, try again later")


class SmtpServer:
    def __init__(self, config: Config, aspool: AsyncSpool, metrics: Metrics,
                 ssl_context: ssl.SSLContext | None = None,
                 free_space: Callable[[str], int | None] | None = None, dkim: AcceptSigner | None = None,
                 keep_reject: Callable[[dict[str, Any]], None] | None = None) -> None:
        """``free_space`` (tests inject one) is asked at every disk check (``mta.inbound.disk.DiskCheck``).

        ``keep_reject``: given each rejection's fields as it is logged (``mta.events.rejections``); it must not block.

        ``dkim``: signs the mail of trusted clients as it is accepted (``mta.dkim.accept``); None: no keys.
        Raises (with ``[submission]`` on): ``OSError``, ``UsersFileError`` for a users file that cannot be read.
        """
        self.config = config
        self.dkim = dkim
        self.aspool = aspool
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.disk = DiskCheck(aspool, config.spool.queue_minfree, free_space)
        self.slots = SessionSlots(config)
        aspool.count_clients(lambda: self.slots.total)  # the inline commit is for a lone client only
        self.reuse_port = False  # set when several relay processes share the listening addresses
        self.keep_reject = keep_reject
        self.auth = Authenticator(config, metrics)
        self.checks = Checks(config)  # [limits] and [policy]
        self.recipient_check = RecipientCheck(config)  # tables, aliases, verification at RCPT
        self.listeners: dict[Port, list[trio.SocketListener]] = {}
        self.proxy_listeners: list[trio.SocketListener] = []  # ``[proxy] listen``: SMTP behind a balancer
        self.sessions: set[_Session] = set()
        self._resolvers: dict[tuple[str, int] | None, dns.asyncresolver.Resolver] = {}
        self.draining = False  # a planned stop (``mta.process.lifecycle``): no new connection or transaction

    def drain(self) -> None:
        """Take no new connection or transaction; end every session that is between transactions (421 4.3.2).

        A session inside a transaction finishes it and gets ``421 4.3.2`` at its next MAIL or command read.
        """
        self.draining = True
        for session in self.sessions:
            session.wake_idle()

    def resolver(self) -> dns.asyncresolver.Resolver:
        """The relay's resolver (``[delivery] resolver``) for the clients' names (``mta.inbound.client_name``)."""
        r = self.config.delivery.resolver
        key = (r.host, r.port) if r is not None else None
        if key not in self._resolvers:
            self._resolvers[key] = make_resolver(r.host if r else None, r.port if r else 53)
        return self._resolvers[key]

    def in_transaction(self) -> int:
        """Sessions with a transaction in flight (MAIL accepted, its data not yet answered)."""
        return sum(1 for session in self.sessions if session.in_transaction)

    async def serve(self, *, task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Listen on every address; ``started`` with the SMTP listeners (``listeners`` has them all, by ``Port``)."""
        sub = self.config.submission
        wanted: list[tuple[Port, tuple[ListenAddress, ...], str]] = [
            (Port.SMTP, self.config.server.listen, "server.listen"),
            (Port.SUBMISSION, sub.listen, "submission.listen"),
            (Port.SUBMISSIONS, sub.implicit_tls_listen, "submission.implicit_tls_listen")]
        try:
            for port, addrs, key in wanted:
                self.listeners[port] = await open_listeners(addrs, reuse_port=self.reuse_port, key=key)
            self.proxy_listeners = await open_listeners(self.config.proxy.listen, reuse_port=self.reuse_port,
                                                        key="proxy.listen")
        except BaseException:
            for opened in [*self.listeners.values(), self.proxy_listeners]:
                for listener in opened:
                    listener.socket.close()
            raise
        async with trio.open_nursery() as nursery:
            task_status.started(self.listeners[Port.SMTP])
            for port, opened in self.listeners.items():
                for listener in opened:
                    nursery.start_soon(accept_loop, listener, self._admit,
                                       functools.partial(self._serve_connection, port=port))
            for listener in self.proxy_listeners:
                nursery.start_soon(accept_loop, listener, _no_slot_yet, self._serve_proxied)

    def _admit(self, peer: Any) -> Slot | Refusal:
        """A session slot for a client just accepted (``SessionSlots``), taken in the order of the accepts."""
        return self.slots.admit(str(peer[0]))

    async def _serve_proxied(self, stream: trio.SocketStream, peer: Any, _: object) -> None:
        """A connection to a ``[proxy] listen`` address: the balancer's PROXY header, then the client's session.

        The session slot is taken once the header named the client (its limits are the client's, not the
        balancer's). A connection from outside ``[proxy] balancers``, without a valid header, or whose header
        does not come within ``header_timeout`` is closed before the banner, unanswered: whoever sent it is no
        SMTP client of ours, and a reply would reach the balancer's client as if from us. While draining, the
        client the header names gets ``421 4.3.2`` as a direct one does (``handle``).
        """
        balancer = str(peer[0])  # the accept loop closes the connection of every return before the session
        if not self.config.proxy.from_balancer(balancer):
            self._proxy_refused(balancer, "proxy_untrusted", "not from a configured balancer")
            return
        try:
            header = await receive_header(stream, self.config.proxy.header_timeout,
                                          functools.partial(self._proxy_refused, balancer))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        if header is None:
            return
        client = header.client if header.client is not None else (balancer, int(peer[1]))
        event(log, "proxy", client=client[0], client_port=client[1], balancer=balancer,
              version=header.version, local=header.client is None or None)
        await self._serve_connection(stream, client, self._admit(client), early=header.rest)

    def _proxy_refused(self, balancer: str, reason: str, detail: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        event(log, "reject", level=logging.WARNING, client=balancer, command="PROXY", reason=reason, detail=detail)
        self.record_reject(client=balancer, command="PROXY", reason=reason, detail=detail)

    def record_reject(self, **fields: str | None) -> None:
        if self.keep_reject is not None:
            self.keep_reject({k: v for k, v in fields.items() if v is not None})

    async def _serve_connection(self, stream: trio.SocketStream, peer: Any, slot: Slot | Refusal,
                                port: Port = Port.SMTP, early: bytes = b"") -> None:
        """The last boundary of one connection: nothing raised while serving it ends the listener.

        Sessions contain their own failures (``handle``); this catches what
        happens around them (a peer gone before it was answered, say).
        ``early``: the client's bytes that came with the PROXY header.
        """
        try:
            await self.handle(stream, port, peer, slot, early)
        except Exception as exc:
            if is_fatal(exc, self.aspool.core):  # before the network errors: SyncFailed is an OSError
                raise
            if not isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError)):
                log.error("connection failed: %s", local_error(exc), exc_info=exc)

    async def handle(self, stream: trio.SocketStream, port: Port, peer: Any, slot: Slot | Refusal,
                     early: bytes = b"") -> None:
        """Serve one connection; ``peer``: its address as ``accept`` returned it (or the PROXY header named),
        ``slot`` what ``_admit`` said. A slot is released here whatever happens."""
        client_ip = str(peer[0])
        if isinstance(slot, Refusal) or self.draining:
            await self._refuse(stream, client_ip, slot)
            return
        if over := self.checks.limits.at_connect(client_ip, slot.trusted):
            await self._refuse(stream, client_ip, slot, over)
            return
        self.metrics.sessions.inc()
        session = _Session(self, stream, client_ip, port, trusted=slot.trusted)
        if early:
            session.conn.receive_data(early)
        self.sessions.add(session)
        try:
            await session.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, ConnectionError):
            pass
        except Exception as exc:
            if is_fatal(exc, self.aspool.core):
                raise
            await session.fail(exc)
        finally:
            self.sessions.discard(session)
            session.abort_body()
            if session.filters is not None:
                await session.filters.aclose()
            self.slots.release(slot)
            if isinstance(session.stream, trio.SocketStream):
                # No TLS to shut down: closing the socket is all there is, and it cannot block. (The
                # forceful close costs a cancelled scope, ~30 us a connection.)
                session.stream.socket.close()
            else:
                await trio.aclose_forcefully(session.stream)

    async def _refuse(self, stream: trio.SocketStream, client_ip: str, why: Refusal | Slot,
                      over: Over | None = None) -> None:
        """Over a session limit or the connection rate (``421 4.7.0``) or draining (``421 4.3.2``): that reply and
        close, before any greeting. A slot taken (draining, or over the rate) is released here."""
        if over is not None and isinstance(why, Slot):
            reply = over.reply
            self.slots.release(why)
            self.metrics.rejected.labels(over.limit).inc()
            event(log, "reject", level=logging.WARNING, client=client_ip, command="CONNECT", reply=str(reply),
                  reason=over.limit)
            self.record_reject(client=client_ip, command="CONNECT", reply=str(reply), reason=over.limit)
        elif isinstance(why, Refusal):
            reply = R_TOO_MANY_SESSIONS
            self.metrics.sessions_refused.labels(why.value).inc()
            event(log, "reject", level=logging.WARNING, client=client_ip, command="CONNECT",
                  reply=str(reply), reason="session_limit", limit=why.value)
            self.record_reject(client=client_ip, command="CONNECT", reply=str(reply), reason="session_limit")
        else:
            reply = R_SHUTTING_DOWN
            self.slots.release(why)
        with trio.move_on_after(FAREWELL_TIMEOUT):
            try:
                await stream.send_all(reply.to_bytes())
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                pass
        await trio.aclose_forcefully(stream)


def _no_slot_yet(peer: Any) -> None:
    """The admission of a connection behind a balancer waits for its PROXY header (``_serve_proxied``)."""
