"""The filters of one SMTP session: its milters in order, then rspamd over HTTP, and the failure default.

Why lazily: the milters are connected at the session's first MAIL (connect
and HELO are told then, with their macros, as if they had just happened), so
a session that never sends mail costs them nothing and a milter's verdict on
the connection is given where the relay can give it, at MAIL (Postfix's
``smtpd_delay_reject``).

Verdicts, as Postfix gives them: a reject is ``550 5.7.1 Command rejected``, a
tempfail ``451 4.7.1 Service unavailable - try again later``, a custom reply
the milter's own; at RCPT they refuse that recipient, at every other stage
the transaction (at connect or HELO, every transaction of the session).
Discard at any message stage answers ``250`` and stores nothing. The DATA
stage is asked when the client sends DATA (``data``), so its refusal is the
answer to DATA instead of the ``354``; with BDAT there is no such moment
before the content, and it is asked at the content's end, first. Accept ends
what that milter is asked about the message (or the session).

Failures (``MilterFailed``, ``RspamdFailed``): ``tempfail`` and ``reject`` give
their reply now and at every later MAIL of the session (the milter is not
asked again); ``accept`` goes on without that milter for the session.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs
import trio

from mta.config.filters import FiltersSection, MilterAddress
from mta.milter import protocol as p
from mta.milter.apply import Message
from mta.milter.changes import Accept, Continue, CustomReply, Discard, Reject, Tempfail, Verdict
from mta.milter.client import Answer, MilterClient, MilterFailed, MilterLimits
from mta.milter.rspamd import Envelope, RspamdFailed, check
from mta.milter.session import Stage
from mta.observe.logline import event
from mta.smtp.common import Reply

log = logging.getLogger("mta.milter")

R_REJECT = Reply(550, "5.7.1", "Command rejected")
R_TEMPFAIL = Reply(451, "4.7.1", "Service unavailable - try again later")
R_FAILED_REJECT = Reply(554, "5.7.1", "Service unavailable, message rejected")


@attrs.frozen
class Facts:
    """What the milters' macros are made of: the session as the relay knows it at MAIL."""

    hostname: str  # j: the relay's own name
    daemon_name: str  # the listener: smtp, submission, submissions
    daemon_addr: str
    client_ip: str
    client_port: int
    helo: str
    tls_version: str | None = None
    cipher: str | None = None
    cipher_bits: int | None = None
    auth_user: str | None = None
    auth_type: str | None = None
    cert_subject: str | None = None  # a verified client certificate's (``mta.inbound.client_cert``)
    cert_issuer: str | None = None
    client_name: str = "unknown"  # forward-confirmed (``mta.inbound.client_name``)
    client_ptr: str = "unknown"  # the PTR's, unchecked

    def macros(self) -> dict[str, str]:
        values = {"j": self.hostname, "v": "logspool", "daemon_name": self.daemon_name,
                  "daemon_addr": self.daemon_addr, "client_addr": self.client_ip,
                  "client_port": str(self.client_port), "client_name": self.client_name,
                  "client_ptr": self.client_ptr, "_": f"{self.client_ptr} [{self.client_ip}]"}
        if self.tls_version is not None:
            values.update(tls_version=self.tls_version, cipher=self.cipher or "", cipher_bits=str(self.cipher_bits))
        if self.cert_subject is not None:
            values.update(cert_subject=self.cert_subject, cert_issuer=self.cert_issuer or "")
        if self.auth_user is not None:
            values.update(auth_authen=self.auth_user, auth_type=self.auth_type or "")
        return values


@attrs.frozen
class Outcome:
    """The filters' say on a message: a refusal, or ``discard`` (250, nothing stored), or neither."""

    reply: Reply | None = None
    discard: bool = False


def failure_reply(action: str) -> Reply | None:
    return {"tempfail": R_TEMPFAIL, "reject": R_FAILED_REJECT}.get(action)


