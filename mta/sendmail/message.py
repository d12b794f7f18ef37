"""The message ``sendmail`` reads from standard input, made ready to store: line ends, headers, ``-t``.

What Postfix's ``sendmail`` and cleanup do, in the measure a relay needs:
lines end in CRLF whatever the caller wrote (cron and PHP write LF); without
``-i`` a line of one dot ends the message (the traditional rule); with
``-t`` the recipients are read from ``To:``, ``Cc:`` and ``Bcc:`` (added to
those on the command line) and ``Bcc:`` is removed; a message without
``From:``, ``Date:`` or ``Message-ID:`` gets one.
"""

from __future__ import annotations

import email.utils
import re
from collections.abc import Iterable

import attrs

_LINE_END = re.compile(rb"\r?\n")
_FIELD = re.compile(rb"([!-9;-~]+)[ \t]*:")


class MessageError(ValueError):
    """The input is no message the relay can take (why, in words)."""


@attrs.frozen
class Prepared:
    message: bytes
    header_recipients: tuple[str, ...]  # from To/Cc/Bcc (``-t``); empty without it


def read_lines(data: bytes, dot_ends: bool) -> list[bytes]:
    """The input's lines without their ends; with ``dot_ends`` the first line of one ``.`` ends it."""
    lines = _LINE_END.split(data)
    if lines and lines[-1] == b"":
        lines.pop()
    if dot_ends and b"." in lines:
        lines = lines[:lines.index(b".")]
    return lines


def _fields(header: list[bytes]) -> list[tuple[str, bytes]]:
    """(lower-case name, whole field with its folded lines) for each header field."""
    out: list[tuple[str, bytes]] = []
    for line in header:
        if line[:1] in (b" ", b"\t") and out:
            name, text = out[-1]
            out[-1] = (name, text + b"\r\n" + line)
            continue
        m = _FIELD.match(line)
        if m is None:
            raise MessageError(f"header line {line[:60]!r} is no header field (NAME: value)")
        out.append((m.group(1).decode("ascii").lower(), line))
    return out


def _addresses(fields: Iterable[bytes]) -> list[str]:
    values = [f.split(b":", 1)[1].decode("utf-8", "replace").replace("\r\n", "") for f in fields]
    return [address for _, address in email.utils.getaddresses(values) if address]


def prepare(data: bytes, *, dot_ends: bool, extract: bool, sender: str, full_name: str | None,
            hostname: str) -> Prepared:
    """The message to store, and (``extract``) the recipients its headers name.

    Raises: MessageError.
    """
    lines = read_lines(data, dot_ends)
    split = lines.index(b"") if b"" in lines else len(lines)
    if split == len(lines) and lines and _FIELD.match(lines[0]) is None:
        split = 0  # no header at all: every line is body
    header, body = lines[:split], lines[split + 1:] if split < len(lines) else []
    fields = _fields(header)
    names = {name for name, _ in fields}
    recipients = _addresses(f for n, f in fields if n in ("to", "cc", "bcc")) if extract else []
    kept = [f for n, f in fields if not (extract and n == "bcc")]
    if "from" not in names:
        kept.append(b"From: " + email.utils.formataddr((full_name or "", sender)).encode())
    if "date" not in names:
        kept.append(b"Date: " + email.utils.formatdate(localtime=True).encode())
    if "message-id" not in names:
        kept.append(b"Message-ID: " + email.utils.make_msgid(domain=hostname).encode())
    message = b"\r\n".join([*kept, b"", *body]) + b"\r\n"
    return Prepared(message, tuple(recipients))
