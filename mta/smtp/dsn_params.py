"""The DSN extension's parameters (RFC 3461): what they may be, how they are kept with the message, how they go on.

A client asks for delivery status notifications with ``RET`` (``FULL`` or
``HDRS``) and ``ENVID`` on MAIL, ``NOTIFY`` (``NEVER``, or any of
``SUCCESS``, ``FAILURE``, ``DELAY``) and ``ORCPT`` (``addr-type;xtext``) on
RCPT. ENVID and ORCPT are xtext (§4): printable ASCII but ``+`` and ``=``,
anything else as ``+HH``. Each value is checked strictly here, and a bad one
is the client's mistake: ``501 5.5.4`` with what was wrong (a parameter
given twice as well). The parsed forms are plain values the envelope's extra
map can hold: the sender's in ``extra["params"]`` (``RET``, ``ENVID``
decoded), each recipient's in ``extra["dsn_rcpt"]`` (address -> ``{"notify":
"SUCCESS,DELAY", "orcpt": "rfc822;a@b"}``, decoded). ``mail_params`` and
``rcpt_params`` make the parameters again for a next hop that offers DSN.

Why the values are kept decoded: the notice the relay writes names them
(Original-Envelope-Id, Original-Recipient) as a person reads them, and the
client core encodes them again for the wire.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

import attrs

from mta.smtp.common import RemoteProtocolError, Reply

__all__ = ["ENVID_MAX", "NOTIFY_WORDS", "ORCPT_MAX", "RecipientDsn", "mail_params", "notify_of", "orcpt_of",
           "parse_envid", "parse_notify", "parse_orcpt", "parse_ret", "rcpt_params", "wants", "xtext_decode",
           "xtext_encode"]

NOTIFY_WORDS: Final = ("SUCCESS", "FAILURE", "DELAY")
ENVID_MAX: Final = 100  # RFC 3461 §4.4: at most 100 characters, as xtext
ORCPT_MAX: Final = 500  # RFC 3461 §4.2: at most 500 characters, as xtext
_ADDR_TYPE_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9\-]*$")
_HEX: Final = "0123456789ABCDEF"


def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"bad {what}", Reply(501, "5.5.4", f"Bad {what} value"))


def xtext_decode(text: str) -> str:
    """The text an xtext stands for (RFC 3461 §4). Raises ``ValueError`` for a character xtext does not allow
    (space, ``=``, controls, non-ASCII) or a ``+`` not followed by two upper-case hex digits."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "+":
            pair = text[i + 1 : i + 3]
            if len(pair) != 2 or any(h not in _HEX for h in pair):
                raise ValueError("'+' must be followed by two upper-case hex digits")
            out.append(chr(int(pair, 16)))
            i += 3
            continue
        if not ("!" <= c <= "~") or c == "=":
            raise ValueError(f"character {c!r} must be written as +HH")
        out.append(c)
        i += 1
    return "".join(out)


def xtext_encode(text: str) -> str:
    """``text`` as xtext: ``+``, ``=`` and anything outside ``!``..``~`` as ``+HH`` (ASCII text only)."""
    return "".join(c if "!" <= c <= "~" and c not in "+=" else f"+{ord(c):02X}" for c in text)


def parse_ret(value: str | None) -> str:
    """MAIL's ``RET=FULL|HDRS``, upper-cased. Raises ``RemoteProtocolError`` (501)."""
    if value is None or value.upper() not in ("FULL", "HDRS"):
        raise _bad("RET")
    return value.upper()


def parse_envid(value: str | None) -> str:
    """MAIL's ``ENVID=xtext``, decoded. Raises ``RemoteProtocolError`` (501): empty, too long, not xtext,
    or decoding to something that is not printable ASCII."""
    if not value or len(value) > ENVID_MAX:
        raise _bad("ENVID")
    try:
        decoded = xtext_decode(value)
    except ValueError:
        raise _bad("ENVID") from None
    if not all(" " <= c <= "~" for c in decoded):
        raise _bad("ENVID")
    return decoded


