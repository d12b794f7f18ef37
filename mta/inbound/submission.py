"""AUTH on the submission ports: deciding a complete exchange that the server core hands over (``AuthRequest``).

The exchange itself (PLAIN, LOGIN) is sans-IO in ``mta.smtp.sasl``; this is
what needs the outside world. The password check (Argon2, in
``mta.auth.users``) runs in a worker thread, at most ``auth_concurrency`` at
once, so that it never blocks the loop; failures are counted per client
address (``mta.auth.limiter``), and past ``max_auth_failures`` the address
is refused unchecked (``421``) until the window passes. A wrong password is
answered after ``auth_failure_delay``. Each decision is logged (``auth``,
``auth_failed``, ``auth_error``) and counted (``logspool_auth_total``).
docs/security.md, "SMTP AUTH".
"""

from __future__ import annotations

import logging

import attrs
import trio

from mta.auth.limiter import FailureLimiter
from mta.auth.users import UsersFile
from mta.config import Config
from mta.observe.logline import event
from mta.observe.metrics import Metrics
from mta.smtp.common import Reply
from mta.smtp.sasl import R_BAD_CREDENTIALS
from mta.smtp.server_events import AuthRequest

log = logging.getLogger("mta.smtpd")

R_AUTH_LOCKED = Reply(421, "4.7.0", "Too many failed authentication attempts; try again later")
R_AUTH_UNAVAILABLE = Reply(454, "4.7.0", "Temporary authentication failure")


@attrs.frozen
class Verdict:
    """What to answer: ``reply`` None for ``235`` (accept), else the refusal and its Rejection ``reason``;
    ``delay``: seconds to wait before answering; ``close``: the session ends after the reply."""

    reply: Reply | None = None
    reason: str = ""
    delay: float = 0.0
    close: bool = False


class Authenticator:
    """The users file, failed attempts per client address, and the worker threads that check passwords.

    Raises (with ``[submission]`` on): ``OSError``, ``UsersFileError`` for a users file that cannot be read.
    """

    def __init__(self, config: Config, metrics: Metrics) -> None:
        sub = self.settings = config.submission
        self.metrics = metrics
        self.users = UsersFile(sub.users_file) if sub.enabled and sub.users_file else None
        self.failures = FailureLimiter(sub.max_auth_failures, sub.auth_failure_window)
        self.slots = trio.CapacityLimiter(sub.auth_concurrency)
        self.users_error: str | None = None  # the users file's last problem, logged once

    def locked(self, ev: AuthRequest, client: str) -> Verdict | None:
        """``421`` for an address over the limit, decided without a check (and without a wait); else None."""
        if not self.failures.blocked(client):
            return None
        self.metrics.auth.labels("rate_limit").inc()
        event(log, "auth_failed", level=logging.WARNING, client=client, user=ev.username, mechanism=ev.mechanism,
              reason="rate_limit", failures=self.failures.failures(client))
        return Verdict(R_AUTH_LOCKED, "auth_rate_limit", close=True)

    async def check(self, ev: AuthRequest, client: str, port: str) -> Verdict:
        """The password checked in a worker thread: ``235``, ``535`` (after the delay), ``421`` at the limit, or
        ``454`` when the users file cannot be read. The caller's deadline should not run meanwhile."""
        users = self.users
        try:
            if users is None:
                raise FileNotFoundError("no users_file")
            good = await trio.to_thread.run_sync(users.verify, ev.username, ev.password, limiter=self.slots)
        except OSError as exc:
            self.metrics.auth.labels("unavailable").inc()
            event(log, "auth_error", level=logging.ERROR, client=client, user=ev.username,
                  error=exc.strerror or str(exc))
            return Verdict(R_AUTH_UNAVAILABLE, "auth_unavailable")
        if users.last_error != self.users_error:
            self.users_error = users.last_error
            if users.last_error is not None:
                event(log, "users_file_error", level=logging.ERROR, error=users.last_error)
        if good:
            self.metrics.auth.labels("success").inc()
            self.failures.succeeded(client)
            event(log, "auth", client=client, user=ev.username, mechanism=ev.mechanism, port=port)
            return Verdict()
        failures = self.failures.failed(client)
        locked = failures >= self.settings.max_auth_failures
        self.metrics.auth.labels("failure").inc()  # the one that reaches the limit too: it was checked
        event(log, "auth_failed", level=logging.WARNING, client=client, user=ev.username, mechanism=ev.mechanism,
              reason="rate_limit" if locked else "credentials", failures=failures)
        if locked:
            return Verdict(R_AUTH_LOCKED, "auth_rate_limit", self.settings.auth_failure_delay, close=True)
        return Verdict(R_BAD_CREDENTIALS, "auth_failed", self.settings.auth_failure_delay)
