"""Which login a next hop gets, and telling the operator once when a login cannot work.

The logins are ``[smarthost_auth] secrets_file``'s (``mta.config.smarthost_auth``),
read at start and again whenever the file changes (its mtime and size), so
a corrected password takes effect at the next connection, with no restart.
Only ``smtp://`` routes get one, looked up by the route's host and port.

A login that fails (the route does not require TLS, the server offers no
usable mechanism, ``535``) is a fault of the route's config, not of the
mail: the messages are deferred (``4.7.0``, ``4.7.8``), never bounced, and
the fault is logged once at ERROR (``event=smarthost_login_failed``), again
only if it changes; ``event=smarthost_login relay=... user=...`` says when a
login works again. A file that became unreadable or bad keeps the logins
last read, with one ERROR line.
"""

from __future__ import annotations

import logging
import os

from mta.config import ConfigError
from mta.config.smarthost_auth import Login, read_logins
from mta.delivery import mx
from mta.delivery.transport import Destination
from mta.observe.logline import event

log = logging.getLogger("mta.smtp")

Key = tuple[str, int]


class LoginFailed(Exception):
    """Logging in at a hop cannot work now; ``reply`` is the server's, if it said something."""

    def __init__(self, message: str, reply: object = None, enhanced: str = "4.7.0") -> None:
        super().__init__(message)
        self.reply = reply
        self.enhanced = enhanced


class Logins:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._logins: dict[Key, Login] = {}
        self._reported: dict[Key, str] = {}  # what was last logged per hop, so a fault is logged once

    def for_hop(self, destination: Destination, hop: mx.Hop) -> Login | None:
        if self.path is None or destination.kind != "smtp":
            return None
        self._refresh()
        return self._logins.get((hop.host.lower(), hop.port))

    def _refresh(self) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._once(("", 0), f"cannot read {self.path}: {exc.strerror or exc}; the logins last read stay")
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            self._logins = read_logins(self.path)
        except ConfigError as exc:
            self._once(("", 0), f"{exc}; the logins last read stay")
            return
        self._stamp = stamp
        self._reported.pop(("", 0), None)

    def failed(self, key: Key, relay: str, user: str, detail: str) -> None:
        """A login at ``relay`` failed: one ERROR line, unless this same fault was the last one logged."""
        self._once(key, detail, relay=relay, user=user)

    def succeeded(self, key: Key, relay: str, user: str) -> None:
        if self._reported.pop(key, None) is not None:
            event(log, "smarthost_login", None, relay=relay, user=user, detail="logged in again")

    def _once(self, key: Key, detail: str, **fields: str) -> None:
        if self._reported.get(key) == detail:
            return
        self._reported[key] = detail
        event(log, "smarthost_login_failed", None, {**fields, "file": self.path, "detail": detail},
              level=logging.ERROR)
