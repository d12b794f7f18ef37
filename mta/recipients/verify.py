"""Recipient verification at RCPT: ask the next hop whether it takes the address, as Postfix's
``reject_unverified_recipient`` does, and remember the answer.

Why: a relay for a domain whose mailboxes live on another server otherwise
accepts every local part and bounces the unknown ones later, to senders that
are often forged (backscatter). For the domains named in ``[recipients]
verify``, an RCPT the relay has no cached answer for opens a connection to
the route's next hop (the server of an ``smtp://`` or ``lmtp`` route; for an
``mx`` route the domain's mail hosts in preference order, the first that
answers RCPT deciding, as for a backup MX), says EHLO (LHLO), ``MAIL
FROM:<>``, ``RCPT TO:<address>``, then RSET and QUIT; never DATA, so nothing
is delivered.

- The next hop's 2xx: the address is taken, and cached ``verify_positive_ttl``.
- Its 5xx to RCPT: refused ``550 5.1.1 ... undeliverable address: <its
  reply>``, cached ``verify_negative_ttl``.
- Anything else (a 4xx, a refused MAIL, no connection, no answer within
  ``verify_timeout``): ``450 4.1.1``, not cached, so the client's retry asks
  again.

A failed MX lookup is a temporary failure of the probe (the delivery would
say more). The answers are kept in ``[recipients] verify_cache``
(``mta.recipients.verify_cache``), which every relay process reads and
appends to, so an address one process probed is not probed again by
another, nor after a restart, until its answer expires. At most
``CACHE_LIMIT`` addresses are kept; the oldest answer goes first.
"""

from __future__ import annotations

import logging
import ssl
import time

import dns.asyncresolver
import trio

from mta.config import Config, LmtpRoute, MxRoute, SmtpRoute
from mta.config.routes import match_domain
from mta.delivery import mx
from mta.observe.logline import event
from mta.recipients.table import Refused
from mta.recipients.verify_cache import Answer, VerifyCache
from mta.smtp.client import ClientConnection, CommandReply, EhloReply, Greeting, NeedData, RcptReply
from mta.smtp.client import Event as ClientEvent
from mta.smtp.common import LocalProtocolError, RemoteProtocolError, Reply

__all__ = ["CACHE_LIMIT", "ProbeFailed", "Verifier"]

log = logging.getLogger("mta.recipients")
CACHE_LIMIT = 100_000
_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError, LocalProtocolError,
           ssl.SSLError)


class ProbeFailed(Exception):
    """The probe got no answer to its RCPT (``reply``: what the next hop said instead, if anything)."""

    def __init__(self, message: str, reply: Reply | None = None) -> None:
        super().__init__(message + (f": {reply}" if reply is not None else ""))
        self.reply = reply


