"""BDAT (RFC 3030) in the server core: chunks read by count, policed as DATA's content, refused ones dropped."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.smtp import client as C
from mta.smtp import server as S
from mta.smtp.bodybytes import stuff
from mta.smtp.common import LocalProtocolError, Reply, ReplyParser

ENVELOPE = b"EHLO c.example\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\n"


def talk(data: bytes, *, reject_rcpt: bool = False, cuts: list[int] | None = None,
         **opts: object) -> tuple[list[S.Event], list[Reply]]:
    """Feed ``data`` (cut at ``cuts``), then EOF; accept every decision (or refuse RCPT). Events and replies."""
    conn = S.ServerConnection("mx.test", **opts)  # type: ignore[arg-type]
    bounds = [0, *(cuts or []), len(data)]
    reads = [data[a:b] for a, b in itertools.pairwise(bounds) if b > a] + [b""]
    events: list[S.Event] = []
    out = bytearray()
    while True:
        ev = conn.next_event()
        out += conn.data_to_send()
        if isinstance(ev, S.NeedData):
            conn.receive_data(reads.pop(0))
            continue
        events.append(ev)
        if isinstance(ev, S.RcptTo) and reject_rcpt:
            conn.reject(Reply(550, "5.1.1", "no"))
        elif isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData):
            conn.accept()
        if isinstance(ev, S.ConnectionClosed):
            out += conn.data_to_send()
            return events, ReplyParser().feed(bytes(out))


def content(events: list[S.Event]) -> bytes:
    return b"".join(ev.data for ev in events if isinstance(ev, S.DataChunk))


def codes(replies: list[Reply]) -> list[tuple[int, str | None]]:
    return [(r.code, r.enhanced) for r in replies]


def test_chunks_are_counted_not_dotted() -> None:
    events, replies = talk(ENVELOPE + b"BDAT 9\r\nline\r\n.\r\nBDAT 7 LAST\r\n.more\r\nQUIT\r\n")
    assert content(events) == b"line\r\n.\r\n.more\r\n"  # a dot line in a chunk is content, not an end
    assert S.EndOfData(16) in events
    assert codes(replies)[-3:] == [(250, "2.0.0"), (250, "2.0.0"), (221, "2.0.0")]
    assert replies[-3].lines == ["9 octets received"]


def test_a_crlf_split_between_chunks_is_one_line_end() -> None:
    events, _ = talk(ENVELOPE + b"BDAT 3\r\nab\rBDAT 4 LAST\r\n\n.\r\n")
    assert content(events) == b"ab\r\n.\r\n" and any(isinstance(ev, S.EndOfData) for ev in events)


def test_bare_lf_is_refused_or_made_crlf_as_in_data() -> None:
    chunk = b"BDAT 8 LAST\r\nbare\nlf\n"
    events, replies = talk(ENVELOPE + chunk)
    assert S.DataAborted(Reply(550, "5.6.11", "Bare CR or LF in message content; use CRLF")) in events
    assert codes(replies)[-1] == (550, "5.6.11")
    events, _ = talk(ENVELOPE + b"BDAT 9 LAST\r\nbare\nlf\r\n", normalize_bare_lf=True)
    assert content(events) == b"bare\r\nlf\r\n" and any(isinstance(ev, S.EndOfData) for ev in events)
    # Content that ends in a bare LF ends as DATA's would: its line is no line start, so a CRLF is added.
    events, _ = talk(ENVELOPE + chunk, normalize_bare_lf=True)
    assert content(events) == b"bare\r\nlf\r\n\r\n"


def test_a_size_past_the_limit_is_refused_at_once_and_its_octets_dropped() -> None:
    events, replies = talk(ENVELOPE + b"BDAT 50\r\n" + b"x" * 50 + b"BDAT 60 LAST\r\n" + b"MAIL " * 12
                           + b"NOOP\r\n", max_message_size=100)
    assert S.DataAborted(Reply(552, "5.3.4", "Message size exceeds fixed limit")) in events
    assert codes(replies)[-3:] == [(250, "2.0.0"), (552, "5.3.4"), (250, "2.0.0")]  # the NOOP after the drop


def test_bdat_without_a_recipient_is_refused_and_its_octets_never_read_as_commands() -> None:
    data = b"EHLO c.example\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nBDAT 6 LAST\r\nQUIT\r\nNOOP\r\n"
    events, replies = talk(data, reject_rcpt=True)
    assert not any(isinstance(ev, S.DataStart | S.Quit) for ev in events)
    assert codes(replies)[-2:] == [(554, "5.5.1"), (250, "2.0.0")]
    _, replies = talk(b"EHLO c.example\r\nBDAT 6\r\nQUIT\r\nNOOP\r\n")
    assert codes(replies)[-2:] == [(503, "5.5.1"), (250, "2.0.0")]


def test_data_after_bdat_and_bad_bdat_syntax() -> None:
    _, replies = talk(ENVELOPE + b"BDAT 2\r\nabDATA\r\nRCPT TO:<c@y.example>\r\nBDAT 1 FIRST\r\nBDAT\r\n"
                      b"BDAT 0 LAST\r\n")
    assert codes(replies)[-6:] == [(250, "2.0.0"), (503, "5.5.1"), (503, "5.5.1"), (501, "5.5.4"), (501, "5.5.4"),
                                   (250, "2.0.0")]


def test_rset_between_chunks_ends_the_transaction() -> None:
    events, replies = talk(ENVELOPE + b"BDAT 2\r\nabRSET\r\nBDAT 0 LAST\r\n")
    assert any(isinstance(ev, S.Rset) for ev in events) and not any(isinstance(ev, S.EndOfData) for ev in events)
    assert codes(replies)[-2:] == [(250, "2.0.0"), (503, "5.5.1")]


def test_eof_in_a_chunk_or_between_chunks_aborts() -> None:
    for tail in (b"BDAT 10 LAST\r\nabc", b"BDAT 3\r\nabc"):
        events, _ = talk(ENVELOPE + tail)
        assert events[-2:] == [S.DataAborted(None), S.ConnectionClosed()]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300).map(lambda b: b.replace(b"\x00", b"")), st.lists(st.integers(0, 300), max_size=4),
       st.booleans(), st.data())
def test_bdat_gives_what_data_gives(body: bytes, splits: list[int], normalize: bool, data: st.DataObject) -> None:
    """The same content sent with DATA (dot-stuffed, with a CRLF at its end) and in chunks cut anywhere, read in
    reads cut anywhere: the same events' content and the same verdict."""
    ended = body if body.endswith(b"\r\n") or not body else body + b"\r\n"
    via_data, _ = talk(ENVELOPE + b"DATA\r\n" + stuff(ended, True) + (b"" if ended.endswith(b"\r\n") or not ended
                                                                     else b"\r\n") + b".\r\n",
                       normalize_bare_lf=normalize)
    bounds = sorted({0, len(body), *(min(s, len(body)) for s in splits)})
    chunks = [body[a:b] for a, b in itertools.pairwise(bounds)] or [b""]
    wire = b"".join(b"BDAT %d%s\r\n" % (len(c), b" LAST" if i == len(chunks) - 1 else b"") + c
                    for i, c in enumerate(chunks))
    whole = ENVELOPE + wire
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=3)))
    via_bdat, _ = talk(whole, cuts=cuts, normalize_bare_lf=normalize)

    def verdict(events: list[S.Event]) -> object:
        return next((ev for ev in events if isinstance(ev, S.EndOfData | S.DataAborted)), None)

    assert verdict(via_bdat) == verdict(via_data)
    if isinstance(verdict(via_data), S.EndOfData):
        assert content(via_bdat) == content(via_data)


