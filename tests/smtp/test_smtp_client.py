"""The SMTP client core: scripted server replies, then against the server core over trio."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from relay_support import CountingStream, relay_config

from mta.smtp import client as C
from mta.smtp import server as S
from mta.smtp.common import (
    DEFAULT_MAX_MESSAGE_SIZE,
    R_DATA_NUL,
    ContentDecoder,
    LocalProtocolError,
    RemoteProtocolError,
    Reply,
    ReplyParser,
)

EHLO_PIPELINING = b"250-mx.test\r\n250-PIPELINING\r\n250-SIZE 1000\r\n250-8BITMIME\r\n250 STARTTLS\r\n"


def events(conn: C.ClientConnection, data: bytes = b"") -> list[C.Event]:
    if data:
        conn.receive_data(data)
    out: list[C.Event] = []
    while not isinstance(ev := conn.next_event(), C.NeedData):
        out.append(ev)
        if isinstance(ev, C.ConnectionClosed):
            break
    return out


def after_ehlo(ehlo_reply: bytes = EHLO_PIPELINING) -> C.ClientConnection:
    conn = C.ClientConnection()
    assert events(conn, b"220 mx.test ESMTP\r\n") == [C.Greeting(Reply(220, None, "mx.test ESMTP"))]
    conn.ehlo("client.test")
    assert conn.data_to_send() == b"EHLO client.test\r\n"
    (ev,) = events(conn, ehlo_reply)
    assert isinstance(ev, C.EhloReply)
    return conn


def test_ehlo_capabilities_are_parsed() -> None:
    conn = after_ehlo()
    caps = conn.capabilities
    assert caps is not None
    assert (caps.pipelining, caps.size, caps.eightbitmime, caps.starttls) == (True, 1000, True, True)
    assert not caps.smtputf8


def test_nothing_is_sent_before_the_greeting() -> None:
    conn = C.ClientConnection()
    conn.ehlo("c")
    assert conn.data_to_send() == b""
    events(conn, b"220 hi\r\n")
    assert conn.data_to_send() == b"EHLO c\r\n"


def test_with_pipelining_mail_rcpts_and_data_leave_in_one_write() -> None:
    conn = after_ehlo()
    conn.mail("a@x.example", {"BODY": "8BITMIME"})
    conn.rcpt("b@y.example")
    conn.rcpt("c@y.example")
    conn.data()
    conn.quit()
    assert conn.data_to_send() == (
        b"MAIL FROM:<a@x.example> BODY=8BITMIME\r\nRCPT TO:<b@y.example>\r\nRCPT TO:<c@y.example>\r\nDATA\r\n"
    )
    evs = events(conn, b"250 2.1.0 Ok\r\n250 2.1.5 Ok\r\n550 5.1.1 No such user\r\n354 go\r\n")
    assert evs[-1] == C.DataReply(Reply(354, None, "go"), go_ahead=True)
    assert evs[2] == C.RcptReply("c@y.example", Reply(550, "5.1.1", "No such user"))
    conn.send_body(b"Subject: x\n\n.hidden\n")
    conn.end_data()
    assert conn.data_to_send() == b"Subject: x\r\n\r\n..hidden\r\n.\r\n"  # QUIT waits for the reply
    (result,) = events(conn, b"250 2.0.0 queued\r\n")
    assert result == C.MessageReply(
        Reply(250, "2.0.0", "queued"),
        (
            C.RecipientOutcome("b@y.example", Reply(250, "2.0.0", "queued")),
            C.RecipientOutcome("c@y.example", Reply(550, "5.1.1", "No such user")),
        ),
    )
    assert conn.data_to_send() == b"QUIT\r\n"


def test_without_pipelining_one_command_per_reply() -> None:
    conn = after_ehlo(b"250 mx.test\r\n")
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    conn.data()
    assert conn.data_to_send() == b"MAIL FROM:<a@x.example>\r\n"
    events(conn, b"250 ok\r\n")
    assert conn.data_to_send() == b"RCPT TO:<b@y.example>\r\n"
    events(conn, b"250 ok\r\n")
    assert conn.data_to_send() == b"DATA\r\n"
    assert conn.waiting == 1


def test_failed_mail_fails_every_recipient_with_the_mail_reply() -> None:
    conn = after_ehlo()
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    conn.data()
    conn.data_to_send()
    evs = events(conn, b"451 4.3.0 try later\r\n503 5.5.1 need MAIL\r\n503 5.5.1 need RCPT\r\n")
    assert evs[-2] == C.DataReply(Reply(503, "5.5.1", "need RCPT"), go_ahead=False)
    assert evs[-1] == C.MessageReply(
        Reply(503, "5.5.1", "need RCPT"), (C.RecipientOutcome("b@y.example", Reply(451, "4.3.0", "try later")),)
    )


def test_a_refused_data_is_followed_by_rset_so_the_next_mail_on_the_connection_is_not_out_of_sequence() -> None:
    conn = after_ehlo()
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    conn.data()
    conn.data_to_send()
    evs = events(conn, b"250 ok\r\n451 4.3.0 later\r\n554 5.5.1 no valid recipients\r\n")
    assert isinstance(evs[-1], C.MessageReply) and evs[-1].outcomes[0].reply.code == 451
    conn.mail("c@x.example")
    conn.rcpt("d@y.example")
    conn.data()
    assert conn.data_to_send() == b"RSET\r\nMAIL FROM:<c@x.example>\r\nRCPT TO:<d@y.example>\r\nDATA\r\n"
    evs = events(conn, b"250 2.0.0 reset\r\n250 ok\r\n250 ok\r\n354 go\r\n")
    assert evs[0] == C.CommandReply("RSET", Reply(250, "2.0.0", "reset"))
    assert evs[-1] == C.DataReply(Reply(354, None, "go"), go_ahead=True)


def test_354_after_all_recipients_failed_sends_an_empty_message() -> None:
    conn = after_ehlo()
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    conn.data()
    conn.data_to_send()
    evs = events(conn, b"250 ok\r\n550 no\r\n354 go\r\n")
    assert evs[-1] == C.DataReply(Reply(354, None, "go"), go_ahead=False)
    assert conn.data_to_send() == b".\r\n"
    with pytest.raises(LocalProtocolError):
        conn.send_body(b"x")
    (result,) = events(conn, b"554 5.5.1 no valid recipients\r\n")
    assert isinstance(result, C.MessageReply) and not result.outcomes[0].delivered


@pytest.mark.parametrize(
    "misuse",
    [
        lambda c: c.send_body(b"x"),
        lambda c: c.end_data(),
        lambda c: c.rcpt("b@y.example"),
        lambda c: c.data(),
        lambda c: c.mail("a@x.example\r\nRCPT TO:<evil@x.example>"),
        lambda c: c.mail("jörg@x.example"),
        lambda c: c.mail("a@x.example", {"SMTPUTF8": None}),
        lambda c: c.noop() or c.mail("a@x.example", {"SIZE": "1" * 600}),
    ],
)
def test_misuse_raises_local_protocol_error(misuse: object) -> None:
    conn = after_ehlo()
    with pytest.raises(LocalProtocolError):
        misuse(conn)  # type: ignore[operator]


def test_starttls_needs_the_offer_and_tls_started_forgets_capabilities() -> None:
    plain = after_ehlo(b"250 mx.test\r\n")
    with pytest.raises(LocalProtocolError):
        plain.starttls()
    conn = after_ehlo()
    conn.starttls()
    assert conn.data_to_send() == b"STARTTLS\r\n"
    assert events(conn, b"220 2.0.0 Ready\r\n") == [C.CommandReply("STARTTLS", Reply(220, "2.0.0", "Ready"))]
    conn.tls_started()
    assert conn.capabilities is None and conn.tls_active


def test_unsolicited_421_is_reported_and_other_replies_are_errors() -> None:
    conn = after_ehlo()
    assert events(conn, b"421 4.3.2 shutting down\r\n") == [C.Closing(Reply(421, "4.3.2", "shutting down"))]
    with pytest.raises(RemoteProtocolError):
        conn.receive_data(b"250 surprise\r\n")


def test_eof_is_reported_as_connection_closed() -> None:
    conn = after_ehlo()
    conn.receive_data(b"")
    assert events(conn) == [C.ConnectionClosed()]


@pytest.mark.parametrize(
    ("chunks", "wire"),
    [
        ([b"a\nb"], b"a\r\nb\r\n.\r\n"),
        ([b"a\r", b"\nb\r\n"], b"a\r\nb\r\n.\r\n"),
        ([b"x\r"], b"x\r\n.\r\n"),
        ([b".", b".\r\n.\r\n"], b"...\r\n..\r\n.\r\n"),
        ([b"a\r\n", b".b\r\n"], b"a\r\n..b\r\n.\r\n"),
        ([b"\r.\r"], b"\r\n..\r\n.\r\n"),
        ([], b".\r\n"),
    ],
)
def test_body_encoder(chunks: list[bytes], wire: bytes) -> None:
    enc = C.BodyEncoder()
    assert b"".join(enc.encode(c) for c in chunks) + enc.end() == wire


@settings(deadline=None)  # timing varies on a shared machine; correctness is what is checked
@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"x", b".").replace(b"y", b"\r")), max_size=8))
def test_encoded_body_always_decodes_to_its_crlf_normalised_self(chunks: list[bytes]) -> None:
    enc = C.BodyEncoder()
    wire = b"".join(enc.encode(c) for c in chunks) + enc.end()
    dec = ContentDecoder(DEFAULT_MAX_MESSAGE_SIZE, 10**9, normalize=False)
    pos, content, done = dec.decode(bytearray(wire), 0, len(wire) + 10)
    assert done and pos == len(wire)
    if b"\x00" in b"".join(chunks):  # never legal in content: refused, but the end is still found
        assert dec.refusal == R_DATA_NUL
        return
    assert dec.refusal is None
    body = b"".join(chunks).replace(b"\r\n", b"\n").replace(b"\r", b"\n").replace(b"\n", b"\r\n")
    if body and not body.endswith(b"\r\n"):
        body += b"\r\n"
    assert content == body


# ---------------------------------------------------------------- client core against server core


async def run_server(stream: trio.abc.Stream, inbox: list[tuple[str, list[str], bytes]], chunking: bool = False
                     ) -> None:
    conn = S.ServerConnection("mx.test", max_recipients=2, chunking=chunking)
    body = bytearray()
    rcpts: list[str] = []
    while True:
        ev = conn.next_event()
        if isinstance(ev, S.NeedData):
            await stream.send_all(conn.data_to_send())
            conn.receive_data(await stream.receive_some(1000))
        elif isinstance(ev, S.ConnectionClosed):
            await stream.send_all(conn.data_to_send())
            await stream.aclose()
            return
        elif isinstance(ev, S.MailFrom):
            conn.accept()
        elif isinstance(ev, S.RcptTo):
            if ev.address.startswith("nobody"):
                conn.reject(Reply(550, "5.1.1", "No such user"))
            else:
                rcpts.append(ev.address)
                conn.accept()
        elif isinstance(ev, S.DataChunk):
            body += ev.data
        elif isinstance(ev, S.EndOfData):
            inbox.append(("", rcpts, bytes(body)))
            conn.accept()


async def run_client(stream: trio.abc.Stream, message: bytes) -> list[C.Event]:
    conn = C.ClientConnection()
    seen: list[C.Event] = []
    while True:
        ev = conn.next_event()
        if isinstance(ev, C.NeedData):
            if out := conn.data_to_send():
                await stream.send_all(out)
            conn.receive_data(await stream.receive_some(1000))
            continue
        seen.append(ev)
        if isinstance(ev, C.Greeting):
            conn.ehlo("client.test")
        elif isinstance(ev, C.EhloReply):
            conn.mail("a@x.example")
            for r in ("b@y.example", "nobody@y.example", "c@y.example", "d@y.example"):
                conn.rcpt(r)
            conn.data()
        elif isinstance(ev, C.DataReply) and ev.go_ahead:
            for i in range(0, len(message), 7):
                conn.send_body(message[i : i + 7])
            conn.end_data()
        elif isinstance(ev, C.MessageReply):
            conn.quit()
        elif isinstance(ev, C.ConnectionClosed):
            return seen


async def test_client_core_against_server_core_over_a_memory_stream() -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    inbox: list[tuple[str, list[str], bytes]] = []
    message = b"Subject: hello\n\n.starts with a dot\r\n.\r\nlast line without newline"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_server, server_stream, inbox)
        seen = await run_client(client_stream, message)
    assert inbox == [
        ("", ["b@y.example", "c@y.example"], message.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n") + b"\r\n")
    ]
    result = next(e for e in seen if isinstance(e, C.MessageReply))
    assert [(o.address, o.reply.code, o.reply.enhanced) for o in result.outcomes] == [
        ("b@y.example", 250, "2.0.0"),
        ("nobody@y.example", 550, "5.1.1"),
        ("c@y.example", 250, "2.0.0"),
        ("d@y.example", 452, "4.5.3"),
    ]
    assert C.CommandReply("QUIT", Reply(221, "2.0.0", "Bye")) in seen


# ---------------------------------------------------------------- the trio shell's writes


class Rereadable:
    """A body that can only be iterated (as the spool's lazily read bodies are), twice if need be."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.chunks))


async def test_transport_pipelines_the_envelope_and_sends_the_body_with_its_dot_in_one_write(tmp_path: Path) -> None:
    from mta.delivery.smtp_transport import _Session
    from mta.delivery.tlspolicy.plan import base_tls
    from mta.delivery.transport import Job

    config = relay_config(str(tmp_path), {"*": "smtp://127.0.0.1:25"})
    client_stream, server_stream = trio.testing.memory_stream_pair()
    counting = CountingStream(client_stream)
    inbox: list[tuple[str, list[str], bytes]] = []
    chunks = [b"Subject: x\r\n\r\n"] + [b"line %d\r\n" % i for i in range(300)] + [b".dot\r\n"]
    job = Job("Q1", "a@x.example", ("b@y.example", "c@y.example"), Rereadable(chunks), sum(map(len, chunks)))

    async def server() -> None:
        with contextlib.suppress(trio.BrokenResourceError):  # close() does not wait for the 221
            await run_server(server_stream, inbox)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        session = _Session(counting, "mx.test", config)
        await session.open(base_tls("none", "mx.test"))
        counting.writes.clear()
        outcomes = await session.send(job, "mx.test")
        writes = list(counting.writes)
        await session.close()
    assert [o.code for o in outcomes] == [250, 250]
    assert inbox == [("", ["b@y.example", "c@y.example"], b"".join(chunks))]
    envelope = b"MAIL FROM:<a@x.example> SIZE=%d\r\nRCPT TO:<b@y.example>\r\nRCPT TO:<c@y.example>\r\nDATA\r\n"
    assert writes[0] == envelope % job.size
    assert len(writes) == 2 and writes[1].endswith(b"\r\n..dot\r\n.\r\n")


async def test_transport_sends_the_stored_body_in_bdat_to_a_hop_that_offers_chunking(tmp_path: Path) -> None:
    """RFC 3030: envelope and body in one write, no 354 awaited, the body as it is (its dot line unstuffed)."""
    from mta.delivery.smtp_transport import _Session
    from mta.delivery.tlspolicy.plan import base_tls
    from mta.delivery.transport import Job

    config = relay_config(str(tmp_path), {"*": "smtp://127.0.0.1:25"})
    client_stream, server_stream = trio.testing.memory_stream_pair()
    counting = CountingStream(client_stream)
    inbox: list[tuple[str, list[str], bytes]] = []
    chunks = [b"Subject: x\r\n\r\n"] + [b"line %d\r\n" % i for i in range(300)] + [b".dot\r\n"]
    body = b"".join(chunks)
    job = Job("Q1", "a@x.example", ("b@y.example", "nobody@y.example"), Rereadable(chunks), len(body))

    async def server() -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await run_server(server_stream, inbox, chunking=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        session = _Session(counting, "mx.test", config)
        await session.open(base_tls("none", "mx.test"))
        counting.writes.clear()
        outcomes = await session.send(job, "mx.test")
        writes = list(counting.writes)
        await session.close()
    assert [o.code for o in outcomes] == [250, 550]
    assert inbox == [("", ["b@y.example"], body)]
    envelope = b"MAIL FROM:<a@x.example> SIZE=%d\r\nRCPT TO:<b@y.example>\r\nRCPT TO:<nobody@y.example>\r\n"
    assert writes == [envelope % job.size + b"BDAT %d LAST\r\n" % len(body) + body]


def test_control_characters_in_a_next_hops_reply_are_escaped_not_raised() -> None:
    """A hostile next hop cannot make the client core raise (Reply refuses control characters)."""
    (reply,) = ReplyParser().feed(b"550-5.1.1 no\x00such\r\n550 5.1.1 user\x1b[2J\x7f\r\n")
    assert (reply.code, reply.enhanced) == (550, "5.1.1")
    assert reply.text == "no\\x00such\nuser\\x1b[2J\\x7f"
