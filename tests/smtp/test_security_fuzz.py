"""Fuzzing what faces the outside: the server core across STARTTLS, and the config loader on any file.

tests/smtp/test_smtp_fuzz.py fuzzes the core without TLS (any bytes in any
chunking give the same replies) and tests/relay/test_config.py fuzzes parse_config
on TOML-shaped input; these add the STARTTLS boundary (CVE-2011-0411 as a
property) and load_config on arbitrary bytes.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mta.config import Config, ConfigError, load_config
from mta.smtp import server as S
from mta.smtp.common import ReplyParser

PIECES = [b"EHLO c.example\r\n", b"STARTTLS\r\n", b"MAIL FROM:<a@x.example>\r\n", b"RCPT TO:<b@y.example>\r\n",
          b"DATA\r\n", b"RSET\r\n", b"NOOP\r\n", b"QUIT\r\n", b"x\r\n.\r\n", b"\r\n", b"\n"]
streams = st.lists(st.one_of(st.sampled_from(PIECES), st.binary(max_size=12)), max_size=25).map(b"".join)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


@settings(max_examples=300, deadline=None)
@given(streams, st.lists(st.integers(min_value=0), max_size=8), streams)
def test_nothing_read_before_the_tls_handshake_is_obeyed_after_it(plain: bytes, cuts: list[int],
                                                                  encrypted: bytes) -> None:
    conn = S.ServerConnection("mx.test", tls_available=True, max_errors=1000)
    feed = split(plain, cuts)
    tls_feed: list[bytes] | None = None
    out = bytearray()
    for _ in range(10_000):  # bounded: each turn consumes input or ends
        ev = conn.next_event()
        out += conn.data_to_send()
        if isinstance(ev, S.NeedData):
            source = feed if tls_feed is None else tls_feed
            conn.receive_data(source.pop(0) if source else b"")
        elif isinstance(ev, S.ConnectionClosed):
            break
        elif isinstance(ev, S.StartTls):
            conn.accept()
            conn.tls_started()  # the handshake
            # CVE-2011-0411: whatever plaintext followed STARTTLS is gone; the core must ask for new bytes.
            assert isinstance(conn.next_event(), S.NeedData)
            assert conn.data_to_send().startswith(b"220 ")
            tls_feed = split(encrypted, cuts)
            feed = []
        elif isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData):
            conn.accept()
    else:
        raise AssertionError("the core did not finish")
    replies = ReplyParser().feed(bytes(out))
    assert replies[0].code == 220


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=300),
                 st.lists(st.sampled_from([b"[server]\n", b"[delivery]\n", b"tls_ca_file = \"ca.pem\"\n",
                                           b"tls_cert = \"\"\n", b"max_message_size = \"1k\"\n",
                                           b"\xff\xfe", b"\x00", b"[routes]\n\"*\" = \"smtp://h?tls=verify\"\n"]),
                          max_size=8).map(b"".join)))
def test_load_config_on_any_file_gives_config_or_config_error(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "ca.pem").write_text("not really a CA\n")
    path = tmp_path / "fuzz.toml"
    path.write_bytes(data)
    try:
        config = load_config(path, environ={})
    except ConfigError as e:
        assert str(e).startswith(str(path))
        assert "\n" not in e.problem or "TOML" in e.problem
    else:
        assert isinstance(config, Config)
