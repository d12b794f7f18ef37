"""The SMTP server core, fed bytes without sockets; one test behind trio with smtplib."""

from __future__ import annotations

import datetime as dt
import smtplib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from mta.smtp import server as S
from mta.smtp.addresses import parse_mail_from, parse_rcpt_to
from mta.smtp.common import (
    DATA_CHUNK_SIZE,
    LocalProtocolError,
    RemoteProtocolError,
    Reply,
    ReplyParser,
    received_header,
)

Decider = Callable[[S.ServerConnection, S.Event], None]


def accept_all(conn: S.ServerConnection, ev: S.Event) -> None:
    if isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData | S.StartTls):
        conn.accept()


def run(conn: S.ServerConnection, data: bytes, decide: Decider = accept_all) -> list[S.Event]:
    """Feed ``data`` and collect events until the core needs more input or closes."""
    if data:
        conn.receive_data(data)
    events: list[S.Event] = []
    while True:
        ev = conn.next_event()
        if isinstance(ev, S.NeedData):
            return events
        events.append(ev)
        if isinstance(ev, S.ConnectionClosed):
            return events
        decide(conn, ev)


def replies(conn: S.ServerConnection) -> list[Reply]:
    return ReplyParser().feed(conn.data_to_send())


def codes(conn: S.ServerConnection) -> list[tuple[int, str | None]]:
    return [(r.code, r.enhanced) for r in replies(conn)]


def greeted(**kw: object) -> S.ServerConnection:
    conn = S.ServerConnection("mx.test", **kw)  # type: ignore[arg-type]
    run(conn, b"EHLO client.test\r\n")
    conn.data_to_send()
    return conn


def body_of(events: list[S.Event]) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, S.DataChunk))


# ---------------------------------------------------------------- session basics


def test_greeting_and_ehlo_capabilities() -> None:
    conn = S.ServerConnection("mx.test", max_message_size=1234)
    events = run(conn, b"EHLO client.test\r\n")
    assert events == [S.Ehlo("client.test")]
    greeting, ehlo = replies(conn)
    assert greeting.code == 220 and greeting.text.startswith("mx.test")
    assert ehlo.code == 250
    assert ehlo.lines[1:] == ["PIPELINING", "SIZE 1234", "8BITMIME", "SMTPUTF8", "ENHANCEDSTATUSCODES", "DSN",
                              "CHUNKING"]


def test_starttls_is_offered_only_when_available_and_inactive() -> None:
    assert "STARTTLS" in replies(greeted_raw(tls_available=True))[-1].lines
    assert "STARTTLS" not in replies(greeted_raw(tls_available=True, tls_active=True))[-1].lines


def greeted_raw(**kw: object) -> S.ServerConnection:
    conn = S.ServerConnection("mx.test", **kw)  # type: ignore[arg-type]
    run(conn, b"EHLO c\r\n")
    return conn


def test_policy_free_commands_are_answered_by_the_core() -> None:
    conn = greeted()
    events = run(conn, b"NOOP\r\nHELP\r\nVRFY bob\r\nRSET\r\nEXPN list\r\nFOO\r\nQUIT\r\n")
    assert events == [S.Rset(), S.Quit(), S.ConnectionClosed()]
    assert codes(conn) == [
        (250, "2.0.0"),
        (214, "2.0.0"),
        (252, "2.0.0"),
        (250, "2.0.0"),
        (502, "5.5.1"),
        (500, "5.5.1"),
        (221, "2.0.0"),
    ]


def test_helo_has_no_esmtp_and_refuses_parameters() -> None:
    conn = S.ServerConnection("mx.test")
    assert run(conn, b"HELO old.client\r\nMAIL FROM:<a@b.example> SIZE=10\r\n") == [S.Helo("old.client")]
    assert codes(conn)[1:] == [(250, None), (555, "5.5.4")]


