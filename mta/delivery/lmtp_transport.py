"""The LMTP transport (RFC 2033): the SMTP transport's session over the client core's LMTP mode.

Why its own transport and not a mode of ``SmtpTransport``: an LMTP next hop
is one fixed mailbox server (a TCP address or a unix socket), never found
by MX and never behind a TLS policy, so the SMTP transport's hop plans, MX
lookups and STARTTLS have nothing to do here. What is the same is reused:
the session (``smtp_transport._Session``: its reads, deadlines, body writes,
point of no return and liveness checks), the failure names (``classify``)
and the connection cache.

The difference that matters is in the core (``ClientConnection(lmtp=True)``):
after the final dot the server answers once per accepted recipient, so the
one ``MessageReply`` carries each recipient's own reply and each becomes
that recipient's outcome (delivered, deferred or bounced) in one
transaction. A mailbox over quota (Dovecot's ``452 4.2.2`` with
``quota_full_tempfail``) is deferred while its neighbours are delivered.

A connection lost after the final dot, between the replies, keeps the
replies that came (``ClientConnection.answered``): those recipients get
their outcomes, and only the ones not answered are deferred (they were past
their point of no return: the server may have delivered them, as with
SMTP's lost final reply).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import trio

from mta.config import Config
from mta.delivery.connection_cache import CacheKey, ConnectionCache
from mta.delivery.smtp_transport import (
    _NETWORK_ERRORS,
    HopFailed,
    StaleConnection,
    _Session,
    classify,
    outcome_for,
)
from mta.delivery.tlspolicy.plan import HopTls
from mta.delivery.transport import BeforeDot, Destination, Job, OnOutcome
from mta.observe.logline import event
from mta.smtp.client import ClientConnection, EhloReply, Greeting
from spool import Outcome, Status

log = logging.getLogger("mta.lmtp")


class LmtpSession(_Session):
    """One connection to a mailbox server: greeting and LHLO, then the SMTP session's transactions."""

    def __init__(self, stream: trio.abc.Stream, host: str, config: Config) -> None:
        super().__init__(stream, host, config)
        self.conn = ClientConnection(lmtp=True)

    async def open(self, hop_tls: HopTls | None = None) -> None:
        """Greeting and LHLO; no STARTTLS (module docstring). Raises HopFailed or a network error."""
        t = self.config.delivery.command_timeout
        ev = await self._event(t)
        if not isinstance(ev, Greeting) or not ev.reply.is_positive:
            raise HopFailed("refused in the greeting", getattr(ev, "reply", None), "rejected")
        self.stage = "sending LHLO"
        self.conn.ehlo(self.config.server.hostname)
        ev = await self._event(t)
        if not isinstance(ev, EhloReply) or not ev.reply.is_positive:
            raise HopFailed("refused LHLO", getattr(ev, "reply", None), "rejected")


def hop_label(target: str) -> str:
    """How the next hop is named in replies and logs: ``lmtp:[127.0.0.1]:24`` or ``lmtp:/run/dovecot/lmtp``."""
    if target.startswith("/"):
        return f"lmtp:{target}"
    host, _, port = target.rpartition(":")
    return f"lmtp:[{host.strip('[]')}]:{port}"


class LmtpTransport:
    PASSES_DOT = True  # before_dot before each end of data (_Session._send_body)

    def __init__(self, config: Config) -> None:
        self.config = config
        d = config.delivery
        self.cache: ConnectionCache[LmtpSession] = ConnectionCache(d.connection_cache_time, d.per_destination)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The connection cache's keeper: without it every batch opens and closes its own connection."""
        await self.cache.run(task_status=task_status)

    async def _open(self, target: str) -> LmtpSession:
        """A new connection to ``target``, greeted. Raises HopFailed, naming what failed where."""
        label = hop_label(target)
        timeout = self.config.delivery.connect_timeout
        stream: trio.abc.Stream
        try:
            with trio.fail_after(timeout):
                if target.startswith("/"):
                    stream = await trio.open_unix_socket(target)
                else:
                    host, _, port = target.rpartition(":")
                    stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
        except trio.TooSlowError:
            raise HopFailed(f"connect to {label}: timed out after {timeout:g} s", cause="timeout") from None
        except OSError as exc:
            failure = classify(exc, label, "connecting")
            raise HopFailed(failure.detail, cause=failure.cause) from None
        session = LmtpSession(stream, target, self.config)
        try:
            await session.open()
        except (HopFailed, *_NETWORK_ERRORS) as exc:
            await session.close()
            failure = classify(exc, label, session.stage)
            raise HopFailed(failure.detail, cause=failure.cause) from None
        except BaseException:
            await session.close()
            raise
        return session

    async def _connect(self, key: CacheKey, target: str) -> LmtpSession:
        """A live connection: a cached one that is still alive (as the SMTP transport checks it), else a new one."""
        cache = self.cache
        while (cached := cache.take(key)) is not None:
            if cached.peer_spoke():
                pass  # its goodbye, said while it was idle
            elif cached.idled < cache.probe_after:
                cached.unproven = True
                cache.reused += 1
                return cached
            elif await cached.alive():
                cache.reused += 1
                cache.probed += 1
                return cached
            await cached.close()
        return await self._open(target)

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        results: list[list[Outcome] | None] = [None] * len(jobs)
        target = destination.target
        label = hop_label(target)
        key: CacheKey = (destination, target, 0)
        session: LmtpSession | None = None
        current: int | None = None  # the job whose transaction is open
        try:
            while (todo := [i for i, r in enumerate(results) if r is None]):
                session = await self._connect(key, target)
                try:
                    for i in todo:
                        current = i
                        dot = None if before_dot is None else functools.partial(before_dot, i, jobs[i].recipients)
                        outcomes = results[i] = await session.send(jobs[i], label, dot)
                        session.sent += 1
                        if on_outcome is not None:
                            on_outcome(i, outcomes)
                except StaleConnection as exc:  # nothing was sent on it: the rest go over a new one (bounded)
                    self.cache.stale += 1
                    event(log, "connection_stale", None, qids=[jobs[i].queue_id for i in todo], relay=label,
                          detail=str(exc), action="retried on another connection")
                    await session.close()
                    session = None
            if session is not None and session.conn.idle \
                    and session.sent < self.config.delivery.max_messages_per_connection \
                    and self.cache.put(key, session):
                session = None  # the cache has it now
        except (HopFailed, *_NETWORK_ERRORS) as exc:
            failure = classify(exc, label, session.stage if session is not None else "connecting")
            event(log, "connect_failed", None, qids=[jobs[i].queue_id for i, r in enumerate(results) if r is None],
                  relay=label, cause=failure.cause, detail=failure.detail)
            if session is not None and current is not None and results[current] is None:
                answered = {o.address: o.reply for o in session.conn.answered}
                if answered:  # lost between LMTP's replies: the answered recipients keep their outcomes
                    outcomes = results[current] = [
                        outcome_for(rcpt, answered[rcpt], label) if rcpt in answered else
                        Outcome(rcpt, Status.DEFERRED, 0, "4.4.1", failure.detail, label)
                        for rcpt in jobs[current].recipients]
                    if on_outcome is not None:
                        on_outcome(current, outcomes)
            return [r if r is not None else
                    [Outcome(rcpt, Status.DEFERRED, 0, "4.4.1", failure.detail, label) for rcpt in job.recipients]
                    for r, job in zip(results, jobs, strict=True)]
        finally:
            if session is not None:
                await session.close()
        return [r for r in results if r is not None]

