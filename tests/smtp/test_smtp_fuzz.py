"""Property tests: the SMTP cores survive any bytes and do not care how they are chunked."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from mta.smtp import client as C
from mta.smtp import server as S
from mta.smtp.common import (
    R_DATA_BARE_NEWLINE,
    R_DATA_LONG_LINE,
    R_DATA_NUL,
    R_TOO_BIG,
    ContentDecoder,
    RemoteProtocolError,
    Reply,
    ReplyParser,
    SmtpProtocolError,
)

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


ARG_TEMPLATES = [
    (b"EHLO ", b"c.example"), (b"HELO ", b"c.example"), (b"MAIL FROM:", b"<a@x.example> SIZE=10 BODY=8BITMIME"),
    (b"MAIL FROM:", b"<> SMTPUTF8"), (b"RCPT TO:", b"<b@y.example>"), (b"RCPT TO:", b"<postmaster>"),
    (b"RCPT TO:", b"<b@y.example> NOTIFY=NEVER"), (b"VRFY ", b"b"), (b"NOOP ", b"x"), (b"HELP ", b"MAIL"),
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ARG_TEMPLATES), st.integers(0, 255).filter(lambda v: v not in (10, 13)),
                          st.integers(0, 64), st.binary(max_size=3).map(lambda b: b.translate(None, b"\r\n"))),
                max_size=20))
def test_any_byte_in_any_argument_is_answered_and_never_echoed_raw(
        edits: list[tuple[tuple[bytes, bytes], int, int, bytes]]) -> None:
    """A NUL in MAIL FROM once made the core raise while it echoed the address. (CR and LF: line tests.)"""
    wire = b"EHLO c.example\r\n"
    for (prefix, arg), value, at, extra in edits:
        k = at % (len(arg) + 1)
        wire += prefix + arg[:k] + bytes([value]) + extra + arg[k:] + b"\r\n"
    _events, out = drive([wire], {"max_errors": 1000})
    assert all(0x20 <= b <= 0x7E for b in out.replace(b"\r\n", b"")), out
    replies = ReplyParser().feed(out)
    assert len(replies) == 2 + len(edits)  # greeting, EHLO, one reply per line: nothing raised, nothing skipped


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
    assert (dec.refusal is not None) == ((bare and not normalize) or b"\x00" in message)
    if not bare and b"\x00" not in message:
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


# ---------------------------------------------------------------- the bulk DATA decoder against the per-line one


class LineByLineDecoder:
    """The content decoder as it was before the bulk path: one line piece per Python step.

    Kept as the model for the differential test below: the bulk decoder must
    agree with it on every input, limit and chunking.
    """

    def __init__(self, max_size: int, max_line: int, normalize: bool) -> None:
        self.max_size, self.max_line, self.normalize = max_size, max_line, normalize
        self.size = 0
        self.refusal: Reply | None = None
        self._line_start = self._real_line_start = True
        self._line_len = 0
        self._out = bytearray()

    def decode(self, buf: bytearray, pos: int, limit: int) -> tuple[int, bytes, bool]:
        done = False
        while len(self._out) < limit:
            pos, step = self._step(buf, pos, limit - len(self._out))
            if step is None:
                break
            if step:
                done = True
                break
        out = bytes(self._out)
        self._out.clear()
        return pos, out, done

    def _content(self, data: bytes | bytearray) -> None:
        for byte in data:  # one byte at a time: the first refusal in stream order wins; a byte over the
            self.size += 1  # size limit is over-size, whatever it holds
            if self.size > self.max_size and self.refusal is None:
                self.refusal = R_TOO_BIG
            if self.refusal is None and byte == 0:
                self.refusal = R_DATA_NUL
            if self.refusal is None:
                self._out.append(byte)

    def _line_end(self, real: bool) -> None:
        if self._line_len + 2 > self.max_line and self.refusal is None:
            self.refusal = R_DATA_LONG_LINE
        self._content(b"\r\n")
        self._line_len = 0
        self._line_start = True
        self._real_line_start = real

    def _step(self, buf: bytearray, pos: int, room: int) -> tuple[int, bool | None]:
        n = len(buf)
        end = min(n, pos + max(room, 1))
        if pos >= n:
            return pos, None
        if self._line_start:
            if self._real_line_start and buf[pos] == 0x2E:
                head = bytes(buf[pos : pos + 3])
                if head == b".\r\n":
                    return pos + 3, True
                if len(head) < 3 and b".\r\n".startswith(head):
                    return pos, None
                pos += 1
            self._line_start = False
            if pos >= n:
                return pos, False
        cr = buf.find(b"\r", pos, end)
        lf = buf.find(b"\n", pos, end)
        i = min(x for x in (cr, lf, end) if x >= 0)
        if i > pos:
            self._line_len += i - pos
            self._content(buf[pos:i])
        if i == end:
            return i, False
        if buf[i] == 0x0D:
            if i + 1 == n:
                return i, None
            if buf[i + 1] == 0x0A:
                self._line_end(real=True)
                return i + 2, False
        if not self.normalize and self.refusal is None:
            self.refusal = R_DATA_BARE_NEWLINE
        self._line_end(real=False)
        return i + 1, False


def feed_decoder(dec: ContentDecoder | LineByLineDecoder, chunks: list[bytes], limit: int) -> tuple[object, ...]:
    """Drive a decoder the way the server core does: one buffer, consumed prefix dropped before each read.

    Returns what the shell can observe: where the message ended (input
    offset), the refusal, and the content and size when there is no refusal.
    """
    buf, pos, consumed, out = bytearray(), 0, 0, bytearray()
    for chunk in chunks:
        del buf[:pos]
        consumed, pos = consumed + pos, 0
        buf += chunk
        for _ in range(len(buf) + 2):
            pos, data, done = dec.decode(buf, pos, limit)
            assert len(data) <= limit + 1
            out += data
            if done or not data:
                break
        else:
            raise AssertionError("the decoder kept returning content without consuming input")
        if done:
            break
    else:
        done = False
    ok = dec.refusal is None
    return (done, consumed + pos if done else None, dec.refusal, bytes(out) if ok else None, dec.size if ok else None)


content_pieces = st.sampled_from(
    [b"\r\n", b".", b"..", b"\x00", b"\r\n\x00.\r\n", b"\r", b"\n", b"\r\n.\r\n", b"\r\n..\r\n", b"\n.\r\n",
     b"x" * 37, b"y" * 99, b"z"]
)
content_streams = st.lists(st.one_of(content_pieces, st.binary(max_size=12)), max_size=40).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(
    content_streams,
    st.booleans(),
    st.sampled_from([1, 2, 3, 40, 101, 1000]),
    st.sampled_from([0, 1, 30, 120, 10**6]),
    st.sampled_from([1, 2, 7, 64, 65536]),
    st.lists(st.integers(min_value=0), max_size=8),
)
def test_bulk_decoder_agrees_with_the_line_by_line_decoder(
    wire: bytes, normalize: bool, max_line: int, max_size: int, limit: int, cuts: list[int]
) -> None:
    for chunks in ([wire], [wire[i : i + 1] for i in range(len(wire))], split(wire, cuts)):
        got = feed_decoder(ContentDecoder(max_size, max_line, normalize), chunks, limit)
        want = feed_decoder(LineByLineDecoder(max_size, max_line, normalize), chunks, limit)
        assert got == want


def test_bulk_decoder_handles_a_long_clean_message_in_one_slice() -> None:
    body = b"".join(b"%s line %d\r\n" % (b"." if i % 7 == 0 else b"", i) for i in range(5000))
    wire = b"." + body.replace(b"\r\n.", b"\r\n..") + b".\r\nQUIT\r\n"  # line 0 starts with a dot too
    dec = ContentDecoder(10**7, 1000, False)
    pos, content, done = dec.decode(bytearray(wire), 0, 10**7)
    assert done and wire[pos:] == b"QUIT\r\n"
    assert content == body and dec.size == len(body) and dec.refusal is None


# Long dot-heavy content (more line-start dots than ``bodybytes`` loops over before its ``replace``), with
# a bare CR or LF, a NUL or a long line now and then, cut anywhere: inside a CRLF, inside CRLF.CRLF.
dotty_lines = st.lists(
    st.one_of(st.sampled_from([b".", b"..", b".x", b"x", b"", b".\x00", b"\r", b"\n", b"x\ry", b"a\nb"]),
              st.binary(max_size=3).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
              st.integers(min_value=60, max_value=130).map(lambda n: b"." + b"y" * n)),
    min_size=30, max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(dotty_lines, st.booleans(), st.sampled_from([100, 1000]), st.sampled_from([500, 3000, 10**6]),
       st.sampled_from([7, 300, 65536]), st.lists(st.integers(min_value=0), max_size=12),
       st.sampled_from([b"", b"QUIT\r\n", b".\r\n"]))
def test_bulk_decoder_agrees_on_long_dotted_content_cut_anywhere(
    lines: list[bytes], normalize: bool, max_line: int, max_size: int, limit: int, cuts: list[int], after: bytes
) -> None:
    wire = b"\r\n".join(lines) + b"\r\n.\r\n" + after
    for chunks in ([wire], split(wire, cuts), split(wire, [c + 1 for c in cuts])):
        got = feed_decoder(ContentDecoder(max_size, max_line, normalize), chunks, limit)
        want = feed_decoder(LineByLineDecoder(max_size, max_line, normalize), chunks, limit)
        assert got == want


class OldBodyEncoder:
    """The client's body encoder as it was before ``bodybytes`` (counts and replaces): the model the
    encoder must agree with byte for byte."""

    def __init__(self) -> None:
        self._line_start = True
        self._pending_cr = False

    def encode(self, chunk: bytes) -> bytes:
        data = b"\r" + chunk if self._pending_cr else chunk
        self._pending_cr = data.endswith(b"\r")
        if self._pending_cr:
            data = data[:-1]
        if not data:
            return b""
        data = re.sub(rb"\r\n|\r|\n", b"\r\n", data)
        out = data.replace(b"\r\n.", b"\r\n..")
        if self._line_start and out.startswith(b"."):
            out = b"." + out
        self._line_start = out.endswith(b"\r\n")
        return out

    def end(self) -> bytes:
        if self._pending_cr:
            self._pending_cr = False
            return b"\r\n.\r\n"
        return b".\r\n" if self._line_start else b"\r\n.\r\n"


@settings(max_examples=200, deadline=None)
@given(dotty_lines, st.sampled_from([b"\r\n", b"\n", b"\r"]), st.lists(st.integers(min_value=0), max_size=12))
def test_body_encoder_agrees_with_the_old_one_in_any_chunking(
    lines: list[bytes], sep: bytes, cuts: list[int]
) -> None:
    body = sep.join(lines)
    for chunks in ([body], split(body, cuts), [body[i : i + 1] for i in range(min(len(body), 300))]):
        new, old = C.BodyEncoder(), OldBodyEncoder()
        assert b"".join(map(new.encode, chunks)) + new.end() == b"".join(map(old.encode, chunks)) + old.end()