def test_pipelined_transaction_is_answered_in_order_and_250_waits_for_accept() -> None:
    conn = greeted()
    conn.receive_data(
        b"MAIL FROM:<a@example.org> BODY=8BITMIME\r\nRCPT TO:<b@example.net>\r\nRCPT TO:<c@example.net>\r\n"
        b"DATA\r\nSubject: hi\r\n\r\nbody\r\n.\r\nQUIT\r\n"
    )
    assert conn.next_event() == S.MailFrom("a@example.org", {"BODY": "8BITMIME"})
    with pytest.raises(LocalProtocolError):
        conn.next_event()  # no further input is read until the shell decides
    conn.accept()
    assert conn.next_event() == S.RcptTo("b@example.net")
    conn.accept()
    assert conn.next_event() == S.RcptTo("c@example.net")
    conn.reject(Reply(550, "5.1.1", "No such user"))
    assert conn.next_event() == S.DataStart()
    assert conn.next_event() == S.DataChunk(b"Subject: hi\r\n\r\nbody\r\n")
    assert conn.next_event() == S.EndOfData(size=21)
    assert codes(conn) == [(250, "2.1.0"), (250, "2.1.5"), (550, "5.1.1"), (354, None)]
    conn.accept(Reply(250, "2.0.0", "Ok: queued as X1"))
    assert conn.next_event() == S.Quit()
    assert [r.text for r in replies(conn)] == ["Ok: queued as X1", "Bye"]


def test_content_that_looks_like_commands_is_never_parsed_as_commands() -> None:
    conn = greeted()
    events = run(conn, b"MAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\nRSET\r\nQUIT\r\n.\r\n")
    assert body_of(events) == b"RSET\r\nQUIT\r\n"
    assert S.Quit() not in events and S.Rset() not in events


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (b"MAIL FROM:<a@x.example>\r\n", (503, "5.5.1")),  # before EHLO
        (b"EHLO c\r\nRCPT TO:<a@x.example>\r\n", (503, "5.5.1")),
        (b"EHLO c\r\nDATA\r\n", (503, "5.5.1")),
        (b"EHLO c\r\nMAIL FROM:<a@x.example>\r\nMAIL FROM:<a@x.example>\r\n", (503, "5.5.1")),
        (b"EHLO c\r\nMAIL FROM:a@x.example\r\n", (501, "5.1.7")),
        (b"EHLO c\r\nMAIL FROM:<a@x.example> FOO=1\r\n", (555, "5.5.4")),
        (b"EHLO c\r\nMAIL FROM:<a@x.example> SIZE=abc\r\n", (501, "5.5.4")),
        (b"EHLO c\r\nMAIL FROM:<a@x.example> SIZE=99999999999\r\n", (552, "5.3.4")),
        (b"EHLO c\r\nMAIL FROM:<a@x.example> BODY=BINARYMIME\r\n", (501, "5.5.4")),
        (b"EHLO c\r\nMAIL FROM:<j\xc3\xb6rg@x.example>\r\n", (553, "5.6.7")),
        (b"EHLO c\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<@@>\r\n", (501, "5.1.3")),
        (b"EHLO\r\n", (501, "5.5.4")),
        (b"EHLO c\r\nRSET now\r\n", (501, "5.5.4")),
        (b"EHLO c\r\nVRFY\r\n", (501, "5.5.4")),
        (b"EHLO c\r\nNOOP\xff\r\n", (500, "5.5.2")),
        (b"EHLO c\r\nSTARTTLS\r\n", (502, "5.5.1")),
    ],
)
def test_errors_get_the_right_code(script: bytes, expected: tuple[int, str]) -> None:
    conn = S.ServerConnection("mx.test")
    run(conn, script)
    assert codes(conn)[-1] == expected


def test_rejected_mail_leaves_no_transaction() -> None:
    conn = greeted()
    run(conn, b"MAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\n", lambda c, e: c.reject(Reply(550, "5.7.1")))
    assert codes(conn) == [(550, "5.7.1"), (503, "5.5.1")]


def test_data_with_only_rejected_recipients_gets_554() -> None:
    conn = greeted()
    events = run(
        conn,
        b"MAIL FROM:<>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n",
        lambda c, e: c.reject(Reply(550, "5.1.1")) if isinstance(e, S.RcptTo) else accept_all(c, e),
    )
    assert events == [S.MailFrom(""), S.RcptTo("b@y.example")]
    assert codes(conn) == [(250, "2.1.0"), (550, "5.1.1"), (554, "5.5.1")]