def test_without_chunking_bdat_is_not_implemented() -> None:
    _, replies = talk(ENVELOPE + b"BDAT 0 LAST\r\n", chunking=False)
    assert codes(replies)[-1] == (502, "5.5.1")


def client_in_body(chunk_size: int) -> C.ClientConnection:
    conn = C.ClientConnection()
    conn.receive_data(b"220 mx\r\n")
    conn.ehlo("c.example")
    conn.data_to_send()
    conn.receive_data(b"250-mx\r\n250-PIPELINING\r\n250 CHUNKING\r\n")
    conn.next_event()
    conn.next_event()
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    conn.bdat()
    assert conn._chunks is not None
    conn._chunks.chunk_size = chunk_size
    return conn


def test_the_client_cuts_the_body_into_chunks_and_a_refused_chunk_is_the_outcome() -> None:
    conn = client_in_body(8)
    conn.send_body(b"0123456789")  # a chunk is full: it goes
    conn.send_body(b"ab\nc")
    conn.end_data()
    assert conn.data_to_send() == (b"MAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nBDAT 10\r\n0123456789"
                                   b"BDAT 7 LAST\r\nab\r\nc\r\n")
    conn.receive_data(b"250 2.1.0 ok\r\n250 2.1.5 ok\r\n552 5.3.4 too big\r\n503 5.5.1 no transaction\r\n")
    events = [conn.next_event() for _ in range(3)]
    final = events[-1]
    assert isinstance(final, C.MessageReply)
    assert [(o.address, o.reply.code) for o in final.outcomes] == [("b@y.example", 552)]
    assert conn.data_to_send() == b"RSET\r\n"  # the server's transaction may still be open
    conn.receive_data(b"250 2.0.0 ok\r\n")
    assert isinstance(conn.next_event(), C.CommandReply) and conn.idle


def test_the_client_needs_chunking_and_pipelining_for_bdat() -> None:
    conn = C.ClientConnection()
    conn.receive_data(b"220 mx\r\n")
    conn.ehlo("c.example")
    conn.data_to_send()
    conn.receive_data(b"250-mx\r\n250 CHUNKING\r\n")
    conn.next_event()
    conn.next_event()
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    with pytest.raises(LocalProtocolError):
        conn.bdat()
