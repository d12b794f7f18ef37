"""The milter wire format, protocol version 6: packets, commands, replies, negotiation flags.

Theory of operation: every packet is a 4-byte big-endian length (counting the
command byte and the data), one command byte and the data. The MTA sends
commands (``SMFIC_*``, upper case and a few symbols); the filter answers
with replies (``SMFIR_*``, lower case and ``+``/``-``/``2``). Strings are
NUL-terminated. This module only turns bytes into ``Packet``s and ``Packet``s
into the records of ``mta.milter.changes``; which reply may come when is
``mta.milter.session``'s table.

Raises ``MilterProtocolError`` (never anything else) for bytes that are not
a packet, or a packet whose data does not fit its command.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from mta.milter.changes import (
    Accept,
    AddHeader,
    AddRecipient,
    ChangeHeader,
    ChangeSender,
    Continue,
    CustomReply,
    DeleteRecipient,
    Discard,
    InsertHeader,
    Negotiated,
    Progress,
    Quarantine,
    Reject,
    ReplaceBody,
    Response,
    Skip,
    Tempfail,
)
from mta.smtp.common import Reply

VERSION: Final = 6
MAX_PACKET: Final = 1 << 20  # a filter's packet above this (libmilter's largest body chunk is 1 MiB) is an error
BODY_CHUNK: Final = 65535  # MILTER_CHUNK_SIZE: the body is sent in pieces of at most this

# Commands, MTA to filter.
C_ABORT: Final = b"A"
C_BODY: Final = b"B"
C_CONNECT: Final = b"C"
C_MACRO: Final = b"D"
C_BODYEOB: Final = b"E"
C_HELO: Final = b"H"
C_HEADER: Final = b"L"
C_MAIL: Final = b"M"
C_EOH: Final = b"N"
C_OPTNEG: Final = b"O"
C_QUIT: Final = b"Q"
C_RCPT: Final = b"R"
C_DATA: Final = b"T"

# Action flags (what the MTA lets a filter change), SMFIF_*.
F_ADDHDRS: Final = 0x01
F_CHGBODY: Final = 0x02
F_ADDRCPT: Final = 0x04
F_DELRCPT: Final = 0x08
F_CHGHDRS: Final = 0x10
F_QUARANTINE: Final = 0x20
F_CHGFROM: Final = 0x40
F_ADDRCPT_PAR: Final = 0x80
F_SETSYMLIST: Final = 0x100
ALL_ACTIONS: Final = 0x1FF

# Protocol flags (steps a filter does not want, or wants no reply to), SMFIP_*.
P_NOCONNECT: Final = 0x01
P_NOHELO: Final = 0x02
P_NOMAIL: Final = 0x04
P_NORCPT: Final = 0x08
P_NOBODY: Final = 0x10
P_NOHDRS: Final = 0x20
P_NOEOH: Final = 0x40
P_NR_HDR: Final = 0x80
P_NOUNKNOWN: Final = 0x100
P_NODATA: Final = 0x200
P_SKIP: Final = 0x400
P_RCPT_REJ: Final = 0x800
P_NR_CONN: Final = 0x1000
P_NR_HELO: Final = 0x2000
P_NR_MAIL: Final = 0x4000
P_NR_RCPT: Final = 0x8000
P_NR_DATA: Final = 0x10000
P_NR_UNKN: Final = 0x20000
P_NR_EOH: Final = 0x40000
P_NR_BODY: Final = 0x80000
P_HDR_LEADSPC: Final = 0x100000
# What this MTA offers: every step may be left out or go unanswered, SKIP works. Not RCPT_REJ (rejected
# recipients are not shown), not HDR_LEADSPC (libmilter keeps an offered flag unless the filter clears it, and
# filters expect values without the space; one that asks for it anyway is sent the space), and no packets
# larger than libmilter's default.
OFFERED_PROTOCOL: Final = 0xFFFFF & ~P_RCPT_REJ

# Macro stages of a SETSYMLIST in the negotiation reply (SMFIM_*), by the command they go with.
MACRO_STAGES: Final = {0: C_CONNECT, 1: C_HELO, 2: C_MAIL, 3: C_RCPT, 4: C_DATA, 5: C_BODYEOB, 6: C_EOH}

_U32 = struct.Struct(">I")


class MilterProtocolError(ValueError):
    """A filter sent bytes that are not a milter packet, or a reply not allowed where it came."""


@attrs.frozen
class Packet:
    command: bytes  # one byte
    data: bytes


def packet(command: bytes, data: bytes = b"") -> bytes:
    return _U32.pack(len(data) + 1) + command + data


def _z(text: str) -> bytes:
    """A NUL-terminated string; a NUL inside would end it early, so it cannot be sent."""
    if "\0" in text:
        raise MilterProtocolError("a milter string cannot hold NUL")
    return text.encode("utf-8", "surrogateescape") + b"\0"


def optneg(actions: int = ALL_ACTIONS, protocol: int = OFFERED_PROTOCOL) -> bytes:
    return packet(C_OPTNEG, struct.pack(">III", VERSION, actions, protocol))


def macros(command: bytes, values: Mapping[str, str]) -> bytes:
    """The macros of one stage (``SMFIC_MACRO``): sent just before the command they belong to."""
    return packet(C_MACRO, command + b"".join(_z(k) + _z(v) for k, v in values.items()))


def connect(hostname: str, address: str, port: int) -> bytes:
    """``SMFIC_CONNECT``; the family is read off the address (``4``, ``6``, or ``U`` for none)."""
    if not address:
        return packet(C_CONNECT, _z(hostname) + b"U")
    family = b"6" if ":" in address else b"4"
    return packet(C_CONNECT, _z(hostname) + family + struct.pack(">H", port) + _z(address))


def helo(name: str) -> bytes:
    return packet(C_HELO, _z(name))


def envelope(command: bytes, address: str, params: Iterable[str] = ()) -> bytes:
    """``SMFIC_MAIL`` or ``SMFIC_RCPT``: the address in angle brackets, then each ESMTP parameter."""
    return packet(command, _z(f"<{address}>") + b"".join(_z(p) for p in params))


def header(name: str, value: str) -> bytes:
    return packet(C_HEADER, _z(name) + _z(value))


def body_chunks(body: bytes) -> list[bytes]:
    return [packet(C_BODY, body[i:i + BODY_CHUNK]) for i in range(0, len(body), BODY_CHUNK)]


class Decoder:
    """Packets out of the bytes a filter sent, however they were split."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def receive_data(self, data: bytes) -> None:
        self._buf += data

    def next_packet(self) -> Packet | None:
        if len(self._buf) < 4:
            return None
        (length,) = _U32.unpack_from(self._buf)
        if length == 0 or length > MAX_PACKET:
            raise MilterProtocolError(f"packet length {length} out of range")
        if len(self._buf) < 4 + length:
            return None
        command, data = bytes(self._buf[4:5]), bytes(self._buf[5:4 + length])
        del self._buf[:4 + length]
        return Packet(command, data)