def test_with_decide_data_the_354_waits_for_the_shell_and_a_refusal_keeps_the_transaction() -> None:
    conn = greeted(decide_data=True)
    refuse = Reply(550, "5.7.1", "refused at data")
    events = run(conn, b"MAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n",
                 lambda c, e: c.reject(refuse) if isinstance(e, S.DataCommand) else accept_all(c, e))
    assert events == [S.MailFrom("a@x.example"), S.RcptTo("b@y.example"), S.DataCommand()]
    assert codes(conn) == [(250, "2.1.0"), (250, "2.1.5"), (550, "5.7.1")]
    assert conn.state is S.State.RCPT  # the recipients stand: DATA may come again
    events = run(conn, b"DATA\r\nhi\r\n.\r\n",
                 lambda c, e: c.accept() if isinstance(e, S.DataCommand) else accept_all(c, e))
    assert events[:2] == [S.DataCommand(), S.DataStart()]
    assert body_of(events) == b"hi\r\n" and isinstance(events[-1], S.EndOfData)
    assert codes(conn) == [(354, None), (250, "2.0.0")]


def test_decision_methods_check_their_arguments() -> None:
    conn = greeted()
    with pytest.raises(LocalProtocolError):
        conn.accept()  # nothing pending
    conn.receive_data(b"MAIL FROM:<a@x.example>\r\n")
    conn.next_event()
    with pytest.raises(LocalProtocolError):
        conn.accept(Reply(550, "5.7.1"))
    with pytest.raises(LocalProtocolError):
        conn.reject(Reply(250, "2.0.0"))
    with pytest.raises(LocalProtocolError):
        conn.tls_started()


# ---------------------------------------------------------------- limits


def test_command_line_limit_is_512_octets_including_crlf() -> None:
    conn = greeted()
    ok = b"NOOP " + b"x" * (512 - 7) + b"\r\n"
    too_long = b"NOOP " + b"x" * (512 - 6) + b"\r\n"
    run(conn, ok + too_long + b"NOOP\r\n")
    assert codes(conn) == [(250, "2.0.0"), (500, "5.5.2"), (250, "2.0.0")]


def test_bare_lf_and_bare_cr_in_commands_are_refused() -> None:
    conn = greeted()
    events = run(conn, b"RSET\nNOOP\rRSET\r\nQUIT\r\n")
    assert events == [S.Quit(), S.ConnectionClosed()]
    assert codes(conn) == [(500, "5.5.2"), (500, "5.5.2"), (221, "2.0.0")]


def test_too_many_errors_close_with_421() -> None:
    conn = greeted(max_errors=3)
    events = run(conn, b"A\r\nB\r\nC\r\nNOOP\r\n")
    assert events == [S.ConnectionClosed()]
    assert codes(conn) == [(500, "5.5.1")] * 3 + [(421, "4.7.0")]


def test_recipient_limit_gives_452_and_is_not_an_error() -> None:
    conn = greeted(max_recipients=2, max_errors=2)
    rcpts = b"".join(b"RCPT TO:<r%d@y.example>\r\n" % i for i in range(5))
    events = run(conn, b"MAIL FROM:<a@x.example>\r\n" + rcpts + b"NOOP\r\n")
    assert [e for e in events if isinstance(e, S.RcptTo)] == [S.RcptTo("r0@y.example"), S.RcptTo("r1@y.example")]
    assert codes(conn)[1:] == [(250, "2.1.5")] * 2 + [(452, "4.5.3")] * 3 + [(250, "2.0.0")]


def start_data(**kw: object) -> S.ServerConnection:
    conn = greeted(**kw)
    run(conn, b"MAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n")
    conn.data_to_send()
    return conn


def test_dot_unstuffing_and_bounded_chunks() -> None:
    conn = start_data()
    line = b".x" + b"y" * 97 + b"\r\n"
    events = run(conn, line * 3000 + b".\r\n")
    chunks = [e.data for e in events if isinstance(e, S.DataChunk)]
    assert len(chunks) > 1 and max(map(len, chunks)) <= DATA_CHUNK_SIZE
    assert b"".join(chunks) == line[1:] * 3000
    assert events[-1] == S.EndOfData(size=len(line[1:]) * 3000)


