"""Property tests: the SMTP cores survive any bytes and do not care how they are chunked."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from mta import smtp_client as C
from mta import smtp_server as S
from mta.smtp_common import ContentDecoder, RemoteProtocolError, Reply, ReplyParser, SmtpProtocolError

PIECES = [
    b"EHLO c.example\r\n",
    b"HELO c.example\r\n",
    b"MAIL FROM:<a@x.example>\r\n",
    b"MAIL FROM:<> SIZE=100 BODY=8BITMIME\r\n",
    b"RCPT TO:<b@y.example>\r\n",
    b"RCPT TO:<xreject@y.example>\r\n",
    b"DATA\r\n",
    b"RSET\r\n",
    b"NOOP\r\n",
    b"QUIT\r\n",
    b"STARTTLS\r\n",
    b"VRFY b\r\n",
    b"\r\n.\r\n",
    b".\r\n",
    b"..\r\n",
    b"\n.\n",
    b"\r.\r",
    b"\r\n.\n",
    b"\r",
    b"\n",
    b"x" * 600,
    b"y" * 90 + b"\r\n",
]

streams = st.lists(st.one_of(st.sampled_from(PIECES), st.binary(max_size=24)), max_size=30).map(b"".join)
options = st.fixed_dictionaries(
    {
        "normalize_bare_lf": st.booleans(),
        "max_message_size": st.sampled_from([50, 1000, 10_000]),
        "max_line_length": st.sampled_from([40, 1000]),
        "max_recipients": st.sampled_from([1, 3]),
        "max_errors": st.sampled_from([3, 10]),
    }
)


def decide(conn: S.ServerConnection, ev: S.Event) -> None:
    if isinstance(ev, S.RcptTo) and ev.address.startswith("x"):
        conn.reject(Reply(550, "5.1.1", "No such user"))
    elif isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData | S.StartTls):
        conn.accept()


def drive(chunks: list[bytes], opts: dict[str, object]) -> tuple[list[S.Event], bytes]:
    """Feed chunks then EOF, deciding deterministically; return (events, all output)."""
    conn = S.ServerConnection("mx.test", **opts)  # type: ignore[arg-type]
    seen: list[S.Event] = []
    out = bytearray()
    feed = [*chunks, b""]
    while True:
        ev = conn.next_event()
        out += conn.data_to_send()
        if isinstance(ev, S.NeedData):
            assert feed, "the core asked for data after EOF"
            conn.receive_data(feed.pop(0))
            continue
        seen.append(ev)
        if isinstance(ev, S.ConnectionClosed):
            return merge_chunks(seen), bytes(out)
        decide(conn, ev)
        out += conn.data_to_send()


def merge_chunks(events: list[S.Event]) -> list[S.Event]:
    """Chunk boundaries in DATA depend on the reads; their concatenation does not."""
    merged: list[S.Event] = []
    for ev in events:
        if isinstance(ev, S.DataChunk) and merged and isinstance(merged[-1], S.DataChunk):
            merged[-1] = S.DataChunk(merged[-1].data + ev.data)
        else:
            merged.append(ev)
    return merged


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


@settings(max_examples=200, deadline=None)
@given(streams, options, st.lists(st.integers(min_value=0), max_size=10))
def test_any_stream_in_any_chunking_gives_the_same_valid_replies(
    data: bytes, opts: dict[str, object], cuts: list[int]
) -> None:
    whole_events, whole_out = drive([data] if data else [], opts)
    bytewise_events, bytewise_out = drive([data[i : i + 1] for i in range(len(data))], opts)
    split_events, split_out = drive(split(data, cuts), opts)
    assert whole_out == bytewise_out == split_out
    assert whole_events == bytewise_events == split_events
    replies = ReplyParser().feed(whole_out)
    assert replies[0].code == 220
    for reply in replies:
        if reply.code >= 400:
            assert reply.enhanced is not None and reply.enhanced[0] == str(reply.code)[0]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300).map(lambda b: b.replace(b"a", b"\r\n").replace(b"b", b".")), st.booleans())
def test_data_ends_exactly_at_the_first_crlf_dot_crlf(wire: bytes, normalize: bool) -> None:
    dec = ContentDecoder(10**9, 10**9, normalize)
    buf = bytearray(wire)
    pos, content, done = dec.decode(buf, 0, 10**6)
    k = (b"\r\n" + wire).find(b"\r\n.\r\n")
    if k < 0:
        assert not done
        return
    assert done and pos == k + 3
    message = wire[: k + 3]
    bare = re.search(rb"\r(?!\n)|(?<!\r)\n", message) is not None
    assert (dec.refusal is not None) == (bare and not normalize)
    if not bare:
        lines = message[:-3].split(b"\r\n")[:-1] if k > 0 else []
        assert content == b"".join((line[1:] if line.startswith(b".") else line) + b"\r\n" for line in lines)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=30), st.sampled_from([b"250 ok\r\n", b"250-x\r\n", b"421 4.0.0 x\r\n"]))))
def test_client_core_raises_only_protocol_errors_on_any_reply_stream(chunks: list[bytes]) -> None:
    conn = C.ClientConnection()
    conn.ehlo("c")
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    conn.data()
    try:
        for chunk in chunks:
            conn.data_to_send()
            conn.receive_data(chunk)
            while not isinstance(ev := conn.next_event(), C.NeedData | C.ConnectionClosed):
                pass
            if isinstance(ev, C.ConnectionClosed):
                return
            if conn.in_data:
                conn.send_body(b"x\r\n")
                conn.end_data()
    except SmtpProtocolError as e:
        assert isinstance(e, RemoteProtocolError)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_reply_parser_whole_and_bytewise_agree(data: bytes) -> None:
    def parse(chunks: list[bytes]) -> list[Reply] | str:
        p = ReplyParser()
        out: list[Reply] = []
        try:
            for c in chunks:
                out += p.feed(c)
        except RemoteProtocolError:
            return "error"
        return out

    whole = parse([data])
    bytewise = parse([data[i : i + 1] for i in range(len(data))])
    assert whole == bytewise