def _strings(data: bytes, count: int, what: str) -> list[str]:
    """``count`` NUL-terminated strings making up all of ``data`` (a last one may lack its NUL)."""
    parts = data.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    if len(parts) != count:
        raise MilterProtocolError(f"{what}: expected {count} string(s), got {len(parts)}")
    return [p.decode("utf-8", "surrogateescape") for p in parts]


def _index_and_header(data: bytes, what: str) -> tuple[int, str, str]:
    if len(data) < 4:
        raise MilterProtocolError(f"{what}: too short")
    (index,) = _U32.unpack_from(data)
    name, value = _strings(data[4:], 2, what)
    return index, name, value


def parse_custom_reply(text: str) -> Reply:
    """``SMFIR_REPLYCODE``'s text, ``"550 5.7.1 why"`` (lines joined by CRLF for a multi-line reply)."""
    lines = text.replace("\r\n", "\n").split("\n")
    first = lines[0]
    code_text = first[:3]
    if not code_text.isdigit() or int(code_text[0]) not in (4, 5) or (len(first) > 3 and first[3] not in " -"):
        raise MilterProtocolError(f"custom reply {text[:40]!r} is not a 4xx or 5xx reply")
    texts: list[str] = []
    enhanced: str | None = None
    for i, line in enumerate(lines):
        rest = line[4:] if line[:3] == code_text else line
        head, _, tail = rest.partition(" ")
        if i == 0 and head.count(".") == 2 and head.replace(".", "").isdigit():
            if head[:1] != code_text[0]:
                raise MilterProtocolError(f"custom reply {text[:40]!r}: enhanced code of another class")
            enhanced, rest = head, tail
        elif enhanced is not None and head == enhanced:
            rest = tail
        texts.append("".join(ch for ch in rest if ch.isprintable()))
    try:
        return Reply(int(code_text), enhanced, "\n".join(texts))
    except ValueError as exc:
        raise MilterProtocolError(f"custom reply {text[:40]!r}: {exc}") from None