def test_oversize_message_is_read_to_its_end_then_refused_with_552() -> None:
    conn = start_data(max_message_size=100)
    events = run(conn, b"x" * 60 + b"\r\n" + b"y" * 60 + b"\r\n.\r\nNOOP\r\n")
    assert events[-1] == S.DataAborted(Reply(552, "5.3.4", "Message size exceeds fixed limit"))
    assert codes(conn) == [(552, "5.3.4"), (250, "2.0.0")]


def test_overlong_text_line_refuses_the_message() -> None:
    conn = start_data(max_line_length=20)
    events = run(conn, b"a" * 18 + b"\r\n" + b"b" * 19 + b"\r\n.\r\n")
    assert isinstance(events[-1], S.DataAborted)
    assert codes(conn) == [(550, "5.5.2")]


@pytest.mark.parametrize("bare", [b"\n", b"\r"])
def test_smuggling_bare_newline_dot_never_ends_data(bare: bytes) -> None:
    conn = start_data()
    smuggled = b"hello" + bare + b"." + bare + b"MAIL FROM:<evil@x.example>\r\n"
    events = run(conn, smuggled)
    assert not any(isinstance(e, S.EndOfData | S.DataAborted | S.MailFrom) for e in events)
    events = run(conn, b"\r\n.\r\nNOOP\r\n")
    assert isinstance(events[-1], S.DataAborted)
    assert codes(conn) == [(550, "5.6.11"), (250, "2.0.0")]


def test_crlf_dot_bare_lf_does_not_end_data() -> None:
    conn = start_data()
    events = run(conn, b"a\r\n.\nMAIL FROM:<e@x.example>\r\n")
    assert not any(isinstance(e, S.EndOfData | S.DataAborted) for e in events)
    assert codes(conn) == []


def test_normalize_bare_lf_turns_it_into_crlf_but_keeps_the_terminator_strict() -> None:
    conn = start_data(normalize_bare_lf=True)
    events = run(conn, b"one\ntwo\r\n.\n.\rthree\r\n.\r\n")
    assert body_of(events) == b"one\r\ntwo\r\n\r\n.\r\nthree\r\n"
    assert events[-1] == S.EndOfData(size=len(b"one\r\ntwo\r\n\r\n.\r\nthree\r\n"))


def test_eof_in_the_middle_of_data_aborts_the_message() -> None:
    conn = start_data()
    events = run(conn, b"partial\r\n")
    conn.receive_data(b"")
    events += run(conn, b"")
    assert events == [S.DataChunk(b"partial\r\n"), S.DataAborted(None), S.ConnectionClosed()]


def test_eof_after_pipelined_quit_still_answers_it() -> None:
    conn = greeted()
    conn.receive_data(b"NOOP\r\nQUIT\r\n")
    conn.receive_data(b"")
    assert run(conn, b"") == [S.Quit(), S.ConnectionClosed()]
    assert codes(conn) == [(250, "2.0.0"), (221, "2.0.0")]


def test_smtputf8_allows_utf8_addresses() -> None:
    conn = greeted()
    events = run(conn, "MAIL FROM:<jörg@exämple.de> SMTPUTF8\r\nRCPT TO:<ü@ß.example>\r\n".encode())
    assert events == [S.MailFrom("jörg@exämple.de", {"SMTPUTF8": None}), S.RcptTo("ü@ß.example")]


# ---------------------------------------------------------------- STARTTLS


def test_starttls_discards_pipelined_plaintext_and_resets_the_session() -> None:
    conn = greeted(tls_available=True)
    conn.receive_data(b"STARTTLS\r\nMAIL FROM:<injected@x.example>\r\n")
    assert conn.next_event() == S.StartTls()
    conn.accept()
    assert codes(conn) == [(220, "2.0.0")]
    with pytest.raises(LocalProtocolError):
        conn.next_event()
    conn.receive_data(b"RCPT TO:<also-plaintext@x.example>\r\n")
    conn.tls_started()
    events = run(conn, b"MAIL FROM:<a@x.example>\r\nEHLO again\r\nSTARTTLS\r\n")
    assert events == [S.Ehlo("again")]
    out = replies(conn)
    assert [(r.code, r.enhanced) for r in out] == [(503, "5.5.1"), (250, None), (503, "5.5.1")]
    assert "STARTTLS" not in out[1].lines