def parse_notify(value: str | None) -> str:
    """RCPT's ``NOTIFY=NEVER`` or a list of SUCCESS, FAILURE, DELAY: upper-cased, comma-joined in the order of
    ``NOTIFY_WORDS``. Raises ``RemoteProtocolError`` (501): empty, an unknown word, a word twice, NEVER with
    another."""
    if not value:
        raise _bad("NOTIFY")
    words = [w.upper() for w in value.split(",")]
    if words == ["NEVER"]:
        return "NEVER"
    if len(set(words)) != len(words) or not set(words) <= set(NOTIFY_WORDS):
        raise _bad("NOTIFY")
    return ",".join(w for w in NOTIFY_WORDS if w in words)


def parse_orcpt(value: str | None) -> str:
    """RCPT's ``ORCPT=addr-type;xtext``, as ``addr-type;decoded`` (the type as given, ``rfc822`` the usual).
    Raises ``RemoteProtocolError`` (501): no ``;``, a bad type, too long, not xtext, a control character."""
    if not value or len(value) > ORCPT_MAX:
        raise _bad("ORCPT")
    kind, semi, encoded = value.partition(";")
    if not semi or not _ADDR_TYPE_RE.match(kind) or not encoded:
        raise _bad("ORCPT")
    try:
        decoded = xtext_decode(encoded)
    except ValueError:
        raise _bad("ORCPT") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
        raise _bad("ORCPT")
    return f"{kind};{decoded}"


@attrs.frozen
class RecipientDsn:
    """One recipient's DSN request as the envelope keeps it: ``notify`` (None: the client said nothing, the
    relay's defaults hold) and ``orcpt`` (``addr-type;address``, decoded)."""

    notify: str | None = None
    orcpt: str | None = None

    def as_extra(self) -> dict[str, str]:
        return {k: v for k, v in (("notify", self.notify), ("orcpt", self.orcpt)) if v is not None}


def _rcpt_entry(extra: Mapping[str, object], recipient: str) -> Mapping[str, object]:
    table = extra.get("dsn_rcpt")
    entry = table.get(recipient) if isinstance(table, Mapping) else None
    return entry if isinstance(entry, Mapping) else {}


def notify_of(extra: Mapping[str, object], recipient: str) -> str | None:
    """The NOTIFY the client gave for ``recipient`` (``NEVER``, ``SUCCESS,FAILURE`` ...), None if it gave none."""
    value = _rcpt_entry(extra, recipient).get("notify")
    return value if isinstance(value, str) else None


def orcpt_of(extra: Mapping[str, object], recipient: str) -> str | None:
    """The ORCPT the client gave for ``recipient`` (``rfc822;a@b``, decoded), None if it gave none."""
    value = _rcpt_entry(extra, recipient).get("orcpt")
    return value if isinstance(value, str) else None


def wants(extra: Mapping[str, object], recipient: str, word: str, *, default: bool) -> bool:
    """Whether ``recipient`` asked for a notice of kind ``word`` (SUCCESS, FAILURE, DELAY); ``default`` when the
    client gave no NOTIFY (RFC 3461 §4.1: then the relay's own rules hold)."""
    notify = notify_of(extra, recipient)
    return default if notify is None else word in notify.split(",")


def mail_params(extra: Mapping[str, object]) -> dict[str, str | None]:
    """RET and ENVID for a next hop that offers DSN, from the envelope's ``extra["params"]``."""
    params = extra.get("params")
    out: dict[str, str | None] = {}
    if isinstance(params, Mapping):
        ret, envid = params.get("RET"), params.get("ENVID")
        if isinstance(ret, str):
            out["RET"] = ret
        if isinstance(envid, str):
            out["ENVID"] = xtext_encode(envid)
    return out


def rcpt_params(extra: Mapping[str, object], recipient: str) -> dict[str, str | None]:
    """NOTIFY and ORCPT for ``recipient`` to a next hop that offers DSN (RFC 3461 §4.2: the ORCPT as received,
    or, when the client asked for notices without one, the address itself as ``rfc822``)."""
    notify, orcpt = notify_of(extra, recipient), orcpt_of(extra, recipient)
    out: dict[str, str | None] = {}
    if notify is not None:
        out["NOTIFY"] = notify
        if orcpt is None and recipient.isascii():
            orcpt = f"rfc822;{recipient}"
    if orcpt is not None:
        kind, _, address = orcpt.partition(";")
        encoded = xtext_encode(address)
        if address.isascii() and len(kind) + 1 + len(encoded) <= ORCPT_MAX:  # a UTF-8 ORCPT is not passed on
            out["ORCPT"] = f"{kind};{encoded}"
    return out
