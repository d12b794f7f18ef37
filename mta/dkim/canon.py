"""A message split into header fields and body, and their canonical forms (RFC 6376 §3.4): no I/O, no keys.

Theory of operation
-------------------
``split`` reads a message as dkimpy's parser does, so that what the relay
signs is what the reference verifier (dkimpy) and OpenDKIM hash: a header
field is a name of printable characters up to its colon and every line
after it that begins with a space or a tab; a ``From `` line (an mbox
separator) is skipped; any other line before the empty one is a malformed
message (``Malformed``, and the mail goes unsigned). Bare LF line ends are
read as CRLF, as dkimpy reads them.

The canonical forms are bytes ready to hash. They are written for a message
of 100 KB and more: the body is transformed by a pass only where that pass
would change it (``in`` is a memory search), by ``bytes.replace`` rather
than a regex (one that visits every space of a text body costs more than
the RSA signature), and the body is sliced, not copied line by line.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["CANONICALIZATIONS", "Field", "Malformed", "Parsed", "body_canonical", "header_canonical", "split"]

CANONICALIZATIONS = (b"relaxed", b"simple")
_NAME = re.compile(rb"([\x21-\x7e]+?):")
_LINE_END = re.compile(rb"\r?\n")
_ALL_WSP = re.compile(rb"[\t ]+")


class Malformed(ValueError):
    """A line in the header block that is neither a field, a continuation nor an mbox ``From `` line."""


@attrs.frozen
class Field:
    """One header field as the message has it: ``value`` is everything after the colon, CRLF-ended lines."""

    name: bytes
    value: bytes


@attrs.frozen
class Parsed:
    """The message's header fields in order, and its body (everything after the empty line)."""

    fields: tuple[Field, ...]
    body: bytes


def split(message: bytes) -> Parsed:
    """The fields and body of ``message``.

    Raises Malformed: a header line that is no field (dkimpy refuses such a message too).
    """
    if message.count(b"\n") != message.count(b"\r\n"):
        message = _LINE_END.sub(b"\r\n", message)
    if message.startswith(b"\r\n"):
        return Parsed((), message[2:])
    end = message.find(b"\r\n\r\n")
    if end < 0:
        head, body = message, b""
    else:
        head, body = message[:end], message[end + 4:]
    names: list[bytes] = []
    values: list[list[bytes]] = []
    for line in head.split(b"\r\n"):
        if not line:  # a message that ends in its header block, CRLF-ended
            continue
        if line[0] in (0x09, 0x20):
            if not values:
                raise Malformed("the message begins with a continuation line")
            values[-1].append(line)
            continue
        match = _NAME.match(line)
        if match is not None:
            names.append(match.group(1))
            values.append([line[match.end():]])
        elif not line.startswith(b"From "):
            raise Malformed(f"not a header field: {line[:60]!r}")
    fields = tuple(Field(name, b"\r\n".join(lines) + b"\r\n") for name, lines in zip(names, values, strict=True))
    return Parsed(fields, body)


def header_canonical(field: Field, relaxed: bool) -> bytes:
    """The field as it is hashed, CRLF-ended: ``simple`` as it is, ``relaxed`` unfolded with single spaces."""
    if not relaxed:
        return field.name + b":" + field.value
    value = field.value.replace(b"\r\n", b"").replace(b"\n", b"")
    if b"\t" in value or b"  " in value:  # a regex call costs more than these searches of a short value
        value = _ALL_WSP.sub(b" ", value)
    value = value.strip()
    return field.name.lower().rstrip() + b":" + value + b"\r\n"


def body_canonical(body: bytes, relaxed: bool) -> bytes:
    """The body as it is hashed (RFC 6376 §3.4.3, §3.4.4): trailing empty lines dropped, CRLF-ended.

    A ``simple`` empty body is one CRLF; a ``relaxed`` one is empty.
    """
    if relaxed:
        # Runs of WSP to one space, then the space before each CRLF dropped: the same bytes as stripping
        # first (RFC 6376's order), in replaces that each run at memory speed and only when needed.
        if b"\t" in body:
            body = body.replace(b"\t", b" ")
        while b"  " in body:
            body = body.replace(b"  ", b" ")
        if b" \r\n" in body:
            body = body.replace(b" \r\n", b"\r\n")
    end = len(body)
    while end >= 2 and body.startswith(b"\r\n", end - 2, end):
        end -= 2
    if end == len(body):
        body += b"\r\n"
    else:
        body = body[:end + 2]
    if relaxed and body == b"\r\n":
        return b""
    return body
