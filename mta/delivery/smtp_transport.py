"""The SMTP transport: the trio shell around the sans-IO client core.

One ``deliver`` call takes a batch of messages for one destination and sends
them over as few connections as it can: hops are tried in order (MX
preference, or the fixed next hop), and a connection carries every message of
the batch unless it breaks, in which case the rest go to the next hop.

A connection that ends a batch in good order is kept for a while
(``ConnectionCache``, ``[delivery] connection_cache_time``) and carries the
next batch to the same hop. Whether it is still alive is checked without a
round trip when it was idle less than ``PROBE_AFTER`` (nothing may have
arrived on it while it was idle, and a failure before its first reply sends
the batch over a new connection: ``StaleConnection``), and with an RSET when
it was idle longer (docs/design.md, "Reusing a connection").

Deadlines. Every reply must come within ``command_timeout`` of when the
client starts waiting for it (RFC 5321 §4.5.3.2's five minutes), the body
must be sent within ``data_timeout`` and the reply to its end must come
within ``data_timeout`` (§4.5.3.2's ten minutes for the DATA termination).
A transaction has one cancel scope whose deadline moves as it goes: a scope
per read cost more CPU than the rest of the client core's reply handling.

Outcomes map from replies: 2xx delivered, 4xx deferred, 5xx bounced. Failing
to connect, a timeout or a broken connection is a deferral with code 0, which
the scheduler reads as "destination unreachable" for its backoff. The TLS
outcome (none, opportunistic, verified) is part of each outcome's next-hop
text, so the delivery log records it. A next hop that offers DSN gets the
message's DSN request (RET, ENVID, NOTIFY, ORCPT: ``mta.smtp.dsn_params``);
a recipient whose NOTIFY it took has ``DSN_PASSED`` at the end of its
next-hop text, so the scheduler knows the notices are the next hop's to send
now (``mta.delivery.dsn_notify``). To a next hop that offers CHUNKING and
PIPELINING the body goes in BDAT chunks as it is stored (RFC 3030: no
dot-stuffing, no 354 to wait for); CPU per message against DATA is in
docs/benchmarks.md.

Failures are named per address tried, as Postfix names them (``connect to
mx[192.0.2.5]:25: connection refused``, ``... timed out while receiving the
initial server greeting``, ``TLS handshake failed: ...``): each gets an
``event=connect_failed`` line with a one-word ``cause`` (refused, timeout,
unreachable, lost, tls, dns, rejected, protocol, error), and a deferral's reply
lists them (``failure_text``), so the operator sees the cause in the queue and
in a DSN, not ``all attempts to connect ... failed``. A new connection's TLS
session gets an ``event=tls`` line.

Published policies (MTA-STS, DANE: ``mta.delivery.tlspolicy``) are asked
before the first connection (``Planner.plan``): they choose which hops may be
tried and what TLS each must have (``HopTls``); each new session under a
policy is counted for TLS-RPT.
"""

from __future__ import annotations

import errno
import functools
import logging
import select
import ssl
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from mta.config import Config, parse_tls
from mta.config.smarthost_auth import Login
from mta.delivery import mx
from mta.delivery.connection_cache import CacheKey, ConnectionCache
from mta.delivery.dsn_notify import DSN_PASSED
from mta.delivery.smarthost_login import LoginFailed, Logins
from mta.delivery.tlspolicy import dane
from mta.delivery.tlspolicy.plan import HopTls, Plan, Planner
from mta.delivery.transport import BeforeDot, Destination, Job, OnOutcome, body_chunks
from mta.observe.logline import event
from mta.observe.tlsinfo import TlsInfo, tls_info
from mta.smtp import dsn_params
from mta.smtp.client import (
    ClientConnection,
    CommandReply,
    DataReply,
    EhloReply,
    Greeting,
    MessageReply,
    NeedData,
)
from mta.smtp.client import ConnectionClosed as ServerClosed
from mta.smtp.client import Event as ClientEvent
from mta.smtp.client_sasl import ClientLogin, LoginRefused, NoMechanism, choose
from mta.smtp.common import LocalProtocolError, RemoteProtocolError, Reply
from spool import Outcome, Status

