"""The PROXY header reader (``mta.inbound.proxy_header``): both versions as haproxy writes them, and fuzzed.

The worked examples are the byte strings of HAProxy's proxy-protocol.txt
(§2.1, §2.2); the fuzz follows STYLE.md's rule for a decoder: a header or
``ProxyHeaderError``, nothing else, and the same answer whether the bytes
come at once or one at a time.
"""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.inbound.proxy_header import (
    TRANSITIONS,
    V2_SIGNATURE,
    HeaderReader,
    NeedData,
    ProxyHeader,
    ProxyHeaderError,
    State,
)


def read(data: bytes) -> ProxyHeader | NeedData:
    reader = HeaderReader()
    reader.receive_data(data)
    return reader.next_event()


def read_bytewise(data: bytes) -> ProxyHeader | NeedData:
    """One byte at a time until the header is whole; the bytes not fed yet are what follows it too."""
    reader = HeaderReader()
    found: ProxyHeader | NeedData = reader.next_event()
    fed = 0
    while isinstance(found, NeedData) and fed < len(data):
        reader.receive_data(data[fed:fed + 1])
        fed += 1
        found = reader.next_event()
    if isinstance(found, ProxyHeader):
        return ProxyHeader(found.version, found.client, found.rest + data[fed:])
    return found


def v2(command: int, family: int, body: bytes, tlvs: bytes = b"") -> bytes:
    payload = body + tlvs
    return V2_SIGNATURE + bytes([0x20 | command, family]) + struct.pack("!H", len(payload)) + payload