class Verifier:
    """Cached probes of next hops; one per SMTP server, shared by its sessions."""

    def __init__(self, cache_path: str) -> None:
        self.cache = VerifyCache(cache_path, CACHE_LIMIT)
        self.probes = 0  # how many probes were made (tests)
        self._resolvers: dict[tuple[str, int] | None, dns.asyncresolver.Resolver] = {}

    def wanted(self, config: Config, address: str) -> bool:
        """Is ``address`` of a domain ``[recipients] verify`` names, with a route that has a next hop to ask?"""
        domains = config.recipients.verify
        if not domains:
            return False
        domain = address.rpartition("@")[2]
        if match_domain(domain, dict.fromkeys(domains, True)) is None:
            return False
        return isinstance(config.route_for(domain), SmtpRoute | LmtpRoute | MxRoute)

    async def check(self, config: Config, address: str) -> Refused | None:
        """None if the next hop takes ``address`` (or it is not to be verified), else the RCPT's refusal."""
        if not self.wanted(config, address):
            return None
        key = address.casefold()
        answer = self.cache.get(key)
        if answer is None:
            r = config.recipients
            try:
                with trio.fail_after(r.verify_timeout):
                    reply = await self._probe(config, address)
            except trio.TooSlowError:
                return self._unknown(address, f"no answer within {r.verify_timeout:g} s")
            except (ProbeFailed, *_ERRORS) as exc:
                return self._unknown(address, str(exc) or type(exc).__name__)
            if not (reply.is_positive or reply.code >= 500):
                return self._unknown(address, f"the next hop said {reply}")
            ttl = r.verify_positive_ttl if reply.is_positive else r.verify_negative_ttl
            answer = Answer(reply, time.time() + ttl)
            self.cache.put(key, answer)
        if answer.reply.is_positive:
            return None
        theirs = answer.reply
        said = str(Reply(theirs.code, theirs.enhanced, " ".join(line.strip() for line in theirs.lines)))
        return Refused(Reply(550, "5.1.1", f"<{address}>: Recipient address rejected: undeliverable address: "
                                           f"{said}"[:400]), "unverified_recipient")

    def _unknown(self, address: str, why: str) -> Refused:
        event(log, "verify_failed", None, recipient=address, detail=" ".join(why.split()))
        return Refused(Reply(450, "4.1.1", f"<{address}>: Recipient address rejected: unverified address: "
                                           "the next hop could not be asked, try again later"), "unverified_tempfail")

    async def _probe(self, config: Config, address: str) -> Reply:
        """The next hop's reply to ``RCPT TO:<address>``. Raises ProbeFailed, OSError and the like."""
        domain = address.rpartition("@")[2]
        route = config.route_for(domain)
        if isinstance(route, LmtpRoute) and route.socket:
            return await self._ask(config, address, await trio.open_unix_socket(route.socket), lmtp=True)
        if isinstance(route, LmtpRoute | SmtpRoute):
            stream = await trio.open_tcp_stream(route.host, route.port)
            return await self._ask(config, address, stream, lmtp=isinstance(route, LmtpRoute))
        if not isinstance(route, MxRoute):
            raise ProbeFailed("no next hop to ask")
        try:
            hops = await mx.lookup(self._resolver(config), domain, port=config.delivery.mx_port)
        except mx.LookupError_ as exc:
            raise ProbeFailed(str(exc)) from None
        failure: BaseException | None = None
        for hop in hops:  # in MX preference order, as a delivery tries them: the first that answers RCPT decides
            try:
                stream = await trio.open_tcp_stream(hop.address, hop.port)
            except OSError as exc:
                failure = exc
                continue
            try:
                return await self._ask(config, address, stream, lmtp=False)
            except (ProbeFailed, *_ERRORS) as exc:
                failure = exc
        raise ProbeFailed(f"no mail host of {domain} answered ({failure})")

    def _resolver(self, config: Config) -> dns.asyncresolver.Resolver:
        """The resolver deliveries use (``[delivery] resolver``), one per address."""
        r = config.delivery.resolver
        key = (r.host, r.port) if r is not None else None
        if key not in self._resolvers:
            self._resolvers[key] = mx.make_resolver(r.host if r else None, r.port if r else 53)
        return self._resolvers[key]

    async def _ask(self, config: Config, address: str, stream: trio.abc.Stream, *, lmtp: bool) -> Reply:
        """EHLO (LHLO), MAIL FROM:<>, RCPT TO:<address> on ``stream``, then RSET and QUIT; closes ``stream``."""
        self.probes += 1
        conn = ClientConnection(lmtp=lmtp)
        try:
            ev = await _next(conn, stream)
            if not isinstance(ev, Greeting) or not ev.reply.is_positive:
                raise ProbeFailed("refused in the greeting", getattr(ev, "reply", None))
            conn.ehlo(config.server.hostname)
            ev = await _next(conn, stream)
            if not isinstance(ev, EhloReply) or not ev.reply.is_positive:
                if lmtp:
                    raise ProbeFailed("refused LHLO", getattr(ev, "reply", None))
                conn.helo(config.server.hostname)
                ev = await _next(conn, stream)
                if not isinstance(ev, EhloReply) or not ev.reply.is_positive:
                    raise ProbeFailed("refused HELO", getattr(ev, "reply", None))
            caps = conn.capabilities
            utf8 = not address.isascii() and caps is not None and caps.smtputf8
            conn.mail("", {"SMTPUTF8": None} if utf8 else None)
            conn.rcpt(address)
            ev = await _next(conn, stream)
            if not isinstance(ev, CommandReply) or not ev.reply.is_positive:
                raise ProbeFailed("refused MAIL FROM:<>", getattr(ev, "reply", None))
            ev = await _next(conn, stream)
            if not isinstance(ev, RcptReply):
                raise ProbeFailed("no reply to RCPT", getattr(ev, "reply", None))
            try:
                conn.rset()
                conn.quit()
                await stream.send_all(conn.data_to_send())
            except _ERRORS:
                pass  # the answer is in; a goodbye that fails changes nothing
            return ev.reply
        finally:
            await trio.aclose_forcefully(stream)


async def _next(conn: ClientConnection, stream: trio.abc.Stream) -> ClientEvent:
    """The core's next event: what it has to send goes first, then reads until it has one."""
    while True:
        ev = conn.next_event()
        if not isinstance(ev, NeedData):
            return ev
        out = conn.data_to_send()
        if out:
            await stream.send_all(out)
        conn.receive_data(await stream.receive_some(65536))
