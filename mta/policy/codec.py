"""The policy delegation protocol without I/O: requests out, replies in, actions read.

Theory of operation
-------------------
Postfix's SMTPD_POLICY_README: a request is ``name=value`` lines, each
ended by LF, and an empty line ends it; the reply is the same, and the one
attribute that matters in it is ``action=``. Replies arrive on a connection
that is kept for the next request, so the parser is fed whatever bytes came
and hands out whole replies (``ReplyParser``), as ``mta.smtp``'s cores do.

The action is read once, here (``parse_action``), into one of a few frozen
records: what the relay does with each is ``mta.policy.gate``'s. An action
this relay does not carry out (a REDIRECT or BCC without one address ...)
is ``Unsupported``, never an error: the gate logs it and applies its
failure default (as it does for a FILTER whose next hop it cannot name:
``mta.policy.filter_route``). A reply that breaks the protocol (an over-long line, no ``action``,
no ``=``) is ``PolicyProtocolError``, and the connection it came on is not
used again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from mta.smtp.common import Reply

__all__ = [
    "MAX_LINE",
    "MAX_REPLY",
    "Action",
    "Bcc",
    "DeferIfPermit",
    "DeferIfReject",
    "Discard",
    "Dunno",
    "Filter",
    "Hold",
    "Permit",
    "PolicyProtocolError",
    "Prepend",
    "Redirect",
    "Refuse",
    "ReplyParser",
    "Unsupported",
    "Warn",
    "encode_request",
    "parse_action",
]

MAX_LINE = 4096  # Postfix's own attribute limit is far below this; longer is a broken server
MAX_REPLY = 64 * 1024
_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_CODE = re.compile(r"([45])([0-9]{2})(?:\s+(.*))?", re.DOTALL)
_ENHANCED = re.compile(r"([245])\.([0-9]{1,3})\.([0-9]{1,3})(?:\s+(.*))?", re.DOTALL)
_HEADER = re.compile(r"[!-9;-~]+:[^\r\n]*")
# What of a server's text reaches the client: printable ASCII on one line (the client may not speak SMTPUTF8).
_UNSAFE = re.compile(r"[^\x20-\x7e]")
MAX_HEADER = 998  # a header line's limit (RFC 5322 §2.1.1), CRLF apart
MAX_TEXT = 400  # an SMTP reply line is at most 512 bytes (RFC 5321 §4.5.3.1.5) with the codes
DEFAULT_REJECT = "Access denied"
DEFAULT_DEFER = "Try again later"


class PolicyProtocolError(ValueError):
    """A policy server's reply that breaks the protocol; the connection is dropped."""


@attrs.frozen
class Dunno:
    """No opinion: ask the next server."""


@attrs.frozen
class Permit:
    """``OK``: accepted; no later policy server is asked for this command."""


@attrs.frozen
class Refuse:
    """``REJECT`` (``554 5.7.1``), ``DEFER`` (``450 4.7.1``), ``4NN text``, ``5NN text``: this reply is sent."""

    reply: Reply


@attrs.frozen
class DeferIfPermit:
    """``DEFER_IF_PERMIT``: a deferral unless a later server rejects (greylisting's action)."""

    reply: Reply


@attrs.frozen
class DeferIfReject:
    """``DEFER_IF_REJECT``: a later rejection becomes this deferral."""

    reply: Reply


@attrs.frozen
class Prepend:
    """``PREPEND header: value``: the header field goes on top of the message."""

    header: str


@attrs.frozen
class Warn:
    """``WARN text``: logged; no other effect."""

    text: str


@attrs.frozen
class Redirect:
    """``REDIRECT user@domain``: the message goes to this one address instead of its recipients."""

    address: str


@attrs.frozen
class Bcc:
    """``BCC user@domain``: one more recipient, the message otherwise unchanged."""

    address: str


@attrs.frozen
class Hold:
    """``HOLD text``: the message is stored held (as a filter's quarantine), for the operator to release."""

    text: str


@attrs.frozen
class Discard:
    """``DISCARD text``: the client is told the message was taken; it is logged and not stored."""

    text: str


@attrs.frozen
class Filter:
    """``FILTER transport:destination``: the whole message goes to this next hop (a content filter that
    passes it on), whatever the routes say; ``route`` as the server wrote it (``mta.policy.filter_route``)."""

    route: str


@attrs.frozen
class Unsupported:
    """An action this relay does not carry out, as the server wrote it."""

    action: str


Action = (Dunno | Permit | Refuse | DeferIfPermit | DeferIfReject | Prepend | Warn | Redirect | Bcc | Hold | Discard
          | Filter | Unsupported)
# One address for REDIRECT and BCC: a local part, an @, a domain; nothing that could be more than one.
_ADDRESS = re.compile(r"[^\s@<>,;:\\\"]+@[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")


def _clean(value: str) -> str:
    """A value as one line: the protocol has no escape for LF, and a NUL or CR has no place in it either."""
    return value.replace("\n", " ").replace("\r", " ").replace("\0", " ")


