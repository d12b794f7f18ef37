"""One SMTP session of the inbound server: the sans-IO core (``mta.smtp.server``) driven over one stream.

``SmtpServer`` (``mta.inbound.server``) accepts the connection, takes its slot and hands it to a ``_Session``,
which reads the client's bytes, answers the core's events (the checks, the recipients, the filters, the spool's
enqueue) and enforces the client's deadlines. What a session can fail at and how it ends is described in
``mta.inbound.server``'s docstring.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio

from mta.config import NoRoute
from mta.containment import local_error
from mta.dkim.signer import Signature
from mta.inbound import wire
from mta.inbound.checks import Denial, Passed
from mta.inbound.client_cert import ClientCert, client_cert
from mta.inbound.client_name import ClientNames, look_up
from mta.inbound.deadlines import SessionDeadlines
from mta.inbound.disk import R_DISK_FULL, R_TOO_BIG_FOR_DISK
from mta.inbound.message_id import MessageIdPeek
from mta.milter.accept import filter_body
from mta.milter.chain import Facts, FilterSession
from mta.observe.logline import event
from mta.observe.tlsinfo import TlsInfo, tls_info
from mta.recipients.table import Refused
from mta.smtp.common import Reply, received_header, received_protocol
from mta.smtp.dsn_params import RecipientDsn
from mta.smtp.server import (
    END_OF_DATA,
    AuthRequest,
    ConnectionClosed,
    DataAborted,
    DataChunk,
    DataCommand,
    DataStart,
    Ehlo,
    EndOfData,
    Helo,
    MailFrom,
    NeedData,
    Quit,
    RcptTo,
    Rejection,
    Rset,
    ServerConnection,
    StartTls,
)
from spool import BodyWriter, DiskFull

if TYPE_CHECKING:
    from mta.inbound.server import SmtpServer

log = logging.getLogger("mta.smtpd")

R_RELAY_DENIED = Reply(554, "5.7.1", "Relay access denied")
R_NO_ROUTE = Reply(550, "5.1.2", "No route to this domain")
R_TIMEOUT = Reply(421, "4.4.2", "Timeout, closing connection")
R_SESSION_OVER = Reply(421, "4.4.2", "Session time limit reached, closing connection")
R_NO_TLS = Reply(454, "4.7.0", "TLS not available")
R_TOO_BIG = Reply(552, "5.3.4", "Message size exceeds fixed limit")
R_LOCAL_ERROR = Reply(421, "4.3.0", "Local error, closing connection; try again later")
R_SHUTTING_DOWN = Reply(421, "4.3.2", "Service shutting down, try again later")
READ_SIZE = 65536
DEADLINE_SLACK = 0.1  # the most a client's deadline is enforced late (``_Session._arm``)
# How long a last reply (421) may take to leave when the session is being ended anyway.
FAREWELL_TIMEOUT = 5.0


class Port(enum.Enum):
    """What a listener is for: relay and inbound mail (25), submission with STARTTLS (587), with implicit TLS (465)."""

    SMTP = "smtp"
    SUBMISSION = "submission"
    SUBMISSIONS = "submissions"  # RFC 8314's name for port 465


class _Session:
    def __init__(self, server: SmtpServer, stream: trio.abc.Stream, client_ip: str, port: Port = Port.SMTP, *,
                 trusted: bool | None = None) -> None:
        self.server = server
        self.config = server.config
        self.stream: trio.abc.Stream = stream
        self.client_ip = client_ip
        # In mynetworks? (``Config.in_mynetworks``; the admission already knows it.)
        self.trusted = self.config.in_mynetworks(client_ip) if trusted is None else trusted
        self.port = port
        s = self.config.server
        submission = port is not Port.SMTP
        self.conn = ServerConnection(
            s.hostname, max_message_size=s.max_message_size, max_line_length=s.line_length_limit,
            max_recipients=s.max_recipients, max_errors=s.max_errors, normalize_bare_lf=s.normalize_bare_lf,
            tls_available=server.ssl_context is not None, tls_active=port is Port.SUBMISSIONS,
            auth=submission, require_auth=submission, decide_data=True, on_reject=self._rejected)
        self.tls: TlsInfo | None = None
        self.client_cert: ClientCert | None = None  # a verified one ([client_certs]), once TLS is up
        self.queue_id: str | None = None  # decided as DATA begins (the Received: header names it)
        self.mail_from: str | None = None  # the sender of the transaction, once MAIL was accepted
        self.sender = ""
        self.recipients: list[str] = []
        self.body: BodyWriter | None = None
        self._message_id = MessageIdPeek()  # the message being received: its Message-ID, for the log lines
        self.mail_params: dict[str, Any] = {}
        self.rcpt_dsn: dict[str, dict[str, str]] = {}  # recipient -> its NOTIFY and ORCPT (``mta.smtp.dsn_params``)
        # The client's deadline (``mta.inbound.deadlines``) enforced by one cancel scope around the whole session.
        self.deadlines = SessionDeadlines.for_session(s, trio.current_time())
        self._timer = trio.CancelScope()
        self._slack = min(DEADLINE_SLACK, s.command_timeout / 100)  # how late a deadline may fire (``_arm``)
        self._command_done = True  # the connection, a DATA phase or TLS began or ended: a new command is next
        self._command_lines = 0  # the core's ``command_lines`` when the current command deadline was set
        self._expected: int | None = None  # the token of this session's announced commit (``expect_commit``)
        self._pace = wire.Pace()  # a lone client's reads may skip their yield (``mta.inbound.wire``)
        self._idle: trio.CancelScope | None = None  # around a read between transactions: a drain cancels it
        self.checks = server.checks.session(self, self._relay_busy)
        # Milters and rspamd of this listener (``mta.milter``); None: none configured.
        self.filters = FilterSession.for_session(self.config.filters, port is not Port.SMTP)
        self._quarantine: str | None = None  # a filter asked to hold the message being accepted
        self.auth_mechanism: str | None = None  # the SASL mechanism of a successful AUTH (the milters' {auth_type})
        self._names: ClientNames | None = None  # looked up once, when first asked for (``client_names``)

    @property
    def in_transaction(self) -> bool:
        return self.mail_from is not None or self.body is not None

    async def client_names(self) -> ClientNames:
        """The client's names from the DNS (``mta.inbound.client_name``), looked up on the first call."""
        if self._names is None:
            with self._relay_busy():
                self._names = await look_up(self.server.resolver(), self.client_ip)
        return self._names

    def local_address(self) -> tuple[str, int]:
        """The listener's address and port this client connected to (the policy servers' ``server_*``)."""
        stream = self.stream
        inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        if isinstance(inner, trio.SocketStream):
            local: Any = inner.socket.getsockname()
            return str(local[0]), int(local[1])
        return "", 0

    def wake_idle(self) -> None:
        """A drain began: a session waiting for a command between transactions stops waiting (``_need_data``)."""
        if self._idle is not None:
            self._idle.cancel()

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
            await wire.send(self.stream, out)

    async def fail(self, exc: Exception) -> None:
        """The session's boundary: an unexpected exception ends this session only.

        Logged once, with its traceback and the client's address; the client
        gets the replies already decided and then ``421 4.3.0``, if the
        connection still takes them (within 5 s).
        """
        event(log, "session_error", self.queue_id, level=logging.ERROR, exc_info=exc, client=self.client_ip,
              error=local_error(exc), reply=str(R_LOCAL_ERROR))
        with trio.move_on_after(5):
            try:
                await self.stream.send_all(self.conn.data_to_send() + R_LOCAL_ERROR.to_bytes())
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                pass

    async def run(self) -> None:
        if self.port is Port.SUBMISSIONS and not await self._handshake():
            return
        with self._timer:
            await self._serve()
        if self._timer.cancelled_caught:
            phase = "data" if self.deadlines.in_data else "command"
            self.server.metrics.timeouts.labels(phase).inc()
            self._log_reject("DATA" if phase == "data" else "-", "", R_TIMEOUT, "timeout", phase=phase)
            await self._farewell(R_TIMEOUT)

    async def _farewell(self, reply: Reply) -> None:
        """A last reply to a client that may not be reading: it gets at most a command's time to leave."""
        with trio.move_on_after(min(FAREWELL_TIMEOUT, self.config.server.command_timeout)):
            await self.stream.send_all(reply.to_bytes())

    def _arm(self) -> None:
        """Put the client's deadline into the session's cancel scope, up to ``_slack`` late.

        Setting a scope's deadline costs a re-registration with trio (~3 us),
        and every command moves the deadline on by the time since the last
        one. So the scope is set to the deadline plus the slack, and left
        alone while that stays between the deadline and the deadline plus the
        slack: a lone client's commands re-arm it once a message or so, not
        ten times. A deadline is never enforced early, and at most
        ``_slack`` late (a hundredth of the command timeout, at most 0.1 s).
        """
        deadline = self.deadlines.deadline
        armed = self._timer.deadline
        if not deadline <= armed <= deadline + self._slack:
            self._timer.deadline = deadline + self._slack

    @contextlib.contextmanager
    def _relay_busy(self) -> Iterator[None]:
        """The relay's own waits (the commit, back-pressure) are not the client's time: its deadline moves on."""
        start = trio.current_time()
        self._timer.deadline = math.inf
        try:
            yield
        finally:
            self.deadlines.pause(trio.current_time() - start)
            self._arm()

    async def _need_data(self) -> bool:
        """Send the replies due, then read more under the client's deadline; False: the session is over.

        A new command's deadline starts here, when the server starts waiting
        for it; reads of parts of it do not move it (``mta.inbound.deadlines``).
        """
        new_command = self._command_done or self.conn.command_lines != self._command_lines
        if new_command and not self.deadlines.in_data:
            self._command_done = False
            self._command_lines = self.conn.command_lines
            now = trio.current_time()
            self.deadlines.command(now)
            self._arm()
            if self.deadlines.session_over(now):
                await self._flush()
                self.server.metrics.timeouts.labels("session").inc()
                self._log_reject("-", "", R_SESSION_OVER, "session_time_limit")
                await self._farewell(R_SESSION_OVER)
                return False
        await self._flush()
        pace = self._pace
        pace.lone = self.server.slots.total <= 1
        if self.in_transaction:
            data = await wire.receive(self.stream, READ_SIZE, pace)
        else:
            if self.server.draining:
                await self._farewell(R_SHUTTING_DOWN)
                return False
            data = b""
            with trio.CancelScope() as idle:
                self._idle = idle
                data = await wire.receive(self.stream, READ_SIZE, pace)
            self._idle = None
            if idle.cancelled_caught:
                await self._farewell(R_SHUTTING_DOWN)
                return False
        if self.deadlines.in_data:  # bytes buy time only inside DATA; elsewhere the deadline stays where it is
            self.deadlines.received(trio.current_time(), len(data))
            self._arm()
        self.conn.receive_data(data)
        return True

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
                if not await self._need_data():
                    return
            elif isinstance(ev, MailFrom):
                await self._mail(ev)
            elif isinstance(ev, RcptTo):
                await self._rcpt(ev)
            elif isinstance(ev, DataCommand):
                await self._data_command()
            elif isinstance(ev, DataStart):
                self._data_start()
            elif isinstance(ev, DataChunk):
                assert self.body is not None
                self.body.write(ev.data)
                self._message_id.feed(ev.data)
                await self._drain()
            elif isinstance(ev, EndOfData):
                self._data_end()
                await self._flush()
                await self._end_of_data()
                if self.server.draining:  # the reply leaves before the transaction stops holding the drain
                    await self._flush()
                self._transaction_over()
            elif isinstance(ev, DataAborted):  # its refusal (if it ended with one) went through _rejected
                self._data_end()
                self.abort_body()
                self._transaction_over()
            elif isinstance(ev, StartTls):
                if not await self._starttls():
                    return
            elif isinstance(ev, AuthRequest):
                if not await self._authenticate(ev):
                    await self._flush()
                    return
            elif isinstance(ev, (Rset, Ehlo, Helo)):
                if self.deadlines.in_data:  # a BDAT transaction ended between chunks
                    self._data_end()
                self._reset()
            elif isinstance(ev, (Quit, ConnectionClosed)):
                await self._flush()
                return
            if self.checks.closing:  # a 421 of the limits: nothing more is read or answered
                await self._flush()
                return

    def _data_end(self) -> None:
        self.deadlines.data_end()
        self._command_done = True

    async def _drain(self) -> None:
        """Back-pressure: stop reading while the spool's unwritten backlog is over its flush threshold.

        Why: the body goes to the log as it arrives, but the committer writes in
        a worker thread; a client faster than the disk would otherwise pile the
        message up in memory, the very thing streaming is for.

        Disk space, at every chunk: once the disk is short (``DiskCheck.ok``) or
        full (the spool's writes wait for room), the message stops going to the
        spool; the rest of it is read and counted, and refused at its end.
        """
        body = self.body
        if body is None or body.discarding:
            return
        spool = self.server.aspool
        if not self.server.disk.ok():
            body.discard()
            return
        if spool.unflushed_bytes >= spool.core.config.flush_threshold:
            await self._flush()
            try:
                with self._relay_busy():
                    await spool.wait_flushed()
            except DiskFull:
                body.discard()

    def _rejected(self, r: Rejection) -> None:
        """Every 4xx/5xx the session sends (the core's ``on_reject``): counted and logged, once each."""
        self.server.metrics.rejected.labels(r.reason).inc()
        self._log_reject(r.command, r.argument, r.reply, r.reason)

    def _log_reject(self, command: str, argument: str, reply: Reply, reason: str, phase: str | None = None) -> None:
        in_transaction = self.mail_from is not None and command in ("RCPT", "DATA", END_OF_DATA)
        event(log, "reject", self.queue_id if command == END_OF_DATA else None, client=self.client_ip,
              helo=self.conn.helo_name, command=command, arg=argument or None,
              from_=f"<{self.mail_from}>" if in_transaction else None, reply=str(reply), reason=reason, phase=phase)
        self.server.record_reject(client=self.client_ip, helo=self.conn.helo_name, command=command,
                                  arg=argument or None, sender=f"<{self.mail_from}>" if in_transaction else None,
                                  reply=str(reply), reason=reason, phase=phase)

    def _reset(self) -> None:
        self.abort_body()
        self.mail_from = None
        self.queue_id = None
        self.sender = ""
        self.recipients = []
        self.mail_params = {}
        self.rcpt_dsn = {}

    async def _mail(self, ev: MailFrom) -> None:
        self._reset()
        if self.server.draining:  # pipelined after the last transaction; the next read ends the session
            self.conn.reject(R_SHUTTING_DOWN, "shutdown")
            return
        if not self.server.disk.ok():
            self.conn.reject(R_DISK_FULL, "disk")
            return
        size = ev.params.get("SIZE")
        if isinstance(size, str) and size.isdigit():
            if int(size) > self.config.server.max_message_size:
                self.conn.reject(R_TOO_BIG, "size")
                return
            if self.server.disk.refusal(int(size)) is R_TOO_BIG_FOR_DISK:  # a declared size that can never fit
                self.conn.reject(R_TOO_BIG_FOR_DISK, "disk")
                return
        if denied := self.checks.mail(ev.address, ev.params):
            self._deny(denied)
            return
        self.sender = ev.address
        self.mail_from = ev.address
        self.mail_params = {k: v for k, v in ev.params.items() if k in ("BODY", "SMTPUTF8", "ENVID", "RET")}
        if self.filters is not None:
            facts = self._facts(await self.client_names())
            with self._relay_busy():
                refusal = await self.filters.mail(facts, ev.address, ev.params)
            if refusal is not None:
                self.mail_from = None
                self.conn.reject(refusal, "filter")
                return
        self.conn.accept()

    def _deny(self, denied: Denial) -> None:
        self.conn.reject(denied.reply, denied.reason)

    async def _rcpt(self, ev: RcptTo) -> None:
        address = self.config.postmaster_alias(ev.address)
        recipients: tuple[str, ...] = (address,) if address is not None else ()
        if address is None:
            address = ev.address
            domain = address.rpartition("@")[2].lower()
            if not domain or not (self.conn.authenticated is not None
                                  or self.config.may_relay_for(self.trusted, domain)):
                self.conn.reject(R_RELAY_DENIED, "relay")
                return
            if isinstance(self.config.route_for(domain), NoRoute):
                self.conn.reject(R_NO_ROUTE, "no_route")
                return
            resolved = await self.server.recipient_check.rcpt(self.config, address, self._flush)  # mta.recipients
            if isinstance(resolved, Refused):
                self.conn.reject(resolved.reply, resolved.why)
                return
            recipients = resolved.recipients  # an alias: its targets
        # else <postmaster> or <postmaster@HOSTNAME>: from anyone (RFC 5321 §4.5.1), to the configured postmaster
        if denied := await self.checks.rcpt(address):
            self._deny(denied)
            return
        if self.filters is not None:
            with self._relay_busy():
                refusal = await self.filters.rcpt(ev.address, ev.params)
            if refusal is not None:
                self.conn.reject(refusal, "filter")
                return
        for rcpt in recipients:
            if rcpt not in self.recipients:  # one copy per address, as Postfix's cleanup keeps (aliases meet here)
                self.recipients.append(rcpt)
                dsn = RecipientDsn(notify=ev.params.get("NOTIFY"), orcpt=ev.params.get("ORCPT")).as_extra()
                if dsn:
                    self.rcpt_dsn[rcpt] = dsn
        self._transaction(True)
        self.conn.accept()

    async def _data_command(self) -> None:
        """DATA: the milters' DATA stage (``FilterSession.data``) may refuse it; else ``354``.

        The body is begun first, so that the milters' ``{i}`` is the message's
        queue id; a refusal drops it, and the transaction keeps its
        recipients (the client may RSET, or try DATA again).
        """
        if self.filters is not None:
            self._begin_body()
            assert self.queue_id is not None
            with self._relay_busy():
                refusal = await self.filters.data(self.queue_id)
            if refusal is not None:
                if self.body is not None:
                    self.body.abort()
                    self.body = None
                self.queue_id = None
                self.conn.reject(refusal, "filter")
                return
        self.conn.accept()

    def _data_start(self) -> None:
        self.deadlines.data_start(trio.current_time())
        self._arm()
        self._begin_body()

    def _begin_body(self) -> None:
        """The message's body in the spool, once per transaction: its queue id is decided here."""
        if self.body is not None:
            return
        core = self.server.aspool.core
        proto = self._protocol()
        user = self.conn.authenticated if self.config.submission.authenticated_header else None

        def received(message_id: int) -> bytes:
            return received_header(helo=self.conn.helo_name or "unknown", client_ip=self.client_ip,
                                   by=self.config.server.hostname, protocol=proto, queue_id=core.queue_id(message_id),
                                   recipient=self.recipients[0] if len(self.recipients) == 1 else None,
                                   tls=self.tls.using() if self.tls is not None else None, authenticated=user)

        # The queue id is decided here, as the body begins, so that the Received: header can name it.
        self.body = self.server.aspool.begin_body(first=received)
        self._message_id = MessageIdPeek()
        assert self.body.message_id is not None
        self.queue_id = core.queue_id(self.body.message_id)

    async def _end_of_data(self) -> None:
        body, self.body = self.body, None
        assert body is not None
        self._transaction(False)  # arrived: from here the commit waits for this message, not for the session
        if body.discarding or not self.server.disk.ok():
            self._refuse_for_disk(body)
            return
        checked = await self.checks.end_of_data(body.size)
        if isinstance(checked, Denial):
            body.abort()
            self._deny(checked)
            return
        if checked.discard is not None:  # a policy server's DISCARD: taken, not stored
            body.abort()
            event(log, "discarded", self.queue_id, client=self.client_ip, from_=f"<{self.sender}>", reason="policy",
                  detail=checked.discard)
            self.recipients = []
            self.conn.accept(Reply(250, "2.0.0", f"Ok: queued as {self.queue_id}"))
            return
        self._policy_envelope(checked)
        for header in checked.headers:
            body.add_header(header.encode("utf-8", "surrogateescape") + b"\r\n")
        extra: dict[str, Any] = {"client": self.client_ip}
        message_id = self._message_id.value()
        if message_id is not None:
            extra["message_id"] = message_id
        if self.conn.authenticated is not None:
            extra["auth"] = self.conn.authenticated
        if self.mail_params:
            extra["params"] = {k: (v if isinstance(v, str) else True) for k, v in self.mail_params.items()}
        if self.rcpt_dsn:
            extra["dsn_rcpt"] = self.rcpt_dsn
        if checked.filter is not None:  # a policy server's FILTER: the delivery's next hop for every recipient
            extra["filter"] = checked.filter
            event(log, "filter_route", self.queue_id, route=checked.filter, reason="policy")
        try:
            with self._relay_busy():
                done = await self._filter(body)
                if done is not None:
                    self._filtered_out(body, done)
                    return
                if self._quarantine is None and checked.hold is not None:  # a policy server's HOLD
                    self._quarantine = f"policy: {checked.hold}"
                if self._quarantine is not None:
                    extra["quarantine"] = self._quarantine
                signed = await self._sign(body)
                mid = await self.server.aspool.enqueue(self.sender, self.recipients, body, extra=extra,
                                                       held=self._quarantine is not None)
        except DiskFull as exc:
            event(log, "no_room", self.queue_id, level=logging.WARNING, client=self.client_ip, size=body.size,
                  error=str(exc))
            self._refuse_for_disk(body)  # the spool cancelled it: it is never delivered
            return
        self.server.metrics.accepted.inc()
        queue_id = self.server.aspool.core.queue_id(mid)
        if self._quarantine is not None:
            event(log, "quarantined", queue_id, reason=self._quarantine)
        event(log, "accepted", queue_id, message_id=message_id, from_=f"<{self.sender}>", size=body.size,
              nrcpt=len(self.recipients), client=self.client_ip, helo=self.conn.helo_name, proto=self._protocol(),
              tls=self.tls.protocol if self.tls is not None else None, auth=self.conn.authenticated,
              dkim=",".join(signed.signed_by) if signed is not None else None)
        self.conn.accept(Reply(250, "2.0.0", f"Ok: queued as {queue_id}"))
        self.recipients = []
        self.rcpt_dsn = {}

    def _policy_envelope(self, checked: Passed) -> None:
        """A policy server's REDIRECT (its address the one recipient) and BCC (one more), logged."""
        if checked.redirect is not None:
            event(log, "redirected", self.queue_id, to=f"<{checked.redirect}>", nrcpt=len(self.recipients),
                  reason="policy")
            self.recipients = [checked.redirect]
            self.rcpt_dsn = {}
        if checked.bcc is not None and checked.bcc not in self.recipients:
            event(log, "bcc", self.queue_id, to=f"<{checked.bcc}>", reason="policy")
            self.recipients.append(checked.bcc)

    def _facts(self, names: ClientNames) -> Facts:
        """The session as the milters' macros tell it (``mta.milter.chain.Facts``)."""
        stream = self.stream
        inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        peer: Any = ("", 0)
        local: Any = ("", 0)
        if isinstance(inner, trio.SocketStream):
            peer, local = inner.socket.getpeername(), inner.socket.getsockname()
        tls, cert = self.tls, self.client_cert
        return Facts(self.config.server.hostname, self.port.value, str(local[0]), self.client_ip, int(peer[1]),
                     self.conn.helo_name or "", tls.protocol if tls else None, tls.cipher if tls else None,
                     tls.bits if tls else None, self.conn.authenticated, self.auth_mechanism,
                     cert.subject if cert else None, cert.issuer if cert else None, names.name, names.reverse)

    async def _filter(self, body: BodyWriter) -> Reply | None:
        """The filters' say on the message (``mta.milter.accept``): the reply that ends it unstored, or None to
        go on with what they changed (sender, recipients, body; ``_quarantine``: enqueued held, so no delivery
        starts before the operator releases it)."""
        self._quarantine = None
        if self.filters is None:
            return None
        assert self.queue_id is not None
        got = await filter_body(self.filters, self.server.aspool, body, self.sender, self.recipients, self.queue_id)
        if got.outcome.reply is not None:
            return got.outcome.reply
        if got.outcome.discard or not got.recipients:
            event(log, "discarded", self.queue_id, client=self.client_ip, from_=f"<{self.sender}>",
                  reason="filter" if got.outcome.discard else "no_recipients")
            return Reply(250, "2.0.0", f"Ok: queued as {self.queue_id}")
        self.sender, self.recipients = got.sender, list(got.recipients)
        self._quarantine = got.quarantine
        return None

    def _filtered_out(self, body: BodyWriter, reply: Reply) -> None:
        """A filter refused the message (its reply), or discarded it (a 250): nothing is stored."""
        body.abort()
        self.recipients = []
        if reply.is_positive:
            self.conn.accept(reply)
        else:
            self.conn.reject(reply, "filter")

    def _protocol(self) -> str:
        """The ``with`` of the Received: header and the accepted line (ESMTPSA: TLS and AUTH)."""
        return received_protocol(esmtp=self.conn.esmtp, tls=self.tls is not None,
                                 smtputf8="SMTPUTF8" in self.mail_params, auth=self.conn.authenticated is not None)

    async def _sign(self, body: BodyWriter) -> Signature | None:
        """DKIM-sign the message of a client trusted to relay (in mynetworks, or authenticated), once, before it
        is committed.

        Mail from anyone else (to the relay's own domains) is never signed,
        whatever its From: says: a signature vouches that the mail came from
        the domain's own users. docs/security.md, "DKIM signing".
        """
        dkim = self.server.dkim
        if dkim is None or not (self.trusted or self.conn.authenticated is not None):
            return None
        result = await dkim.sign(self.server.aspool, body, self.queue_id)
        metrics = self.server.metrics
        if isinstance(result, Signature):
            for signed_by in result.signed_by:
                metrics.dkim_signed.labels(signed_by.partition("/")[0]).inc()
            return result
        metrics.dkim_unsigned.labels(result.reason).inc()
        return None

    def _transaction_over(self) -> None:
        """The message was answered (or its data ended with the connection): its sender and id are forgotten."""
        self.mail_from = None
        self.queue_id = None

    def _refuse_for_disk(self, body: BodyWriter) -> None:
        body.abort()
        self.conn.reject(self.server.disk.refusal(body.size), "disk")

    async def _starttls(self) -> bool:
        ctx = self.server.ssl_context
        if ctx is None or isinstance(self.stream, trio.SSLStream):
            self.conn.reject(R_NO_TLS, "tls_unavailable")
            return True
        self.conn.accept()
        await self._flush()
        # The handshake has a whole command_timeout of its own; a 421 in plaintext would only confuse it.
        self._timer.deadline = math.inf
        if not await self._handshake():
            return False
        self.conn.tls_started()
        self._command_done = True
        self._reset()
        return True

    async def _handshake(self) -> bool:
        """The server side of a TLS handshake, within ``command_timeout``: after STARTTLS's 220, or first of all
        on an implicit-TLS port. False (and a ``tls_failed`` line): it failed, the session is over."""
        ctx = self.server.ssl_context
        assert ctx is not None  # a submission listener needs TLS: the loader saw to it
        tls = trio.SSLStream(self.stream, ctx, server_side=True)
        with trio.move_on_after(self.config.server.command_timeout) as scope:
            try:
                await tls.do_handshake()
            except (trio.BrokenResourceError, ssl.SSLError) as exc:
                # trio reports a failed handshake as BrokenResourceError; the SSL error is its cause.
                why = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ else exc
                event(log, "tls_failed", direction="in", client=self.client_ip, reason="handshake",
                      error=str(why) or type(why).__name__)
                return False
        if scope.cancelled_caught:
            event(log, "tls_failed", direction="in", client=self.client_ip, reason="timeout")
            return False
        self.tls = tls_info(tls, verified=self.config.client_certs.ca_file is not None)
        self.client_cert = client_cert(tls)
        event(log, "tls", None, {"direction": "in", "client": self.client_ip, **self.tls.fields()})
        self.stream = tls
        return True

    async def _authenticate(self, ev: AuthRequest) -> bool:
        """Answer a complete AUTH exchange as ``mta.inbound.submission`` decides; False: the session is to end.

        Neither the password check nor the failure delay is the client's time.
        """
        auth = self.server.auth
        verdict = auth.locked(ev, self.client_ip)
        if verdict is None:
            with self._relay_busy():
                verdict = await auth.check(ev, self.client_ip, self.port.value)
        if verdict.delay > 0:
            await self._flush()
            with self._relay_busy():
                await trio.sleep(verdict.delay)
        if verdict.reply is None:
            self.auth_mechanism = ev.mechanism
            self.conn.accept()
        else:
            self.conn.reject(verdict.reply, verdict.reason)
        return not verdict.close