def test_rejected_starttls_keeps_the_session() -> None:
    conn = greeted(tls_available=True)
    run(conn, b"STARTTLS\r\nNOOP\r\n", lambda c, e: c.reject(Reply(454, "4.7.0", "TLS not available now")))
    assert codes(conn) == [(454, "4.7.0"), (250, "2.0.0")]


# ---------------------------------------------------------------- smtp_common


def test_reply_multiline_format_and_parse_round_trip() -> None:
    reply = Reply(550, "5.7.1", "first\nsecond")
    assert reply.to_bytes() == b"550-5.7.1 first\r\n550 5.7.1 second\r\n"
    assert ReplyParser().feed(reply.to_bytes()[:7]) == []
    p = ReplyParser()
    got = [r for b in reply.to_bytes() for r in p.feed(bytes([b]))]
    assert got == [reply]


@pytest.mark.parametrize("bad", [(199, None, ""), (250, "5.0.0", ""), (250, "2.0", ""), (250, None, "a\rb")])
def test_reply_validates(bad: tuple[int, str | None, str]) -> None:
    with pytest.raises(ValueError):
        Reply(*bad)


@pytest.mark.parametrize("raw", [b"abc\r\n", b"250-x\r\n251 y\r\n", b"600 x\r\n", b"2500 x\r\n"])
def test_reply_parser_rejects_garbage(raw: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        ReplyParser().feed(raw)


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("FROM:<>", ("", {})),
        ("from: <a@b.example>", ("a@b.example", {})),
        ("FROM:<@r1.example,@r2.example:a@b.example>", ("a@b.example", {})),
        ('FROM:<"a b>c"@b.example> size=5 SMTPUTF8', ('"a b>c"@b.example', {"SIZE": "5", "SMTPUTF8": None})),
        ("FROM:<a@[192.0.2.1]>", ("a@[192.0.2.1]", {})),
    ],
)
def test_parse_mail_from(arg: str, expected: tuple[str, dict[str, str | None]]) -> None:
    assert parse_mail_from(arg) == expected


@pytest.mark.parametrize(
    "arg", ["TO:<>", "TO:<a@>", "TO:<a..b@c.example>", "TO:<a@b.example>x", "TO:<a@-b.example>", "<a@b.example>"]
)
def test_parse_rcpt_to_rejects(arg: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_rcpt_to(arg)
    assert info.value.reply.code == 501


def test_postmaster_without_domain_is_a_valid_recipient() -> None:
    assert parse_rcpt_to("TO:<Postmaster>") == ("Postmaster", {})


def test_received_header_cannot_be_used_to_inject_headers() -> None:
    header = received_header(
        helo="evil\r\nX-Injected: 1",
        client_ip="192.0.2.7",
        by="mx.test",
        protocol="ESMTPS",
        queue_id="Q1",
        recipient="b@y.example",
        when=dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    )
    assert header.count(b"\r\n") == 4 and b"\r\nX-Injected" not in header
    assert header.startswith(b"Received: from evil??X-Injected: 1 (unknown [192.0.2.7])\r\n")
    assert b"\r\n\tby mx.test with ESMTPS id Q1\r\n" in header
    assert header.endswith(b"\tfor <b@y.example>;\r\n\tTue, 02 Jan 2024 03:04:05 +0000\r\n")


# ---------------------------------------------------------------- a real client


async def serve_one(stream: trio.SocketStream, inbox: list[tuple[str, list[str], bytes]]) -> None:
    """The thinnest possible shell: accept everything, keep messages in a list."""
    conn = S.ServerConnection("mx.test")
    sender, rcpts, body = "", list[str](), bytearray()
    while True:
        ev = conn.next_event()
        if isinstance(ev, S.NeedData):
            await stream.send_all(conn.data_to_send())
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(ev, S.ConnectionClosed):
            await stream.send_all(conn.data_to_send())
            await stream.aclose()
            return
        elif isinstance(ev, S.MailFrom):
            sender, rcpts, body = ev.address, [], bytearray()
            conn.accept()
        elif isinstance(ev, S.RcptTo):
            rcpts.append(ev.address)
            conn.accept()
        elif isinstance(ev, S.DataChunk):
            body += ev.data
        elif isinstance(ev, S.EndOfData):
            inbox.append((sender, rcpts, bytes(body)))
            conn.accept(Reply(250, "2.0.0", f"Ok: queued as {len(inbox)}"))


async def test_smtplib_against_the_core_behind_a_trio_shell() -> None:
    inbox: list[tuple[str, list[str], bytes]] = []
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, host="127.0.0.1"), partial(serve_one, inbox=inbox), 0)
        port = listeners[0].socket.getsockname()[1]

        def client() -> tuple[dict[str, tuple[int, bytes]], int]:
            with smtplib.SMTP("127.0.0.1", port) as smtp:
                smtp.ehlo("client.test")
                assert smtp.has_extn("pipelining") and smtp.has_extn("smtputf8")
                refused = smtp.sendmail("a@x.example", ["b@y.example", "c@y.example"], b"Subject: t\r\n\r\n.dot\r\n")
                code, _ = smtp.noop()
                return refused, code

        refused, code = await trio.to_thread.run_sync(client)
        nursery.cancel_scope.cancel()
    assert refused == {} and code == 250
    assert inbox == [("a@x.example", ["b@y.example", "c@y.example"], b"Subject: t\r\n\r\n.dot\r\n")]


