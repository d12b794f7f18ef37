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
of 100 KB and more: the two passes that visit every byte (is there a bare
LF? the relaxed body's spaces) are one pass each in C (``mta.dkim._canon``,
built at install), since each ``bytes`` method scans at 1 to 2.5 GB/s and
the Python forms of the two took 0.5 ms of a 100 KB message, more than the
RSA-2048 signature. Where the C module was not built (no compiler at
install), the Python twins below give the same bytes: each pass there runs
only where it would change something (``in`` is a memory search), by
``bytes.replace`` rather than a regex (one that visits every space of a text
body costs more than the RSA signature). The body is sliced, not copied
line by line.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["CANONICALIZATIONS", "NATIVE", "Field", "Malformed", "Parsed", "bare_lf", "bare_lf_python", "body_canonical",
           "header_canonical", "relaxed_wsp", "relaxed_wsp_python", "split"]

CANONICALIZATIONS = (b"relaxed", b"simple")
_NAME = re.compile(rb"([\x21-\x7e]+?):")
_LINE_END = re.compile(rb"\r?\n")
_ALL_WSP = re.compile(rb"[\t ]+")


def bare_lf_python(data: bytes) -> bool:
    """Does a LF appear that no CR precedes? (``_canon.bare_lf``'s twin.)"""
    return data.count(b"\n") != data.count(b"\r\n")


def relaxed_wsp_python(body: bytes) -> bytes:
    """Each run of spaces and tabs as one space, and none before a CRLF (``_canon.relaxed_wsp``'s twin).

    Runs of WSP to one space, then the space before each CRLF dropped: the same bytes as stripping first
    (RFC 6376's order), in replaces that each run at memory speed and only when needed.
    """
    if b"\t" in body:
        body = body.replace(b"\t", b" ")
    while b"  " in body:
        body = body.replace(b"  ", b" ")
    if b" \r\n" in body:
        body = body.replace(b" \r\n", b"\r\n")
    return body


try:
    from mta.dkim._canon import bare_lf, relaxed_wsp
except ImportError:  # not built: the Python twins (the same bytes, slower)
    NATIVE = False
    bare_lf, relaxed_wsp = bare_lf_python, relaxed_wsp_python
else:
    NATIVE = True


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
    if bare_lf(message):
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
        body = relaxed_wsp(body)
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