log = logging.getLogger("mta.smtp")
# Body bytes gathered before a send_all: one write per this much, instead of one per stored chunk.
SEND_SIZE = 65536
# A deferral's reply names at most this many failed addresses (an MX set can be long).
FAILURES_SHOWN = 5
# What a conversation with a next hop can raise that is the hop's doing (or the network's), not ours.
_NETWORK_ERRORS = (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                   RemoteProtocolError, LocalProtocolError, ssl.SSLError)


class HopFailed(Exception):
    """This hop cannot take the mail now; ``reply`` is what it said, if anything; ``cause`` one word for why.

    ``result``: a TLS failure's RFC 8460 result type (``starttls-not-supported`` ...), for TLS-RPT.
    ``enhanced``: the RFC 3463 code of a failure of TLS the hop required (``security_code``), else empty.
    """

    def __init__(self, message: str, reply: Reply | None = None, cause: str = "protocol",
                 result: str | None = None, enhanced: str = "") -> None:
        super().__init__(message)
        self.reply = reply
        self.cause = cause
        self.result = result
        self.enhanced = enhanced


class StaleConnection(HopFailed):
    """A connection taken from the cache without an RSET died before its first reply: nothing was delivered
    on it (the body goes only after a 354), so the batch goes over another connection."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause="lost")


def _verify_result(reason: BaseException) -> str:
    """RFC 8460's result type for a failed handshake."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        code = reason.verify_code
        if code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
            return "certificate-host-mismatch"
        if code in (9, 10):  # not yet valid, expired
            return "certificate-expired"
        return "certificate-not-trusted"
    return "validation-failure"


def security_code(hop_tls: HopTls, result: str | None) -> str:
    """RFC 3463's code for a failure of TLS that ``hop_tls`` requires (a route's or a policy's), else empty.

    As Postfix names them: no STARTTLS where it is required is ``4.7.4``
    (security features not supported); a handshake, certificate or DANE
    failure is ``4.7.5`` (cryptographic failure). Opportunistic TLS that fails
    is no security failure: that hop's deferral stays ``4.4.1``.
    """
    if result is None or not hop_tls.requires_tls:
        return ""
    return "4.7.4" if result == "starttls-not-supported" else "4.7.5"


@attrs.frozen
class HopFailure:
    """One address that could not take the batch: ``cause`` (one word) and ``detail`` (what happened).

    ``enhanced``: the security code of a failure of required TLS (``security_code``), else empty.
    """

    hop: str
    cause: str
    detail: str
    enhanced: str = ""

    def __str__(self) -> str:
        return f"{self.hop}: {self.detail}"


# errno of a failed connect -> (cause, words): what ``connect to HOP: ...`` says.
_CONNECT_ERRORS = {
    errno.ECONNREFUSED: ("refused", "connection refused"),
    errno.ETIMEDOUT: ("timeout", "connection timed out"),
    errno.EHOSTUNREACH: ("unreachable", "no route to host"),
    errno.ENETUNREACH: ("unreachable", "network is unreachable"),
    errno.EADDRNOTAVAIL: ("unreachable", "address not available"),
    errno.ECONNRESET: ("lost", "connection reset by peer"),
    errno.EPIPE: ("lost", "connection closed by peer"),
}