def v2_tcp4(src: str, sport: int, dst: str = "127.0.0.1", dport: int = 25, tlvs: bytes = b"") -> bytes:
    return v2(1, 0x11, socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!HH", sport, dport), tlvs)


def test_v1_names_the_client_and_keeps_what_follows_for_the_session() -> None:
    assert read(b"PROXY TCP4 192.0.2.7 127.0.0.1 56324 25\r\nEHLO x\r\n") == \
        ProxyHeader(1, ("192.0.2.7", 56324), b"EHLO x\r\n")
    assert read(b"PROXY TCP6 2001:db8::7 ::1 4242 25\r\n") == ProxyHeader(1, ("2001:db8::7", 4242))
    assert read(b"PROXY UNKNOWN\r\n") == ProxyHeader(1, None)
    assert read(b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\n") == ProxyHeader(1, None)
    assert read(b"PROXY TCP4 192.0.2.7 127.0.0.1 5") == NeedData()


@pytest.mark.parametrize("bad", [
    b"EHLO client.example\r\n",  # no header at all: a client that went round the balancer
    b"PROXY TCP4 192.0.2.7 127.0.0.1 56324\r\n",  # a port missing
    b"PROXY TCP4 2001:db8::1 127.0.0.1 1 25\r\n",  # an IPv6 address under TCP4
    b"PROXY TCP4 192.0.2.300 127.0.0.1 1 25\r\n",
    b"PROXY TCP4 192.0.2.7 127.0.0.1 65536 25\r\n",
    b"PROXY TCP4 192.0.2.7 127.0.0.1 01 25\r\n",  # leading zero
    b"PROXY TCP4 192.0.2.7  127.0.0.1 1 25\r\n",
    b"PROXY TCP4 192.0.2.7 127.0.0.1 1 25\n",  # LF alone
    b"PROXY UDP4 192.0.2.7 127.0.0.1 1 25\r\n",
    b"PROXY " + b"x" * 120,  # no CRLF within 107 bytes
])
def test_v1_refuses_what_is_no_header(bad: bytes) -> None:
    with pytest.raises(ProxyHeaderError):
        read(bad)


def test_v2_proxy_local_families_and_tlvs() -> None:
    assert read(v2_tcp4("192.0.2.9", 40000) + b"rest") == ProxyHeader(2, ("192.0.2.9", 40000), b"rest")
    six = v2(1, 0x21, socket.inet_pton(socket.AF_INET6, "2001:db8::9") + socket.inet_pton(socket.AF_INET6, "::1")
             + struct.pack("!HH", 5, 25))
    assert read(six) == ProxyHeader(2, ("2001:db8::9", 5))
    # TLVs after the addresses (haproxy's PP2_TYPE_UNIQUE_ID, a NOOP) are skipped, whatever they hold.
    tlvs = b"\x05\x00\x03abc" + b"\x04\x00\x02\xff\xff"
    assert read(v2_tcp4("192.0.2.9", 1, tlvs=tlvs) + b"EHLO") == ProxyHeader(2, ("192.0.2.9", 1), b"EHLO")
    assert read(v2(0, 0x00, b"")) == ProxyHeader(2, None)  # LOCAL: haproxy's health check
    assert read(v2(0, 0x11, b"\0" * 12)) == ProxyHeader(2, None)  # LOCAL ignores the addresses it carries
    assert read(v2(1, 0x31, b"\0" * 216)) == ProxyHeader(2, None)  # a UNIX socket: no TCP client to name
    assert read(v2(1, 0x00, b"")) == ProxyHeader(2, None)
    assert read(V2_SIGNATURE[:5]) == NeedData()
    assert read(v2_tcp4("192.0.2.9", 1)[:20]) == NeedData()


@pytest.mark.parametrize("bad", [
    V2_SIGNATURE[:11] + b"X",
    V2_SIGNATURE + bytes([0x11, 0x11, 0, 12]) + b"\0" * 12,  # version 1 in a v2 frame
    V2_SIGNATURE + bytes([0x22, 0x11, 0, 12]) + b"\0" * 12,  # command 2
    V2_SIGNATURE + bytes([0x21, 0x11, 0, 4]) + b"\0" * 4,  # addresses cut short
    V2_SIGNATURE + bytes([0x21, 0x41, 0, 0]),  # family 4 is not defined
])
def test_v2_refuses_what_is_no_header(bad: bytes) -> None:
    with pytest.raises(ProxyHeaderError):
        read(bad)


def test_every_transition_of_the_table_is_taken_and_the_header_is_read_once() -> None:
    taken = set()
    for data in (b"PROXY UNKNOWN\r\n", v2(0, 0, b"")):
        reader = HeaderReader()
        states = [reader.state]
        reader.receive_data(data)
        reader.next_event()
        states.append(reader.state)
        taken.add((states[0], states[1]))
        assert reader.next_event() == reader.next_event()  # the same header, asked again
        with pytest.raises(ProxyHeaderError):
            reader.receive_data(b"more")
    table = {(before, after) for before, row in TRANSITIONS.items() for after in row.values()}
    assert {(State.START, State.DONE)} == taken and {s for s, _ in table} == {State.START, State.V1, State.V2}


def outcome(read_fn: object, data: bytes) -> object:
    assert callable(read_fn)
    try:
        return read_fn(data)
    except ProxyHeaderError:
        return ProxyHeaderError


headers = st.one_of(
    st.builds(lambda a, p, tail: f"PROXY TCP4 {a} 127.0.0.1 {p} 25\r\n".encode() + tail,
              st.ip_addresses(v=4).map(str), st.integers(0, 65535), st.binary(max_size=8)),
    st.builds(lambda a, p, tlvs: v2_tcp4(a, p, tlvs=tlvs), st.ip_addresses(v=4).map(str), st.integers(0, 65535),
              st.binary(max_size=40)),
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(headers, st.binary(max_size=200),
                 st.builds(lambda h, cut, junk: h[:cut] + junk, headers, st.integers(0, 60), st.binary(max_size=30))))
def test_fuzz_a_header_or_a_refusal_and_the_same_at_once_as_bytewise(data: bytes) -> None:
    whole, bytewise = outcome(read, data), outcome(read_bytewise, data)
    assert whole == bytewise, (data, whole, bytewise)
    assert whole is ProxyHeaderError or isinstance(whole, (ProxyHeader, NeedData))