def encode_request(attributes: Mapping[str, str]) -> bytes:
    """One request: ``name=value`` lines and the empty line that ends them.

    A value's line breaks become spaces (a client's HELO name or sender
    cannot inject an attribute or end the request early).

    Raises ValueError for a name that is not an attribute name (a bug of the caller).
    """
    lines = []
    for name, value in attributes.items():
        if not _NAME.fullmatch(name):
            raise ValueError(f"not an attribute name: {name!r}")
        lines.append(f"{name}={_clean(value)}\n")
    return ("".join(lines) + "\n").encode("utf-8", "surrogateescape")


class ReplyParser:
    """Bytes from a policy server in, whole replies (attribute dicts) out."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._attrs: dict[str, str] = {}
        self._size = 0

    def feed(self, data: bytes | bytearray) -> None:
        self._buf += data
        self._size += len(data)

    def next_reply(self) -> dict[str, str] | None:
        """The next whole reply, or None until more bytes come.

        Raises PolicyProtocolError: a line over ``MAX_LINE``, a reply over ``MAX_REPLY``, a line without ``=``.
        """
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > MAX_LINE:
                    raise PolicyProtocolError(f"a reply line longer than {MAX_LINE} bytes")
                if self._size > MAX_REPLY:
                    raise PolicyProtocolError(f"a reply longer than {MAX_REPLY} bytes")
                return None
            line = bytes(self._buf[:end]).rstrip(b"\r").decode("utf-8", "replace")
            del self._buf[:end + 1]
            if end > MAX_LINE:
                raise PolicyProtocolError(f"a reply line longer than {MAX_LINE} bytes")
            if not line:
                reply, self._attrs = self._attrs, {}
                self._size = len(self._buf)
                return reply
            name, eq, value = line.partition("=")
            if not eq:
                raise PolicyProtocolError(f"a reply line without '=': {line[:80]!r}")
            self._attrs[name.strip().lower()] = value

    @property
    def pending(self) -> bool:
        """Bytes of a reply not yet whole (a server that answered before being asked is broken)."""
        return bool(self._buf) or bool(self._attrs)


def _reply(code: int, default_status: str, text: str, fallback: str) -> Reply:
    """``code`` with an enhanced status code: the text's own if it opens with one of the same class, else the
    default; the text, else ``fallback``."""
    status = default_status
    if (m := _ENHANCED.fullmatch(text)) and m.group(1) == str(code)[0]:
        status = f"{m.group(1)}.{m.group(2)}.{m.group(3)}"
        text = m.group(4) or ""
    text = _UNSAFE.sub(" ", text).strip()[:MAX_TEXT].strip()
    return Reply(code, status, text or fallback)


def parse_action(reply: Mapping[str, str]) -> Action:
    """The action of one reply (SMTPD_POLICY_README, access(5) "ACCEPT/REJECT ACTIONS").

    Raises PolicyProtocolError when there is no ``action`` attribute.
    """
    if "action" not in reply:
        raise PolicyProtocolError("a reply without an action")
    text = reply["action"].strip()
    word, _, rest = text.partition(" ")
    rest = rest.strip()
    upper = word.upper()
    if m := _CODE.fullmatch(text):
        code = int(m.group(1) + m.group(2))
        return Refuse(_reply(code, f"{m.group(1)}.7.1", m.group(3) or "",
                             DEFAULT_DEFER if code < 500 else DEFAULT_REJECT))
    if upper in ("OK", "PERMIT") or (upper.isdigit() and not rest):
        return Permit()  # access(5): a bare number is OK, as from a map of client counts
    if upper == "DUNNO" or not text:
        return Dunno()
    if upper == "REJECT":
        return Refuse(_reply(554, "5.7.1", rest, DEFAULT_REJECT))
    if upper in ("DEFER", "DEFER_IF_PERMIT", "DEFER_IF_REJECT"):
        deferral = _reply(450, "4.7.1", rest, DEFAULT_DEFER)
        if upper == "DEFER_IF_PERMIT":
            return DeferIfPermit(deferral)
        return DeferIfReject(deferral) if upper == "DEFER_IF_REJECT" else Refuse(deferral)
    if upper == "PREPEND":
        if not _HEADER.fullmatch(rest) or len(rest.encode("utf-8", "surrogateescape")) > MAX_HEADER:
            return Unsupported(text[:200])
        return Prepend(rest)
    if upper == "WARN":
        return Warn(rest)
    if upper in ("REDIRECT", "BCC") and _ADDRESS.fullmatch(rest) and len(rest) <= 254:
        return Redirect(rest) if upper == "REDIRECT" else Bcc(rest)
    if upper == "FILTER" and rest:
        return Filter(rest[:400])
    if upper in ("HOLD", "DISCARD"):
        note = _UNSAFE.sub(" ", rest).strip()[:MAX_TEXT]
        return Hold(note) if upper == "HOLD" else Discard(note)
    return Unsupported(text[:200])