def _first_os_error(exc: OSError) -> OSError:
    """trio's ``all attempts to connect ... failed`` holds the real errors in its cause: the first of them."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        inner = [e for e in cause.exceptions if isinstance(e, OSError)]
        if inner:
            return inner[0]
    return exc


def classify(exc: BaseException, hop: str, stage: str) -> HopFailure:
    """What went wrong at ``hop`` while it was in ``stage`` (``Session.stage``), for the log and the reply."""
    if isinstance(exc, HopFailed):
        return HopFailure(hop, exc.cause, f"{exc}" + (f": {exc.reply}" if exc.reply else ""), exc.enhanced)
    if isinstance(exc, trio.TooSlowError):
        return HopFailure(hop, "timeout", f"timed out while {stage}")
    if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError):
        first = _first_os_error(exc)
        cause, words = _CONNECT_ERRORS.get(first.errno or 0, ("error", first.strerror or str(first)))
        if stage == "connecting":
            return HopFailure(hop, cause, f"connect to {hop}: {words}")
        return HopFailure(hop, cause, f"{words} while {stage}")
    if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):
        return HopFailure(hop, "lost", f"lost connection while {stage}")
    if isinstance(exc, ssl.SSLError):
        return HopFailure(hop, "tls", f"TLS error while {stage}: {exc}")
    if isinstance(exc, RemoteProtocolError):
        return HopFailure(hop, "protocol", f"protocol error while {stage}: {exc}")
    return HopFailure(hop, "error", f"{type(exc).__name__} while {stage}: {exc}")


def deferral_code(failures: Sequence[HopFailure]) -> str:
    """The enhanced code of a batch that no hop took: a security code only when every hop failed on the TLS it
    required or on its login (``4.7.4`` when none offered TLS, ``4.7.8`` when each refused the login, ``4.7.5``
    for a mix); any other failure among them makes it ``4.4.1``."""
    codes = {f.enhanced for f in failures}
    if not failures or "" in codes:
        return "4.4.1"
    return codes.pop() if len(codes) == 1 else "4.7.5"


def failure_text(failures: Sequence[HopFailure]) -> str:
    """A deferral's reply: each address tried and what went wrong there (the first ``FAILURES_SHOWN``)."""
    if not failures:
        return "delivery failed: no address to try"
    shown = "; ".join(f.detail if f.detail.startswith("connect to ") else str(f) for f in failures[:FAILURES_SHOWN])
    more = len(failures) - FAILURES_SHOWN
    return shown + (f"; and {more} more address{'es' if more > 1 else ''}" if more > 0 else "")


def outcome_for(rcpt: str, reply: Reply, hop: str) -> Outcome:
    if reply.is_positive:
        status = Status.DELIVERED
    elif reply.is_transient:
        status = Status.DEFERRED
    else:
        status = Status.BOUNCED
    text = " ".join(line.strip() for line in reply.lines)
    return Outcome(rcpt, status, reply.code, reply.enhanced or "", text, hop)


def client_ssl_context(tls_mode: str, ca_file: str | None = None) -> ssl.SSLContext:
    """TLS 1.2 or later; the certificate is checked (chain and host name) only for ``verify``.

    ``ca_file`` is trusted in addition to the system's CAs (a private smarthost's CA).
    """
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls_mode != "verify":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif ca_file:
        ctx.load_verify_locations(cafile=ca_file)
    return ctx