# ---------------------------------------------------------------- the trio shell's writes


async def test_shell_answers_a_pipelined_group_in_one_write_and_never_holds_a_reply(tmp_path: Path) -> None:
    from relay_support import CountingStream, relay_config, start_relay

    from mta.inbound.server import SmtpServer
    from mta.inbound.session import _Session

    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"localhost": "maildir:maildir"}))
        server = SmtpServer(relay.config, relay.aspool, relay.metrics)
        client, ours = trio.testing.memory_stream_pair()
        counting = CountingStream(ours)
        nursery.start_soon(_Session(server, counting, "127.0.0.1").run)
        parser = ReplyParser()

        async def replies(n: int) -> list[int]:
            got: list[Reply] = []
            with trio.fail_after(60):
                for _ in range(50):
                    if len(got) >= n:
                        break
                    got += parser.feed(await client.receive_some(65536))
            return [r.code for r in got]

        assert await replies(1) == [220]
        await client.send_all(b"EHLO c.test\r\n")
        assert await replies(1) == [250]
        counting.writes.clear()
        await client.send_all(b"MAIL FROM:<a@x.example>\r\nRCPT TO:<b@localhost>\r\nRCPT TO:<c@localhost>\r\nDATA\r\n")
        assert await replies(4) == [250, 250, 250, 354]
        assert len(counting.writes) == 1  # one write for the whole group, only once the input ran out
        await client.send_all(b"Subject: t\r\n\r\nbody\r\n.\r\n")
        assert await replies(1) == [250]  # the 250 after the commit is not held back for more input
        await client.send_all(b"NOOP\r\nQUIT\r\n")
        assert await replies(2) == [250, 221]
        nursery.cancel_scope.cancel()


def test_free_space_is_cached_only_while_far_above_the_minimum() -> None:
    from mta.inbound.disk import CachedFreeSpace

    now, free, reads = [0.0], [10_000], []

    def measure(path: str) -> int:
        reads.append(path)
        return free[0]

    cache = CachedFreeSpace(1000, ttl=1.0, margin=5000, measure=measure, clock=lambda: now[0])
    assert [cache("/s") for _ in range(3)] == [10_000] * 3 and len(reads) == 1  # plenty: one statvfs a second
    free[0] = 0
    now[0] = 0.5
    assert cache("/s") == 10_000  # a fall within the second goes unseen (it is less than the margin's worth)
    now[0] = 1.0
    assert cache("/s") == 0 and len(reads) == 2
    free[0] = 5500  # near the limit: every check reads afresh, so refusing and resuming are exact
    assert cache("/s") == 5500 and cache("/s") == 5500 and len(reads) == 4
    assert cache("/other") == 5500 and reads[-1] == "/other"