def parse_negotiation(data: bytes) -> Negotiated:
    if len(data) < 12:
        raise MilterProtocolError("option negotiation reply too short")
    version, actions, protocol = struct.unpack_from(">III", data)
    if version < 2:
        raise MilterProtocolError(f"filter speaks milter protocol {version}")
    wanted: dict[bytes, tuple[str, ...]] = {}
    rest = data[12:]
    while len(rest) >= 4:
        (stage,) = _U32.unpack_from(rest)
        end = rest.find(b"\0", 4)
        names = rest[4:] if end < 0 else rest[4:end]
        rest = b"" if end < 0 else rest[end + 1:]
        if stage in MACRO_STAGES:
            wanted[MACRO_STAGES[stage]] = tuple(n.strip("{}") for n in names.decode("ascii", "replace").split())
    return Negotiated(version, actions, protocol, wanted)


def parse_reply(p: Packet) -> Response:
    """A filter's packet as the record it stands for."""
    c, d = p.command, p.data
    simple: dict[bytes, Response] = {b"a": Accept(), b"c": Continue(), b"d": Discard(), b"r": Reject(),
                                     b"t": Tempfail(), b"p": Progress(), b"s": Skip()}
    if c in simple and not d.strip(b"\0"):
        return simple[c]
    if c == b"O":
        return parse_negotiation(d)
    if c == b"y":
        return CustomReply(parse_custom_reply(_strings(d, 1, "custom reply")[0]))
    if c == b"h":
        name, value = _strings(d, 2, "add header")
        return AddHeader(name, value)
    if c == b"i":
        return InsertHeader(*_index_and_header(d, "insert header"))
    if c == b"m":
        return ChangeHeader(*_index_and_header(d, "change header"))
    if c == b"b":
        return ReplaceBody(d)
    if c == b"e":
        parts = _strings(d, 2, "change sender") if d.rstrip(b"\0").count(b"\0") else _strings(d, 1, "change sender")
        return ChangeSender(_unbracket(parts[0]), parts[1] if len(parts) > 1 else "")
    if c in (b"+", b"2"):
        parts = _strings(d, 1, "add recipient") if c == b"+" else d.rstrip(b"\0").decode("utf-8", "replace").split(
            "\0")
        return AddRecipient(_unbracket(parts[0]), parts[1] if len(parts) > 1 else "")
    if c == b"-":
        return DeleteRecipient(_unbracket(_strings(d, 1, "delete recipient")[0]))
    if c == b"q":
        return Quarantine(_strings(d, 1, "quarantine")[0] if d.strip(b"\0") else "")
    raise MilterProtocolError(f"unknown or malformed reply {c!r} ({len(d)} bytes)")


def _unbracket(address: str) -> str:
    address = address.strip()
    if address.startswith("<") and address.endswith(">"):
        return address[1:-1]
    return address