class _Session:
    """One client connection: greeting, EHLO, maybe STARTTLS, then transactions."""

    def __init__(self, stream: trio.abc.Stream, host: str, config: Config, helo: str = "") -> None:
        self.stream = stream
        self.host = host
        self.config = config
        self.helo = helo or config.server.hostname  # an egress address's own name ([egress.sources])
        self.conn = ClientConnection()
        self.tls = "none"
        self.tls_info: TlsInfo | None = None
        self.sent = 0  # messages this connection has carried
        self.stage = "receiving the initial server greeting"  # what it was doing, for a failure's words
        self.idled = 0.0  # how long it last sat in the connection cache (ConnectionCache.take sets it)
        # Taken from the cache without an RSET and no reply heard since: a failure now is a StaleConnection.
        self.unproven = False
        self.logged_in: str | None = None  # the user this connection is logged in as

    def peer_spoke(self) -> bool:
        """Did anything arrive while the connection sat idle (a 421, an EOF, a TLS alert)? Never raises.

        Between transactions the server has nothing to say; anything it said
        is its goodbye. One non-blocking poll of the socket, no round trip.
        """
        stream = self.stream
        if isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        sock = getattr(stream, "socket", None)
        if sock is None:
            return False
        try:  # poll, not select: select cannot watch a descriptor above 1023, and a busy relay has them
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))  # POLLIN, or POLLHUP / POLLERR, which poll reports unasked
        except (OSError, ValueError):
            return True

    async def alive(self) -> bool:
        """RSET and its 250: is a connection that sat idle still usable? Never raises."""
        try:
            self.conn.rset()
            ev = await self._event(min(30.0, self.config.delivery.command_timeout))
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                RemoteProtocolError, LocalProtocolError, ssl.SSLError):
            return False
        return isinstance(ev, CommandReply) and ev.reply.is_positive and self.conn.idle

    async def _event(self, timeout: float) -> ClientEvent:
        """The next event, within ``timeout``: for the greeting, EHLO, STARTTLS and RSET (one scope each)."""
        with trio.fail_after(timeout):
            return await self._next()

    async def _next(self) -> ClientEvent:
        """The next event: whatever the core has to send goes in one write, then reads until an event.

        Every reply already in the buffer is parsed before the next read. No
        deadline of its own: the caller's cancel scope is the deadline.
        """
        conn = self.conn
        while True:
            ev = conn.next_event()
            if not isinstance(ev, NeedData):
                return ev
            out = conn.data_to_send()
            if out:
                await self.stream.send_all(out)
            conn.receive_data(await self.stream.receive_some(65536))

    async def open(self, hop_tls: HopTls) -> None:
        """Greeting, EHLO, STARTTLS as ``hop_tls`` requires it. Raises HopFailed (with a TLS-RPT ``result``)."""
        tls_mode, server_name = hop_tls.mode, hop_tls.server_name
        t = self.config.delivery.command_timeout
        ev = await self._event(t)
        if not isinstance(ev, Greeting) or not ev.reply.is_positive:
            raise HopFailed("refused in the greeting", getattr(ev, "reply", None), "rejected")
        await self._hello(t)
        caps = self.conn.capabilities
        if tls_mode == "none":
            return
        if caps is None or not caps.starttls:
            if hop_tls.requires_tls:
                why = "the route requires TLS" if hop_tls.report is None else f"its {hop_tls.label} policy requires TLS"
                raise HopFailed(f"does not offer STARTTLS and {why}", cause="tls", result="starttls-not-supported")
            return
        self.stage = "sending STARTTLS"
        self.conn.starttls()
        ev = await self._event(t)
        if not isinstance(ev, CommandReply) or not ev.reply.is_positive:
            if hop_tls.requires_tls:
                raise HopFailed("STARTTLS refused", getattr(ev, "reply", None), "tls", "starttls-not-supported")
            return
        await self.stream.send_all(self.conn.data_to_send())
        ctx = client_ssl_context(tls_mode, self.config.delivery.tls_ca_file)
        tls_stream = trio.SSLStream(self.stream, ctx, server_hostname=server_name)
        self.stage = "performing the TLS handshake"
        try:
            with trio.fail_after(t):
                await tls_stream.do_handshake()
        except (ssl.SSLError, trio.BrokenResourceError) as exc:
            # trio reports a failed handshake as BrokenResourceError; the reason (an
            # unverifiable certificate, say) is its cause and belongs in the log.
            reason = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ else exc
            raise HopFailed(f"TLS handshake failed: {reason}", cause="tls", result=_verify_result(reason)) from None
        self.stream = tls_stream
        if hop_tls.tlsa:
            mismatch = dane.check(dane.peer_chain(tls_stream), hop_tls.tlsa, hop_tls.names)
            if mismatch is not None:
                raise HopFailed(f"DANE: {mismatch}", cause="tls", result="validation-failure")
        self.conn.tls_started()
        self.tls = hop_tls.label
        self.tls_info = tls_info(tls_stream, verified=tls_mode == "verify" or bool(hop_tls.tlsa))
        await self._hello(t)

    async def log_in(self, login: Login) -> None:
        """AUTH as ``login`` (``mta.smtp.client_sasl``), after the TLS the route requires. Raises LoginFailed, or
        what the connection raises."""
        caps = self.conn.capabilities
        try:
            mechanism = choose(caps.keywords.get("AUTH", "") if caps is not None else "", login.mechanism)
        except NoMechanism as exc:
            raise LoginFailed(str(exc)) from None
        exchange = ClientLogin(mechanism, login.user, login.password)
        self.stage = f"logging in as {login.user} ({mechanism})"
        line: str | None = exchange.start()
        while line is not None:
            self.conn.auth(line)
            ev = await self._event(self.config.delivery.command_timeout)
            reply = getattr(ev, "reply", None)
            if not isinstance(ev, CommandReply) or reply is None:
                raise HopFailed(f"connection closed while {self.stage}", reply, "lost")
            try:
                line = exchange.answer(reply)
            except LoginRefused as refused:
                r = refused.reply
                enhanced = "4.7.8" if r.code == 535 or (r.code >= 500 and not r.enhanced) else \
                    "4." + (r.enhanced or "4.7.0").partition(".")[2]
                raise LoginFailed(f"login as {login.user} ({mechanism}) refused", r, enhanced) from None
        self.logged_in = login.user

    async def _hello(self, timeout: float) -> None:
        self.stage = "sending EHLO"
        self.conn.ehlo(self.helo)
        ev = await self._event(timeout)
        if isinstance(ev, EhloReply) and ev.reply.is_positive:
            return
        self.stage = "sending HELO"
        self.conn.helo(self.helo)
        ev = await self._event(timeout)
        if not isinstance(ev, EhloReply) or not ev.reply.is_positive:
            raise HopFailed("refused HELO", getattr(ev, "reply", None), "rejected")

    async def send(self, job: Job, hop: str, before_dot: Callable[[], Awaitable[None]] | None = None) -> list[Outcome]:
        """One transaction: MAIL, RCPT, DATA (one write with PIPELINING), the body, its reply; or, to a next hop
        that offers CHUNKING and PIPELINING, MAIL, RCPT and the body in BDAT chunks without waiting, its reply.

        ``before_dot``: the point of no return (``transport.BeforeDot``), awaited once the body is sent, right
        before the write that carries the final dot (``_send_body``): its record becomes durable as late as it
        can, so that a crash leaves in doubt only a transaction that was at its dot (docs/design.md, "The point
        of no return"). A transaction that ends before its dot never calls it.

        Raises trio.TooSlowError when a deadline passes (module docstring), StaleConnection when a connection
        taken from the cache unproven fails before its first reply, HopFailed or a network error otherwise.
        """
        return await self._transaction(job, hop, before_dot)

    async def _transaction(self, job: Job, hop: str, before_dot: Callable[[], Awaitable[None]] | None) -> list[Outcome]:
        d = self.config.delivery
        caps = self.conn.capabilities
        params: dict[str, str | None] = {}
        if caps is not None and caps.size is not None:
            params["SIZE"] = str(job.size)
        body_param = job.extra.get("params")
        if isinstance(body_param, dict) and body_param:
            if body_param.get("SMTPUTF8") and caps is not None and caps.smtputf8:
                params["SMTPUTF8"] = None
            if str(body_param.get("BODY", "")).upper() == "8BITMIME" and caps is not None and caps.eightbitmime:
                params["BODY"] = "8BITMIME"
        dsn = caps is not None and caps.dsn
        if dsn:
            params.update(dsn_params.mail_params(job.extra))
        passed: set[str] = set()  # recipients whose NOTIFY the next hop took over (no "relayed" notice from us)
        self.stage = "sending the envelope (MAIL, RCPT, DATA)"
        self.conn.mail(job.sender, params)
        for rcpt in job.recipients:
            rcpt_params = dsn_params.rcpt_params(job.extra, rcpt) if dsn else {}
            if "NOTIFY" in rcpt_params:
                passed.add(rcpt)
            self.conn.rcpt(rcpt, rcpt_params)
        # Not on a connection reused unproven: its death must show before any of the body is sent. Not over LMTP,
        # whose per-recipient replies to the end of data the client core reads after DATA only.
        chunking = (caps is not None and caps.chunking and caps.pipelining and not self.unproven
                    and not self.conn.lmtp)
        with trio.CancelScope(deadline=trio.current_time() + d.command_timeout) as scope:
            if chunking:  # RFC 3030: the body goes at once, as it is stored, in BDAT chunks
                self.conn.bdat()
                self.stage = "sending the message body"
                scope.deadline = trio.current_time() + d.data_timeout
                await self._send_body(job, before_dot)
                self.stage = "waiting for the reply to the end of data"
            else:
                self.conn.data()
            while True:
                ev = await self._first() if self.unproven else await self._next()
                if isinstance(ev, DataReply) and ev.go_ahead:
                    self.stage = "sending the message body"
                    scope.deadline = trio.current_time() + d.data_timeout
                    await self._send_body(job, before_dot)
                    self.stage = "waiting for the reply to the end of data"
                    scope.deadline = trio.current_time() + d.data_timeout
                elif isinstance(ev, MessageReply):
                    return [outcome_for(o.address, o.reply, hop + DSN_PASSED if o.address in passed else hop)
                            for o in ev.outcomes]
                elif isinstance(ev, ServerClosed):
                    raise HopFailed(f"connection closed by the server while {self.stage}", cause="lost")
                elif not isinstance(ev, CommandReply | DataReply) and hasattr(ev, "reply") and \
                        ev.reply.code == 421:
                    raise HopFailed("the server is closing the connection", ev.reply, "rejected")
                else:
                    scope.deadline = trio.current_time() + d.command_timeout  # the next reply's own budget
        raise trio.TooSlowError  # the scope's deadline passed (a return inside it is the only other way out)

    async def _first(self) -> ClientEvent:
        """The first event on a connection reused unproven: its death (EOF, reset, a 421) is a StaleConnection."""
        try:
            ev = await self._next()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError) as exc:
            raise StaleConnection(f"the cached connection was lost while {self.stage}: {exc}") from exc
        self.unproven = False
        if isinstance(ev, ServerClosed) or (hasattr(ev, "reply") and ev.reply.code == 421):
            raise StaleConnection(f"the cached connection was closed by the server while {self.stage}")
        return ev

    async def _send_body(self, job: Job, before_dot: Callable[[], Awaitable[None]] | None = None) -> None:
        """The body, in writes of ``SEND_SIZE`` or more; the last write carries the final dot (or the BDAT LAST),
        and goes out only once ``before_dot`` returned (what is still buffered is no message to the next hop
        without it)."""
        conn = self.conn
        async for chunk in body_chunks(job.body):  # big stored bodies are read in a worker thread
            conn.send_body(chunk)
            if conn.buffered >= SEND_SIZE:
                await self.stream.send_all(conn.data_to_send())
        if before_dot is not None:
            self.stage = "recording the point of no return"
            await before_dot()
            self.stage = "sending the message body"
        conn.end_data()
        await self.stream.send_all(conn.data_to_send())  # the rest and the final dot, together

    async def close(self) -> None:
        try:
            with trio.move_on_after(5):
                self.conn.quit()
                await self.stream.send_all(self.conn.data_to_send())
        except (trio.BrokenResourceError, trio.ClosedResourceError, LocalProtocolError, ssl.SSLError, OSError):
            pass
        await trio.aclose_forcefully(self.stream)


