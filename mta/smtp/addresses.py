"""Addresses and ESMTP parameters as RFC 5321 writes them: MAIL's and RCPT's paths, mailboxes, ``KEY=VALUE``.

Syntax only, shared by the server core (what a client sent), the client core
(what we send) and the config (the postmaster address). RFC 6531 allows
UTF-8 in a mailbox; whether a session may use it is the server's to decide
(``mta.smtp.server_arguments``). Source routes are accepted and dropped
(RFC 5321 §4.1.1.3). A path that breaks the syntax raises
``RemoteProtocolError`` carrying the ``501`` to send, with the enhanced code
of the path (``5.1.7`` sender, ``5.1.3`` recipient); the reply shows no
client byte raw.
"""

from __future__ import annotations

import re
from typing import Final

from mta.smtp.common import MAX_DOMAIN, MAX_LOCAL_PART, MAX_PATH, RemoteProtocolError, Reply, has_control, printable

_ATEXT: Final = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-\u0080-\U0010ffff]"
_DOT_STRING_RE: Final = re.compile(rf"^{_ATEXT}+(?:\.{_ATEXT}+)*$")
_QUOTED_RE: Final = re.compile(r'^"(?:[\x20\x21\x23-\x5b\x5d-\x7e\u0080-\U0010ffff]|\\[\x20-\x7e])*"$')
_LABEL: Final = r"[A-Za-z0-9\u0080-\U0010ffff](?:[A-Za-z0-9\-\u0080-\U0010ffff]*[A-Za-z0-9\u0080-\U0010ffff])?"
_DOMAIN_RE: Final = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_LITERAL_RE: Final = re.compile(r"^\[[\x21-\x5a\x5e-\x7e]+\]$")
_PARAM_KEY_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9\-]*$")
_PARAM_VALUE_RE: Final = re.compile(r"^[\x21-\x3c\x3e-\x7e\u0080-\U0010ffff]+$")
_SOURCE_ROUTE_RE: Final = re.compile(r"^@[^:,]+(?:,@[^:,]+)*:")

Params = dict[str, str | None]


def _split_path(arg: str, what: str, status: str) -> tuple[str, str]:
    """Split ``<path> params`` honouring quoted strings; return (inside, rest)."""
    arg = arg.lstrip(" ")
    if not arg.startswith("<"):
        raise RemoteProtocolError(f"{what} must be in angle brackets", Reply(501, status, f"Syntax: {what} <address>"))
    if '"' not in arg:  # no quoted string: the first ">" ends the path (the loop below, without a pass per character)
        i = arg.find(">", 1)
        if i > 0:
            return arg[1:i], arg[i + 1 :]
        raise RemoteProtocolError("unterminated path", Reply(501, status, f"Syntax: {what} <address>"))
    quoted = escaped = False
    for i in range(1, len(arg)):
        c = arg[i]
        if escaped:
            escaped = False
        elif c == "\\" and quoted:
            escaped = True
        elif c == '"':
            quoted = not quoted
        elif c == ">" and not quoted:
            return arg[1:i], arg[i + 1 :]
    raise RemoteProtocolError("unterminated path", Reply(501, status, f"Syntax: {what} <address>"))


def parse_mailbox(box: str) -> bool:
    """True if ``box`` is an RFC 5321 Mailbox (RFC 6531 allows UTF-8 in it)."""
    at = box.rfind("@")
    if at <= 0:
        return False
    local, domain = box[:at], box[at + 1 :]
    if len(local.encode()) > MAX_LOCAL_PART or len(domain.encode()) > MAX_DOMAIN:
        return False
    if not (_DOT_STRING_RE.match(local) or _QUOTED_RE.match(local)):
        return False
    return bool(_DOMAIN_RE.match(domain) or _LITERAL_RE.match(domain))


def _parse_path(arg: str, what: str, status: str, allow_null: bool) -> tuple[str, str]:
    inside, rest = _split_path(arg, what, status)
    if has_control(inside):
        raise RemoteProtocolError("control character in path", Reply(501, status, "Control character in address"))
    if rest and not rest.startswith(" "):
        raise RemoteProtocolError("junk after path", Reply(501, status, f"Syntax: {what} <address>"))
    if len(inside.encode()) + 2 > MAX_PATH:
        raise RemoteProtocolError("path too long", Reply(501, status, "Address too long"))
    if inside == "" and allow_null:
        return "", rest
    m = _SOURCE_ROUTE_RE.match(inside)
    if m is not None:  # RFC 5321 §4.1.1.3: source routes are accepted and ignored.
        inside = inside[m.end() :]
    if not allow_null and inside.lower() == "postmaster":
        return inside, rest
    if not parse_mailbox(inside):
        raise RemoteProtocolError("bad mailbox", Reply(501, status, f"Bad address syntax: <{printable(inside)}>"))
    return inside, rest


def parse_params(text: str) -> Params:
    """``KEY=VALUE KEY ...`` → dict with upper-case keys (RFC 5321 §4.1.2 esmtp-param)."""
    params: Params = {}
    for word in text.split(" "):
        if not word:
            continue
        if has_control(word):
            raise RemoteProtocolError("control character", Reply(501, "5.5.4", "Control character in parameter"))
        key, eq, value = word.partition("=")
        if not _PARAM_KEY_RE.match(key) or (eq and not _PARAM_VALUE_RE.match(value)):
            raise RemoteProtocolError("bad parameter",
                                      Reply(501, "5.5.4", f"Bad parameter syntax: {printable(word, 40)}"))
        key = key.upper()
        if key in params:
            raise RemoteProtocolError("duplicate parameter",
                                      Reply(501, "5.5.4", f"Duplicate parameter {printable(key, 40)}"))
        params[key] = value if eq else None
    return params


def parse_mail_from(arg: str) -> tuple[str, Params]:
    """Argument of MAIL after the verb (``FROM:<a@b> SIZE=1``) → (address, params).

    The null reverse path ``<>`` is returned as ``""``.
    """
    if arg[:5].upper() != "FROM:":
        raise RemoteProtocolError("MAIL without FROM:", Reply(501, "5.5.4", "Syntax: MAIL FROM:<address>"))
    address, rest = _parse_path(arg[5:], "MAIL FROM:", "5.1.7", allow_null=True)
    return address, parse_params(rest)


def parse_rcpt_to(arg: str) -> tuple[str, Params]:
    """Argument of RCPT after the verb (``TO:<a@b>``) → (address, params)."""
    if arg[:3].upper() != "TO:":
        raise RemoteProtocolError("RCPT without TO:", Reply(501, "5.5.4", "Syntax: RCPT TO:<address>"))
    address, rest = _parse_path(arg[3:], "RCPT TO:", "5.1.3", allow_null=False)
    return address, parse_params(rest)


def format_params(params: Params | None) -> str:
    if not params:
        return ""
    return "".join(f" {k}" if v is None else f" {k}={v}" for k, v in params.items())