def verdict_reply(verdict: Verdict | None) -> Reply | None:
    if isinstance(verdict, Reject):
        return R_REJECT
    if isinstance(verdict, Tempfail):
        return R_TEMPFAIL
    if isinstance(verdict, CustomReply):
        return verdict.reply
    return None


class FilterSession:
    """The filters one SMTP session asks. Made per session (``for_session``); ``aclose`` when it ends."""

    def __init__(self, settings: FiltersSection, milters: tuple[MilterAddress, ...], rspamd_url: str | None) -> None:
        self.settings = settings
        limits = MilterLimits(settings.milter_connect_timeout, settings.milter_command_timeout,
                              settings.milter_message_timeout)
        self._pending = [MilterClient(a, limits) for a in milters]  # not yet connected
        self._clients: list[MilterClient] = []
        self._rspamd_url = rspamd_url
        self._opened = False
        self._session_refusal: Reply | None = None  # a verdict on the connection, or a failure's default
        self._rspamd_broken = False
        self._in_message = False
        self._discard = False
        self._data_asked = False  # the message's DATA stage is done (at the DATA command)
        self._facts: Facts | None = None
        self._values: dict[str, str] = {}

    @classmethod
    def for_session(cls, settings: FiltersSection, submission: bool) -> FilterSession | None:
        milters, rspamd = settings.milters_for(submission), settings.rspamd_for(submission)
        return cls(settings, milters, rspamd) if milters or rspamd else None

    async def mail(self, facts: Facts, sender: str, params: Mapping[str, object]) -> Reply | None:
        """A new transaction: the milters' say on MAIL (after connect and HELO the first time)."""
        self._facts = facts
        self._discard = False
        self._data_asked = False
        if not self._opened:
            self._opened = True
            self._values = facts.macros()
            await self._open(facts)
        elif self._in_message:
            for client in list(self._clients):
                try:
                    await client.new_message()
                except MilterFailed as exc:
                    self._failed(client, exc)
        self._in_message = True
        if self._session_refusal is not None:
            return self._session_refusal
        self._values.update(mail_addr=sender, mail_host="", mail_mailer="smtp")
        self._values.pop("i", None)
        packet = p.envelope(p.C_MAIL, sender, _params(params))
        return await self._stage(Stage.MAIL, [packet])

    async def rcpt(self, address: str, params: Mapping[str, object]) -> Reply | None:
        if self._session_refusal is not None:
            return self._session_refusal
        self._values.update(rcpt_addr=address, rcpt_host="", rcpt_mailer="smtp")
        return await self._stage(Stage.RCPT, [p.envelope(p.C_RCPT, address, _params(params))])

    async def data(self, queue_id: str) -> Reply | None:
        """The milters' DATA stage, at the DATA command: a refusal to give instead of the ``354``, or None."""
        if self._session_refusal is not None:
            return self._session_refusal
        self._values["i"] = queue_id
        self._data_asked = True
        return await self._stage(Stage.DATA, [p.packet(p.C_DATA)],
                                 trio.current_time() + self.settings.milter_message_timeout)

    async def message(self, msg: Message, queue_id: str) -> Outcome:
        """The content stages for each milter in turn, then rspamd; ``msg`` is changed as they ask."""
        if self._session_refusal is not None:
            return Outcome(self._session_refusal)
        self._values["i"] = queue_id
        for client in list(self._clients):
            if self._discard:
                break
            try:
                reply = await self._content(client, msg)
            except MilterFailed as exc:
                reply = self._failed(client, exc)
            if reply is not None:
                return Outcome(reply)
        if not self._discard and self._rspamd_url is not None and not self._rspamd_broken:
            reply = await self._rspamd(self._rspamd_url, msg, queue_id)
            if reply is not None:
                return Outcome(reply)
        return Outcome(discard=self._discard)

    async def aclose(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await client.aclose()

    async def _open(self, facts: Facts) -> None:
        connect = p.connect(facts.client_name, facts.client_ip, facts.client_port)
        helo = p.helo(facts.helo)
        for client in self._pending:
            try:
                await client.open()
                self._clients.append(client)
                for stage, packet in ((Stage.CONNECT, connect), (Stage.HELO, helo)):
                    answer = await client.ask(stage, [packet], self._values, trio.current_time() + 3600)
                    reply = verdict_reply(answer.verdict)
                    if reply is not None:
                        self._session_refusal = reply
                        return
            except MilterFailed as exc:
                self._failed(client, exc)
                if self._session_refusal is not None:
                    return
        self._pending = []

    async def _stage(self, stage: Stage, packets: list[bytes], deadline: float | None = None) -> Reply | None:
        for client in list(self._clients):
            if self._discard:
                return None
            try:
                answer = await client.ask(stage, packets, self._values,
                                          trio.current_time() + 3600 if deadline is None else deadline)
            except MilterFailed as exc:
                reply = self._failed(client, exc)
                if reply is not None:
                    return reply
                continue
            reply = self._verdict(answer.verdict)
            if reply is not None:
                return reply
        return None

    def _verdict(self, verdict: Verdict | None) -> Reply | None:
        if isinstance(verdict, Discard):
            self._discard = True
        return verdict_reply(verdict)

    async def _content(self, client: MilterClient, msg: Message) -> Reply | None:
        """One milter's DATA, headers, end of headers, body and end of message; its changes made on ``msg``."""
        deadline = trio.current_time() + self.settings.milter_message_timeout
        steps: list[tuple[Stage, bytes]] = [] if self._data_asked else [(Stage.DATA, p.packet(p.C_DATA))]
        negotiated = client.negotiated
        space = " " if negotiated is not None and negotiated.protocol & p.P_HDR_LEADSPC else ""
        steps += [(Stage.HEADER, p.header(f.name, space + f.value)) for f in msg.fields]
        steps.append((Stage.EOH, p.packet(p.C_EOH)))
        steps += [(Stage.BODY, chunk) for chunk in p.body_chunks(msg.body)]
        steps.append((Stage.EOM, p.packet(p.C_BODYEOB)))
        for stage, packet in steps:
            answer: Answer = await client.ask(stage, [packet], self._values, deadline)
            if stage is Stage.EOM and not isinstance(answer.verdict, Reject | Tempfail | CustomReply):
                msg.apply(answer.changes)
            reply = self._verdict(answer.verdict)
            if reply is not None or isinstance(answer.verdict, Accept | Discard):
                return reply
        return None

    async def _rspamd(self, url: str, msg: Message, queue_id: str) -> Reply | None:
        facts = self._facts
        assert facts is not None
        env = Envelope(facts.client_ip, facts.helo, facts.hostname, queue_id, facts.auth_user)
        try:
            scan = await check(url, msg, env, self.settings.rspamd_timeout)
        except RspamdFailed as exc:
            event(log, "filter_failed", queue_id, level=logging.WARNING, filter="rspamd", reason=exc.reason,
                  error=exc.detail or None, action=self.settings.rspamd_default_action)
            if self.settings.rspamd_default_action == "accept":
                self._rspamd_broken = True
                return None
            return failure_reply(self.settings.rspamd_default_action)
        event(log, "rspamd", queue_id, action=scan.action, score=scan.score)
        if not isinstance(scan.verdict, CustomReply):
            msg.apply(scan.changes)
        if isinstance(scan.verdict, Continue):
            return None
        return self._verdict(scan.verdict)

    def _failed(self, client: MilterClient, exc: MilterFailed) -> Reply | None:
        """The failure default for ``client``; it is asked nothing more in this session."""
        action = self.settings.milter_default_action
        event(log, "filter_failed", self._values.get("i"), level=logging.WARNING, filter=str(client.address),
              reason=exc.reason, error=exc.detail or None, action=action)
        if client in self._clients:
            self._clients.remove(client)
        reply = failure_reply(action)
        if reply is not None:
            self._session_refusal = reply
        return reply


def _params(params: Mapping[str, object]) -> list[str]:
    return [k if v is True else f"{k}={v}" for k, v in params.items() if v is not None and v is not False]