class SmtpTransport:
    PASSES_DOT = True  # before_dot before each final dot (_Session._send_body)

    def __init__(self, config: Config) -> None:
        self.config = config
        r = config.delivery.resolver
        self.resolver = mx.make_resolver(r.host if r else None, r.port if r else 53)
        d = config.delivery
        self.cache: ConnectionCache[_Session] = ConnectionCache(d.connection_cache_time, d.per_destination)
        self.policies = Planner(config, self.resolver)
        # The plans of fixed next hops under no published policy: they never change (one per route).
        self._fixed_plans: dict[Destination, Plan] = {}
        self.logins = Logins(config.smarthost_auth.secrets_file)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The connection cache's keeper (without it every batch opens and closes its own connection), and the
        daily TLS-RPT roll-up."""
        async with trio.open_nursery() as nursery:
            if self.policies.reporter is not None:
                await nursery.start(self.policies.reporter.run)
            await self.cache.run(task_status=task_status)

    async def _connect(self, destination: Destination, hop: mx.Hop, hop_tls: HopTls, key: CacheKey,
                       qids: list[str]) -> _Session:
        """A live connection to ``hop``, ready for MAIL: from the cache if one is alive, else a new one.

        Raises HopFailed (a timeout to connect included), OSError (the connect's own, ECONNREFUSED say),
        or whatever the greeting, EHLO and TLS raise; ``classify`` names each.
        """
        cache = self.cache
        while (cached := cache.take(key)) is not None:
            if cached.peer_spoke():
                pass  # its 421 or its EOF, sent while it was idle: it is gone
            elif cached.idled < cache.probe_after:
                cached.unproven = True  # its first reply proves it (StaleConnection if it never comes)
                cache.reused += 1
                return cached
            elif await cached.alive():
                cache.reused += 1
                cache.probed += 1
                return cached
            await cached.close()
        if hop_tls.refuse:
            self.policies.record(hop_tls, hop, hop_tls.refuse_result, detail=hop_tls.refuse)
            raise HopFailed(hop_tls.refuse, cause="tls", result=hop_tls.refuse_result, enhanced="4.7.5")
        login = self.logins.for_hop(destination, hop)
        if login is not None and not hop_tls.requires_tls:
            detail = (f"a login for {hop.host}:{hop.port} is in secrets_file, but the route does not require TLS "
                      f"(tls={destination.tls}): the password is sent only with tls=require or tls=verify")
            self.logins.failed((hop.host.lower(), hop.port), _label(hop), login.user, detail)
            raise HopFailed(detail, cause="auth", enhanced="4.7.0")
        try:
            return await self._open(hop, hop_tls, qids, login, destination)
        except HopFailed as exc:
            if exc.result is None or not hop_tls.testing or hop_tls.report is None:
                raise
            # MTA-STS testing mode: log what enforce would have done, then deliver as before.
            event(log, "mta_sts_testing", None, qids=qids, domain=hop_tls.report.domain, relay=_label(hop),
                  would="defer", detail=str(exc))
            return await self._open(hop, hop_tls.relaxed(), qids, None, destination)

    async def _open(self, hop: mx.Hop, hop_tls: HopTls, qids: list[str], login: Login | None = None,
                    destination: Destination | None = None) -> _Session:
        """A new connection to ``hop``, its TLS as ``hop_tls`` says, logged in as ``login`` (``smarthost_login``);
        a session under a policy is counted. From ``destination.source`` with its EHLO name, if it names one."""
        timeout = self.config.delivery.connect_timeout
        source = destination.source if destination is not None else ""
        try:
            with trio.fail_after(timeout):
                stream = await trio.open_tcp_stream(hop.address, hop.port, local_address=source or None)
        except trio.TooSlowError:
            raise HopFailed(f"connect to {_label(hop)}: timed out after {timeout:g} s", cause="timeout") from None
        session = _Session(stream, hop.host, self.config, destination.helo if destination is not None else "")
        local = _local_address(stream)
        try:
            await session.open(hop_tls)
            if login is not None:
                await session.log_in(login)
                self.logins.succeeded((hop.host.lower(), hop.port), _label(hop), login.user)
        except LoginFailed as exc:
            await session.close()
            detail = f"{exc}: {exc.reply}" if exc.reply is not None else str(exc)
            assert login is not None
            self.logins.failed((hop.host.lower(), hop.port), _label(hop), login.user, detail)
            raise HopFailed(detail, cause="auth", enhanced=exc.enhanced) from None
        except HopFailed as exc:
            await session.close()
            failure = classify(exc, _label(hop), session.stage)
            if exc.result is not None:
                self.policies.record(hop_tls, hop, exc.result, local=local, detail=str(exc))
            raise HopFailed(failure.detail, cause=failure.cause, result=exc.result,
                            enhanced=exc.enhanced or security_code(hop_tls, exc.result)) from None
        except _NETWORK_ERRORS as exc:
            await session.close()
            failure = classify(exc, _label(hop), session.stage)  # the stage dies with the session: name it now
            raise HopFailed(failure.detail, cause=failure.cause) from None
        except BaseException:
            await session.close()
            raise
        if session.tls_info is not None:
            event(log, "tls", None, {"direction": "out", "qids": qids, "relay": _label(hop),
                                     **session.tls_info.fields()})
        if hop_tls.report is not None:
            self.policies.record(hop_tls, hop, None, local=local)
        return session

    @staticmethod
    async def _send_all(session: _Session, jobs: Sequence[Job], todo: list[int],
                        results: list[list[Outcome] | None], label: str, on_outcome: OnOutcome | None,
                        before_dot: BeforeDot | None = None) -> None:
        """Send the jobs ``todo`` over ``session`` in turn, each one's outcomes recorded as it is answered."""
        hop = f"{label} tls={session.tls}"
        for i in todo:
            dot = None if before_dot is None else functools.partial(before_dot, i, jobs[i].recipients)
            outcomes = results[i] = await session.send(jobs[i], hop, dot)
            session.sent += 1
            if on_outcome is not None:
                on_outcome(i, outcomes)  # final: a job answered at one hop is not tried at the next

    async def _hops(self, dest: Destination) -> list[mx.Hop]:
        if dest.kind == "smtp":
            host, _, port = dest.target.rpartition(":")
            return [mx.Hop(host, host, int(port))]
        return await mx.lookup(self.resolver, dest.target, port=self.config.delivery.mx_port)

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        results: list[list[Outcome] | None] = [None] * len(jobs)
        qids = [job.queue_id for job in jobs]
        plan = self._fixed_plans.get(destination)
        if plan is None:
            try:
                hops = await self._hops(destination)
            except mx.LookupError_ as exc:
                status, code, enh = (Status.BOUNCED, 550, "5.1.2") if exc.permanent else (Status.DEFERRED, 0, "4.4.3")
                event(log, "connect_failed", None, qids=qids, relay=destination.target, cause="dns", detail=str(exc),
                      permanent=exc.permanent)
                return [[Outcome(r, status, code, enh, str(exc), str(destination)) for r in job.recipients]
                        for job in jobs]
            plan = await self.policies.plan(destination, hops, qids)
            if destination.kind == "smtp" and not parse_tls(destination.tls)[1]:
                self._fixed_plans[destination] = plan  # no lookup went into it: the same next time
        if plan.refused:
            event(log, "connect_failed", None, qids=qids, relay=destination.target, cause="tls_policy",
                  detail=plan.refused)
            return [[Outcome(r, Status.DEFERRED, 0, "4.7.5", plan.refused, str(destination)) for r in job.recipients]
                    for job in jobs]
        failures: list[HopFailure] = []
        for hop, hop_tls in plan.hops:
            todo = [i for i, r in enumerate(results) if r is None]
            if not todo:
                break
            label = _label(hop)
            key = (destination, hop.address, hop.port)
            session: _Session | None = None
            try:
                while True:
                    session = await self._connect(destination, hop, hop_tls, key, [qids[i] for i in todo])
                    try:
                        await self._send_all(session, jobs, todo, results, label, on_outcome, before_dot)
                        break
                    except StaleConnection as exc:
                        # Died before its first reply: nothing was sent on it. The next one comes from the
                        # cache (whose connections are fewer each time) or is new (never unproven): bounded.
                        self.cache.stale += 1
                        event(log, "connection_stale", None, qids=[qids[i] for i in todo], relay=label,
                              detail=str(exc), action="retried on another connection")
                        await session.close()
                        session = None
                        todo = [i for i in todo if results[i] is None]
                if session.conn.idle and session.sent < self.config.delivery.max_messages_per_connection \
                        and self.cache.put(key, session):
                    session = None  # the cache has it now
            except (HopFailed, *_NETWORK_ERRORS) as exc:
                failure = classify(exc, label, session.stage if session is not None else "connecting")
                failures.append(failure)
                event(log, "connect_failed", None, qids=[qids[i] for i, r in enumerate(results) if r is None],
                      relay=label, cause=failure.cause, detail=failure.detail)
            finally:
                if session is not None:
                    await session.close()
        text, enhanced = failure_text(failures), deferral_code(failures)
        return [r if r is not None else
                [Outcome(rcpt, Status.DEFERRED, 0, enhanced, text, str(destination)) for rcpt in job.recipients]
                for r, job in zip(results, jobs, strict=True)]


def _local_address(stream: trio.SocketStream) -> str:
    """The relay's own address on this connection (TLS-RPT's ``sending-mta-ip``)."""
    try:
        return str(stream.socket.getsockname()[0])
    except OSError:
        return ""


def _label(hop: mx.Hop) -> str:
    """How a hop is named in replies and logs, as Postfix does: ``mx.example.com[192.0.2.5]:25``."""
    return f"{hop.host}[{hop.address}]:{hop.port}"
