"""The rate limits and the policy servers, as one session meets them: at MAIL, at RCPT, at the end of data.

The session (``mta.inbound.session``) makes one ``SessionChecks`` and calls it
once per stage; what it returns is a refusal to send (``Denial``) or leave
to go on. A rate limit's refusal is ``450 4.7.1``; the one that makes
``[limits] refusals_before_close`` in a session is ``421 4.7.0`` instead
and ends the session (``closing``): a client that keeps going against its
limit is not served further. The policy servers are asked after the
relay's own checks passed, and before the limits count a recipient (so a
greylisted recipient does not count).

What a policy server is told is what Postfix's smtpd tells it
(SMTPD_POLICY_README, "Protocol description"), from what this relay knows:
the client's names from the DNS (``mta.inbound.client_name``, looked up the
first time a server is asked in a session), the listener's address, TLS,
the SASL mechanism and user, a verified client certificate's names and
fingerprints (``[client_certs]``; empty without one), and the queue id, known
only at the end of data.

The actions on the whole message (REDIRECT, BCC, HOLD, DISCARD, FILTER:
``mta.policy.gate``) are collected over the transaction, the last of each
kind winning, and handed to the session at the end of data (``Passed``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Protocol

import attrs

from mta.config import Config
from mta.inbound.client_cert import ClientCert
from mta.inbound.client_name import ClientNames
from mta.limits.limiter import Over, RateLimits
from mta.observe.tlsinfo import TlsInfo
from mta.policy.gate import PolicyChecks, Verdict
from mta.smtp.common import Reply

__all__ = ["R_LIMIT_CLOSE", "Checks", "Denial", "Passed", "SessionChecks", "SessionView"]

R_LIMIT_CLOSE = Reply(421, "4.7.0", "Error: too many requests over the rate limits, closing connection")
_SERIAL = itertools.count(1)


class _Core(Protocol):
    @property
    def helo_name(self) -> str | None: ...
    @property
    def authenticated(self) -> str | None: ...
    @property
    def esmtp(self) -> bool: ...


class SessionView(Protocol):
    """What the checks read of a session (``mta.inbound.session._Session``)."""

    client_ip: str
    trusted: bool
    tls: TlsInfo | None
    sender: str
    recipients: list[str]
    queue_id: str | None
    client_cert: ClientCert | None
    auth_mechanism: str | None

    @property
    def conn(self) -> _Core: ...

    async def client_names(self) -> ClientNames: ...

    def local_address(self) -> tuple[str, int]: ...


@attrs.frozen
class Denial:
    """A command refused: ``reply``, the ``reason`` of its reject line, and whether the session ends after it."""

    reply: Reply
    reason: str
    close: bool = False


@attrs.frozen
class Passed:
    """The end of data may go on; ``headers`` (from PREPEND actions) go on top of the message; the policy
    servers' ``redirect`` (the one recipient instead), ``bcc`` (one more), ``hold`` (stored held, this the
    reason) and ``discard`` (250, not stored, this the reason)."""

    headers: tuple[str, ...] = ()
    redirect: str | None = None
    bcc: str | None = None
    hold: str | None = None
    discard: str | None = None
    filter: str | None = None  # the next hop every recipient is delivered to (``extra["filter"]``)


class Checks:
    """The relay's limits and policy servers, made once per relay process inside its trio loop.

    Raises (constructor): StartError when the limits' table cannot be opened.
    """

    def __init__(self, config: Config, previous: Checks | None = None) -> None:
        """``previous``: the checks a reload replaces (their counter table is kept if it is the same)."""
        self.config = config
        table = previous.limits.table if previous is not None else None
        self.limits: RateLimits = RateLimits(config.limits, config.source, table)
        self.policy = PolicyChecks(config.policy)

    def session(self, view: SessionView, busy: Callable[[], AbstractContextManager[None]]) -> SessionChecks:
        """``busy``: entered around each wait for a policy server (the relay's time, not the client's)."""
        return SessionChecks(self, view, busy)

    def close(self) -> None:
        """Replaced by a reload: the idle policy connections are closed (the table stays mapped while
        sessions that began before the reload still use it)."""
        self.policy.close()


class SessionChecks:
    """One session's state for the checks: its refusals so far, and the transaction's instance, size, headers."""

    def __init__(self, checks: Checks, view: SessionView, busy: Callable[[], AbstractContextManager[None]]) -> None:
        self.checks = checks
        self.view = view
        self.busy = busy
        self.refusals = 0
        self.closing = False
        self._session = f"{os.getpid():X}.{next(_SERIAL):X}"
        self._transactions = 0
        self.instance = ""
        self.size = 0
        self.headers: list[str] = []
        self.message: dict[str, str] = {}  # the transaction's redirect, bcc, hold, discard so far

    def mail(self, sender: str, params: Mapping[str, object]) -> Denial | None:
        """A MAIL command the relay would accept: counted on the message limits, or refused."""
        self._transactions += 1
        self.instance = f"{self._session}.{self._transactions:X}"
        size = params.get("SIZE")
        self.size = int(size) if isinstance(size, str) and size.isdigit() else 0
        self.headers = []
        self.message = {}
        v = self.view
        return self._over(self.checks.limits.at_mail(v.client_ip, v.trusted, v.conn.authenticated, sender))

    async def rcpt(self, recipient: str) -> Denial | None:
        """A recipient the relay would accept: the policy servers asked, then counted on the recipient limits."""
        v = self.view
        policy = self.checks.policy
        if policy.asked("rcpt", self._trusted()):
            names = await v.client_names()
            with self.busy():
                verdict = await policy.ask(self._attributes("RCPT", recipient, 0, names))
            if verdict.reply is not None:
                return Denial(verdict.reply, verdict.reason)
            self._keep(verdict)
        return self._over(self.checks.limits.at_rcpt(v.client_ip, v.trusted, v.conn.authenticated, v.sender))

    async def end_of_data(self, size: int) -> Denial | Passed:
        """The whole message arrived: the policy servers asked at ``data``; the headers to prepend."""
        v = self.view
        policy = self.checks.policy
        if policy.asked("data", self._trusted()):
            self.size = size
            one = v.recipients[0] if len(v.recipients) == 1 else ""
            names = await v.client_names()
            with self.busy():
                verdict = await policy.ask(self._attributes("END-OF-MESSAGE", one, len(v.recipients), names),
                                           v.queue_id)
            if verdict.reply is not None:
                return Denial(verdict.reply, verdict.reason)
            self._keep(verdict)
        return Passed(tuple(self.headers), **self.message)

    def _keep(self, verdict: Verdict) -> None:
        self.headers += verdict.headers
        for name in ("redirect", "bcc", "hold", "discard", "filter"):
            value = getattr(verdict, name)
            if value is not None:
                self.message[name] = value

    def _trusted(self) -> bool:
        return self.view.trusted or self.view.conn.authenticated is not None

    def _over(self, over: Over | None) -> Denial | None:
        if over is None:
            return None
        self.refusals += 1
        if self.refusals >= self.checks.config.limits.refusals_before_close:
            self.closing = True
            return Denial(R_LIMIT_CLOSE, over.limit, close=True)
        return Denial(over.reply, over.limit)

    def _attributes(self, state: str, recipient: str, count: int, names: ClientNames) -> dict[str, str]:
        v = self.view
        tls, cert = v.tls, v.client_cert
        user = v.conn.authenticated
        server_address, server_port = v.local_address()
        return {
            "request": "smtpd_access_policy",
            "protocol_state": state,
            "protocol_name": "ESMTP" if v.conn.esmtp else "SMTP",
            "helo_name": v.conn.helo_name or "",
            "queue_id": v.queue_id or "",
            "sender": v.sender,
            "recipient": recipient,
            "recipient_count": str(count),
            "client_address": v.client_ip,
            "client_name": names.name,
            "reverse_client_name": names.reverse,
            "server_address": server_address,
            "server_port": str(server_port),
            "instance": self.instance,
            "sasl_method": (v.auth_mechanism or "") if user is not None else "",
            "sasl_username": user or "",
            "sasl_sender": "",
            "size": str(self.size),
            "ccert_subject": cert.subject if cert is not None else "",
            "ccert_issuer": cert.issuer if cert is not None else "",
            "ccert_fingerprint": cert.fingerprint if cert is not None else "",
            "ccert_pubkey_fingerprint": cert.pubkey_fingerprint if cert is not None else "",
            "encryption_protocol": tls.protocol if tls is not None else "",
            "encryption_cipher": tls.cipher if tls is not None else "",
            "encryption_keysize": str(tls.bits) if tls is not None else "0",
            "etrn_domain": "",
            "stress": "",
        }
