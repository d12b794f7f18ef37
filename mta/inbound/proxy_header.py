"""The PROXY protocol header (HAProxy's proxy-protocol.txt, versions 1 and 2), sans I/O.

Theory of operation
-------------------
A TCP balancer in front of the relay opens its own connection to the relay
and sends, before any byte of the client's, one header that says who the
client is. ``HeaderReader`` takes bytes in (``receive_data``) and answers
``next_event``: ``NeedData`` until the header is whole, then one
``ProxyHeader`` with whatever bytes came after it (``rest``: the client's
first bytes, which belong to the SMTP session). Anything that is no valid
header raises ``ProxyHeaderError``; the reader never waits for more than
one header's bytes (v1: 107, v2: 16 + its length field).

The first byte decides the version: ``P`` is v1 (text: ``PROXY TCP4 SRC DST
SPORT DPORT\\r\\n``, ``TCP6``, or ``UNKNOWN`` and anything up to the CRLF),
``\\r`` is v2 (the 12-byte signature, version and command, family, a length
and the addresses, then TLVs, which are skipped: the relay needs none of
them). A v2 ``LOCAL`` command (the balancer's own health check), a v1
``UNKNOWN`` and a v2 family other than TCP over IPv4 or IPv6 (UNIX sockets,
UDP, unspecified) carry no client: ``ProxyHeader.client`` is None and the
connection is the balancer's own, as the specification asks.

The states, as a table: the only place the reader's state changes is
``_fire``.
"""

from __future__ import annotations

import enum
import ipaddress
import re
import struct

import attrs

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V1_MAX = 107  # the whole v1 line, CRLF included (proxy-protocol.txt §2.1)
V2_FIXED = 16  # signature, version/command, family, length
_V1 = re.compile(rb"PROXY (TCP4|TCP6) (\S+) (\S+) (0|[1-9][0-9]{0,4}) (0|[1-9][0-9]{0,4})\r\n")
_V2_ADDRESS_SIZES = {0x11: 12, 0x21: 36}  # TCP over IPv4, over IPv6: two addresses, two ports


class ProxyHeaderError(ValueError):
    """The bytes are no PROXY header the relay accepts (why, in words)."""


@attrs.frozen
class NeedData:
    """More bytes are needed before the header is whole."""


@attrs.frozen
class ProxyHeader:
    """The header, whole. ``client``: (address, port) the balancer speaks for, None when it speaks for itself
    (v2 LOCAL, v1 UNKNOWN, a family without addresses); ``version``: 1 or 2; ``rest``: the bytes after it."""

    version: int
    client: tuple[str, int] | None
    rest: bytes = b""


class State(enum.Enum):
    START = "start"  # nothing seen that says which version
    V1 = "v1"
    V2 = "v2"
    DONE = "done"


class Input(enum.Enum):
    V1_START = "v1_start"
    V2_START = "v2_start"
    WHOLE = "whole"


TRANSITIONS: dict[State, dict[Input, State]] = {
    State.START: {Input.V1_START: State.V1, Input.V2_START: State.V2},
    State.V1: {Input.WHOLE: State.DONE},
    State.V2: {Input.WHOLE: State.DONE},
    State.DONE: {},
}


