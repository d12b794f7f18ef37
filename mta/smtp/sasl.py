"""SASL PLAIN and LOGIN for the SMTP server core (RFC 4954, RFC 4616): response lines in, credentials out.

Theory of operation
-------------------
``AUTH mechanism [initial-response]`` starts an exchange (``start``). The
exchange then takes the client's response lines one at a time
(``SaslExchange.respond``) and each answer is one ``Outcome``:

- ``Challenge``: send this ``334`` and read one more line (PLAIN without an
  initial response asks for it; LOGIN asks for the user name, then the
  password);
- ``Credentials``: the exchange is complete; whether they are good is the
  shell's decision (the users file, the rate limit), not this module's;
- ``Failed``: end the exchange with this reply. ``*`` from the client is a
  cancel (``501 5.0.0``); a line that is not base64 is ``501 5.5.2``; a
  decoded message that cannot be credentials (PLAIN without its two NULs,
  not UTF-8, a control character in the user name, a user name or password
  past the limits, a proxy authorisation identity) is ``535 5.7.8``, the
  same answer as a wrong password, so that nothing tells a prober which.

Nothing here does I/O, keeps state beyond one exchange, or shows what a
client sent: a failure names no byte of the response (it may hold a
password). The line length limit (``MAX_SASL_LINE``) is the core's to
enforce, as it reads lines; this module also refuses a longer line it is
handed.
"""

from __future__ import annotations

import base64
import binascii
from typing import Final

import attrs

from mta.smtp.common import Reply, has_control

__all__ = [
    "MAX_PASSWORD",
    "MAX_SASL_LINE",
    "MAX_USERNAME",
    "MECHANISMS",
    "Challenge",
    "Credentials",
    "Failed",
    "Outcome",
    "SaslExchange",
    "start",
]

MECHANISMS: Final = ("PLAIN", "LOGIN")
# RFC 4954 §4: a server must accept response lines of at least 12288 octets, CRLF excluded.
MAX_SASL_LINE: Final = 12288
MAX_USERNAME: Final = 255  # characters; a users-file name is never longer (mta.auth.users)
MAX_PASSWORD: Final = 1024  # bytes of UTF-8

R_AUTH_OK: Final = Reply(235, "2.7.0", "Authentication successful")
R_CANCELLED: Final = Reply(501, "5.0.0", "Authentication cancelled")
R_NOT_BASE64: Final = Reply(501, "5.5.2", "Cannot decode response: not base64")
R_LINE_TOO_LONG: Final = Reply(500, "5.5.6", "Authentication exchange line is too long")
R_BAD_CREDENTIALS: Final = Reply(535, "5.7.8", "Authentication credentials invalid")
R_UNKNOWN_MECHANISM: Final = Reply(504, "5.5.4", "Unrecognized authentication type; use PLAIN or LOGIN")
R_SYNTAX: Final = Reply(501, "5.5.4", "Syntax: AUTH mechanism [initial-response]")
# LOGIN's prompts, base64 of "Username:" and "Password:" as every client expects them.
_ASK_USER: Final = Reply(334, None, base64.b64encode(b"Username:").decode("ascii"))
_ASK_PASSWORD: Final = Reply(334, None, base64.b64encode(b"Password:").decode("ascii"))
_ASK_PLAIN: Final = Reply(334, None, "")  # PLAIN with no initial response: an empty challenge


@attrs.frozen
class Credentials:
    """A complete exchange: who claims to be whom. The password never appears in a repr."""

    mechanism: str
    username: str
    password: str = attrs.field(repr=False)


@attrs.frozen
class Challenge:
    """Send ``reply`` (a ``334``) and hand the next line to ``respond``."""

    reply: Reply


@attrs.frozen
class Failed:
    """End the exchange with ``reply``; ``reason`` is a fixed word for the log and the metric."""

    reply: Reply
    reason: str


Outcome = Credentials | Challenge | Failed

_CANCEL: Final = Failed(R_CANCELLED, "auth_cancelled")
_NOT_BASE64: Final = Failed(R_NOT_BASE64, "auth_not_base64")
_BAD: Final = Failed(R_BAD_CREDENTIALS, "auth_malformed")


def _decode(text: bytes) -> bytes | Failed:
    """One response line (CRLF removed): its bytes, or why not. ``*`` is the client's cancel."""
    if text == b"*":
        return _CANCEL
    if len(text) > MAX_SASL_LINE:
        return Failed(R_LINE_TOO_LONG, "auth_line_too_long")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return _NOT_BASE64


def _text(raw: bytes, limit: int) -> str | None:
    """UTF-8 without control characters, at most ``limit`` characters; None if not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text or len(text) > limit or has_control(text):
        return None
    return text


def _password(raw: bytes) -> str | None:
    """A password: UTF-8, 1 to MAX_PASSWORD bytes; control characters are the client's business (no NUL in PLAIN)."""
    if not raw or len(raw) > MAX_PASSWORD:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _plain(message: bytes) -> Credentials | Failed:
    """RFC 4616: ``[authzid] NUL authcid NUL passwd``. An authzid other than the authcid is not ours to grant."""
    parts = message.split(b"\x00")
    if len(parts) != 3:
        return _BAD
    authzid, authcid, passwd = parts
    username = _text(authcid, MAX_USERNAME)
    password = _password(passwd)
    if username is None or password is None or (authzid and authzid != authcid):
        return _BAD
    return Credentials("PLAIN", username, password)


class SaslExchange:
    """One AUTH exchange, from its first line to its outcome. ``done`` once it gave Credentials or Failed."""

    def __init__(self, mechanism: str) -> None:
        self.mechanism = mechanism
        self.username: str | None = None  # LOGIN, between its two prompts
        self.done = False

    def respond(self, line: bytes) -> Outcome:
        """The client's next response line, CRLF removed.

        Raises ``ValueError`` if the exchange is already over (a bug in the caller).
        """
        if self.done:
            raise ValueError("the exchange is over")
        decoded = _decode(line)
        outcome = decoded if isinstance(decoded, Failed) else self._step(decoded)
        self.done = not isinstance(outcome, Challenge)
        return outcome

    def _step(self, message: bytes) -> Outcome:
        if self.mechanism == "PLAIN":
            return _plain(message)
        if self.username is None:
            username = _text(message, MAX_USERNAME)
            if username is None:
                return _BAD
            self.username = username
            return Challenge(_ASK_PASSWORD)
        password = _password(message)
        return _BAD if password is None else Credentials("LOGIN", self.username, password)


def start(argument: str) -> tuple[SaslExchange | None, Outcome]:
    """The argument of ``AUTH`` (``PLAIN dGVzdA==``): the exchange it opens (None once over) and its first outcome.

    An initial response of ``=`` is an empty one (RFC 4954 §4).
    """
    words = argument.split(" ")
    if not words[0] or len(words) > 2 or (len(words) == 2 and not words[1]):
        return None, Failed(R_SYNTAX, "syntax")
    mechanism = words[0].upper()
    if mechanism not in MECHANISMS:
        return None, Failed(R_UNKNOWN_MECHANISM, "auth_mechanism")
    exchange = SaslExchange(mechanism)
    if len(words) == 1:
        return exchange, Challenge(_ASK_PLAIN if mechanism == "PLAIN" else _ASK_USER)
    outcome = exchange.respond(b"" if words[1] == "=" else words[1].encode("ascii", "replace"))
    return (None if exchange.done else exchange), outcome
