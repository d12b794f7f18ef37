"""Server-level fuzzing: hostile SMTP sessions against a relay running in this process.

``tests/smtp/test_smtp_fuzz.py`` fuzzes the sans-IO core; these drive the whole
relay over TCP on 127.0.0.1 with the generator of ``fault_injection.smtpfuzz``
(its docstring says what is checked): every byte value in every command
argument, random and mutated sessions in random chunking, abrupt closes. After
every batch a fresh client must get 220 and a well-formed message must be
delivered. The long run is ``python -m fault_injection smtpfuzz --minutes N``
(figures in docs/reliability.md).
"""

from __future__ import annotations

import itertools
import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fault_injection import smtpfuzz
from mta.inbound.proxy_header import V2_SIGNATURE

_probes = itertools.count(1)


class HypothesisChooser:
    """The harness's choices drawn from hypothesis, so a failing batch shrinks."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def binary(self, max_size: int) -> bytes:
        return self.data.draw(st.binary(max_size=max_size))


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[smtpfuzz.RelayThread]:
    with smtpfuzz.RelayThread(str(tmp_path_factory.mktemp("smtpfuzz"))) as running:
        yield running


def assert_still_serving(relay: smtpfuzz.RelayThread, stats: smtpfuzz.Stats, *, bdat: bool = False) -> None:
    smtpfuzz.probe(relay, next(_probes), stats, bdat=bdat)
    assert relay.alive(), f"the relay ended: {relay.crash!r}"
    assert not stats.problems, stats.problems
    assert not relay.errors, [r.getMessage() for r in relay.errors]  # contained, but still a bug
    assert stats.probes >= 1


def test_every_byte_value_in_every_argument_is_answered_and_the_relay_serves_on(
        relay: smtpfuzz.RelayThread) -> None:
    ch = smtpfuzz.RandomChooser(0)
    for first in range(0, 256, 32):
        stats = smtpfuzz.Stats()
        for value in range(first, first + 32):
            smtpfuzz.run_batch(relay.port, [smtpfuzz.byte_sweep(value)], ch, stats)
        assert stats.sessions == 32 and stats.replies >= 32 * len(smtpfuzz.TEMPLATES)
        assert_still_serving(relay, stats)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
@pytest.mark.slow
def test_random_hostile_sessions_in_random_chunks_never_stop_the_relay(
        relay: smtpfuzz.RelayThread, data: st.DataObject) -> None:
    ch = HypothesisChooser(data)
    stats = smtpfuzz.Stats()
    smtpfuzz.run_batch(relay.port, smtpfuzz.batch(ch), ch, stats)
    assert_still_serving(relay, stats)


# -- PROXY headers on a [proxy] listener -------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[smtpfuzz.RelayThread]:
    extra = '[proxy]\nlisten = ["127.0.0.1:0"]\nbalancers = ["127.0.0.0/8"]\nheader_timeout = "2s"\n'
    with smtpfuzz.RelayThread(str(tmp_path_factory.mktemp("proxyfuzz")), server_extra=extra) as running:
        yield running


def _v1(address: str, port: int) -> bytes:
    return f"PROXY TCP4 {address} 127.0.0.1 {port} 25\r\n".encode()


def _v2(command: int, family: int, body: bytes) -> bytes:
    return V2_SIGNATURE + bytes([0x20 | command, family]) + struct.pack("!H", len(body)) + body


_valid = st.one_of(
    st.builds(_v1, st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
    st.builds(lambda a, p, tlvs: _v2(1, 0x11, socket.inet_aton(a) + socket.inet_aton("127.0.0.1")
                                     + struct.pack("!HH", p, 25) + tlvs),
              st.ip_addresses(v=4).map(str), st.integers(0, 65535), st.binary(max_size=64)),
    st.just(_v2(0, 0, b"")), st.just(b"PROXY UNKNOWN\r\n"))
_hostile = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda h, cut, junk: h[:cut] + junk, _valid, st.integers(0, 80), st.binary(max_size=64)),
    st.builds(lambda fam, n, body: V2_SIGNATURE + bytes([0x21, fam]) + struct.pack("!H", n) + body,
              st.integers(0, 255), st.integers(0, 65535), st.binary(max_size=64)))


def _exchange(port: int, header: bytes, chunks: int, after: bytes) -> bytes:
    """``header`` in ``chunks`` writes, then ``after``; what the relay sent before it closed (or 5 s passed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        step = max(1, len(header) // chunks)
        try:
            for i in range(0, len(header), step):
                sock.sendall(header[i:i + step])
            sock.sendall(after)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # closed on us mid-header: that is an answer
        out = b""
        try:
            while data := sock.recv(65536):
                out += data
        except (TimeoutError, OSError):
            pass
        return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.one_of(_valid, _hostile), chunks=st.integers(1, 8),
       after=st.sampled_from([b"", b"QUIT\r\n", b"EHLO fuzz.example\r\nMAIL FROM:<a@b>\r\nQUIT\r\n"]))
def test_proxy_headers_valid_cut_or_hostile_get_a_session_or_silence_and_the_relay_serves_on(
        proxied: smtpfuzz.RelayThread, header: bytes, chunks: int, after: bytes) -> None:
    out = _exchange(proxied.proxy_port, header, chunks, after)
    assert out == b"" or out.startswith(b"220 "), out  # a banner only after a whole header; else nothing
    stats = smtpfuzz.Stats()
    assert_still_serving(proxied, stats)


def test_a_valid_header_in_every_chunking_opens_a_session(proxied: smtpfuzz.RelayThread) -> None:
    for header in (_v1("192.0.2.1", 4242), _v2(1, 0x11, socket.inet_aton("192.0.2.1") * 2 + b"\0\1\0\x19"),
                   _v2(0, 0, b"")):
        for chunks in (1, 2, len(header)):
            out = _exchange(proxied.proxy_port, header, chunks, b"QUIT\r\n")
            assert out.startswith(b"220 ") and b"221 " in out, (header, chunks, out)

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_hostile_bdat_chunks_never_stop_the_relay(relay: smtpfuzz.RelayThread, data: st.DataObject) -> None:
    """BDAT sessions (RFC 3030): chunks of hostile content, sizes that lie, commands between chunks, cut
    anywhere; then a message sent with BDAT is still delivered."""
    ch = HypothesisChooser(data)
    stats = smtpfuzz.Stats()
    smtpfuzz.run_batch(relay.port, [smtpfuzz.bdat_session(ch) for _ in range(ch.integer(1, 3))], ch, stats)
    assert_still_serving(relay, stats, bdat=True)