class HeaderReader:
    """Reads one PROXY header off the front of a connection's bytes."""

    def __init__(self) -> None:
        self.state = State.START
        self._buf = bytearray()
        self._done: ProxyHeader | None = None

    def _fire(self, what: Input) -> None:
        following = TRANSITIONS[self.state].get(what)
        if following is None:
            raise ProxyHeaderError(f"{what.value} in state {self.state.value}")
        self.state = following

    def receive_data(self, data: bytes | bytearray) -> None:
        if self.state is State.DONE:
            raise ProxyHeaderError("the header was read already")
        self._buf += data

    def next_event(self) -> NeedData | ProxyHeader:
        """``NeedData``, or the header (once; after it, the same header again).

        Raises:
            ProxyHeaderError: the bytes so far cannot begin a header, or make a bad one.
        """
        if self._done is not None:
            return self._done
        buf = self._buf
        if self.state is State.START:
            if not buf:
                return NeedData()
            if buf[:1] == b"P":
                self._fire(Input.V1_START)
            elif buf[:1] == b"\r":
                self._fire(Input.V2_START)
            else:
                raise ProxyHeaderError("no PROXY header: the connection does not begin with one")
        found = self._v1() if self.state is State.V1 else self._v2()
        if found is None:
            return NeedData()
        self._fire(Input.WHOLE)
        self._done = found
        self._buf = bytearray()
        return found

    def _v1(self) -> ProxyHeader | None:
        buf = self._buf
        if not b"PROXY "[: len(buf)].startswith(bytes(buf[:6])):
            raise ProxyHeaderError("no PROXY header: the connection does not begin with one")
        end = buf.find(b"\r\n")
        if end < 0:
            if len(buf) >= V1_MAX or b"\n" in buf:
                raise ProxyHeaderError(f"PROXY v1 line without CRLF within {V1_MAX} bytes")
            return None
        line, rest = bytes(buf[:end + 2]), bytes(buf[end + 2:])
        if len(line) > V1_MAX:
            raise ProxyHeaderError(f"PROXY v1 line longer than {V1_MAX} bytes")
        if line.startswith(b"PROXY UNKNOWN"):
            return ProxyHeader(1, None, rest)
        m = _V1.fullmatch(line)
        if m is None:
            raise ProxyHeaderError("malformed PROXY v1 line")
        family, src, _dst, sport, dport = m.groups()
        version = 4 if family == b"TCP4" else 6
        address = _address(src, version)
        _address(_dst, version)
        port = int(sport)
        if port > 65535 or int(dport) > 65535:
            raise ProxyHeaderError("PROXY v1 port out of range")
        return ProxyHeader(1, (address, port), rest)

    def _v2(self) -> ProxyHeader | None:
        buf = self._buf
        seen = bytes(buf[:len(V2_SIGNATURE)])
        if not V2_SIGNATURE.startswith(seen):
            raise ProxyHeaderError("no PROXY header: the connection does not begin with one")
        if len(buf) < V2_FIXED:
            return None
        ver_cmd, family, length = buf[12], buf[13], struct.unpack_from("!H", buf, 14)[0]
        if ver_cmd >> 4 != 2:
            raise ProxyHeaderError(f"PROXY v2 header of version {ver_cmd >> 4}")
        command = ver_cmd & 0x0F
        if command not in (0, 1):
            raise ProxyHeaderError(f"PROXY v2 command {command} is neither LOCAL nor PROXY")
        if len(buf) < V2_FIXED + length:
            return None
        body = bytes(buf[V2_FIXED:V2_FIXED + length])
        rest = bytes(buf[V2_FIXED + length:])
        if command == 0:  # LOCAL: the balancer's own connection (a health check); its addresses are ignored
            return ProxyHeader(2, None, rest)
        size = _V2_ADDRESS_SIZES.get(family)
        if size is None:
            if family >> 4 > 3 or family & 0x0F > 2:
                raise ProxyHeaderError(f"PROXY v2 family 0x{family:02x} is not defined")
            return ProxyHeader(2, None, rest)  # UNIX, UDP or unspecified: no TCP client to speak of
        if length < size:
            raise ProxyHeaderError(f"PROXY v2 addresses need {size} bytes, the header has {length}")
        if family == 0x11:
            src = str(ipaddress.IPv4Address(body[0:4]))
            sport = struct.unpack_from("!H", body, 8)[0]
        else:
            src = str(ipaddress.IPv6Address(body[0:16]))
            sport = struct.unpack_from("!H", body, 32)[0]
        return ProxyHeader(2, (src, sport), rest)  # what follows the addresses is TLVs: none is needed


def _address(raw: bytes, version: int) -> str:
    try:
        address = ipaddress.ip_address(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProxyHeaderError("PROXY v1 address is not an IP address") from None
    if address.version != version:
        raise ProxyHeaderError(f"PROXY v1 address is not an IPv{version} address")
    return str(address)
