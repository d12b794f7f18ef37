"""The client's side of SMTP AUTH (RFC 4954) with PLAIN (RFC 4616) or LOGIN: lines out, replies in, no I/O.

``ClientLogin`` is one exchange: ``start()`` is the ``AUTH`` line (PLAIN with
its initial response, so one round trip), and each reply goes to
``answer``: a ``334`` gets the next line to send (PLAIN's response if the
server asked for it empty; LOGIN's user name, then its password), a ``235``
ends it (``None``), anything else raises ``LoginRefused`` with the reply.
Which mechanism: the one the secrets file names, else PLAIN if the server
offers it, else LOGIN (``choose``). Nothing here shows a line it made: they
hold the password.
"""

from __future__ import annotations

import base64

from mta.smtp.common import Reply

__all__ = ["ClientLogin", "LoginRefused", "NoMechanism", "choose"]

PREFERRED = ("PLAIN", "LOGIN")


class LoginRefused(Exception):
    """The server ended the exchange without ``235``; ``reply`` is what it said."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


class NoMechanism(Exception):
    """The server offers none of the mechanisms the client may use (``offered`` says what it offers)."""

    def __init__(self, offered: str, wanted: tuple[str, ...]) -> None:
        super().__init__(f"offers AUTH {offered or '(nothing)'}, and the relay logs in with {' or '.join(wanted)}")
        self.offered = offered


def choose(offered: str, forced: str = "") -> str:
    """The mechanism to use of the EHLO ``AUTH`` line's ``offered`` (space-separated). Raises NoMechanism."""
    names = {word.upper() for word in offered.split()}
    wanted = (forced,) if forced else PREFERRED
    for mechanism in wanted:
        if mechanism in names:
            return mechanism
    raise NoMechanism(offered, wanted)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


class ClientLogin:
    def __init__(self, mechanism: str, user: str, password: str) -> None:
        if mechanism not in PREFERRED:
            raise ValueError(f"mechanism {mechanism!r} is neither PLAIN nor LOGIN")
        self.mechanism = mechanism
        self._user = user
        self._password = password
        self._step = 0

    def __repr__(self) -> str:
        return f"ClientLogin({self.mechanism}, user={self._user!r})"

    def start(self) -> str:
        if self.mechanism == "PLAIN":
            return f"AUTH PLAIN {self._plain()}"
        return "AUTH LOGIN"

    def _plain(self) -> str:
        return _b64(f"\0{self._user}\0{self._password}")

    def answer(self, reply: Reply) -> str | None:
        """The next line to send, or None: logged in. Raises LoginRefused."""
        if reply.code == 235:
            return None
        if reply.code != 334 or self._step >= 2:
            raise LoginRefused(reply)
        self._step += 1
        if self.mechanism == "PLAIN":
            self._step = 2  # one response only: a second 334 is refused above
            return self._plain()
        return _b64(self._user) if self._step == 1 else _b64(self._password)
