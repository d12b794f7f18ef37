"""The SMTP client core in LMTP mode (RFC 2033): LHLO, and one reply per accepted recipient after the data."""

from __future__ import annotations

import pytest

from mta.smtp import client as C
from mta.smtp.common import LocalProtocolError, Reply

LHLO_REPLY = b"250-dovecot.test\r\n250-PIPELINING\r\n250-ENHANCEDSTATUSCODES\r\n250 8BITMIME\r\n"


def events(conn: C.ClientConnection, data: bytes = b"") -> list[C.Event]:
    if data:
        conn.receive_data(data)
    out: list[C.Event] = []
    while not isinstance(ev := conn.next_event(), C.NeedData | C.ConnectionClosed):
        out.append(ev)
    return out


def after_lhlo() -> C.ClientConnection:
    conn = C.ClientConnection(lmtp=True)
    events(conn, b"220 dovecot.test LMTP ready\r\n")
    conn.ehlo("relay.test")
    assert conn.data_to_send() == b"LHLO relay.test\r\n"
    (ev,) = events(conn, LHLO_REPLY)
    assert isinstance(ev, C.EhloReply) and ev.capabilities.pipelining
    return conn


def envelope(conn: C.ClientConnection, rcpts: list[str], replies: bytes) -> None:
    conn.mail("a@x.test")
    for rcpt in rcpts:
        conn.rcpt(rcpt)
    conn.data()
    conn.data_to_send()
    (*_, go) = events(conn, replies)
    assert go == C.DataReply(Reply(354, None, "go"), go_ahead=True)


def test_lmtp_has_no_helo() -> None:
    conn = C.ClientConnection(lmtp=True)
    with pytest.raises(LocalProtocolError, match="LHLO"):
        conn.helo("relay.test")


def test_each_accepted_recipient_gets_its_own_reply_to_the_end_of_data() -> None:
    conn = after_lhlo()
    envelope(conn, ["ok@d.test", "gone@d.test", "full@d.test"],
             b"250 2.1.0 OK\r\n250 2.1.5 OK\r\n550 5.1.1 no such user\r\n250 2.1.5 OK\r\n354 go\r\n")
    conn.send_body(b"Subject: t\r\n\r\nhi\r\n")
    conn.end_data()
    assert conn.data_to_send().endswith(b"hi\r\n.\r\n")
    # Two recipients were accepted: two replies, the first alone ends nothing.
    assert events(conn, b"250 2.0.0 <ok@d.test> saved\r\n") == []
    assert conn.phase is C.Phase.ENDED
    (reply,) = events(conn, b"452 4.2.2 <full@d.test> quota exceeded\r\n")
    assert isinstance(reply, C.MessageReply)
    assert [(o.address, o.reply.code, o.reply.enhanced) for o in reply.outcomes] == [
        ("ok@d.test", 250, "2.0.0"), ("gone@d.test", 550, "5.1.1"), ("full@d.test", 452, "4.2.2")]
    assert conn.idle


def test_a_second_transaction_follows_on_the_same_connection() -> None:
    conn = after_lhlo()
    for _ in range(2):
        envelope(conn, ["ok@d.test"], b"250 OK\r\n250 OK\r\n354 go\r\n")
        conn.end_data()
        conn.data_to_send()
        (reply,) = events(conn, b"250 2.0.0 saved\r\n")
        assert isinstance(reply, C.MessageReply) and reply.outcomes[0].delivered
    assert conn.idle


def test_quit_waits_for_every_reply_to_the_end_of_data() -> None:
    conn = after_lhlo()
    envelope(conn, ["a@d.test", "b@d.test"], b"250 OK\r\n250 OK\r\n250 OK\r\n354 go\r\n")
    conn.end_data()
    conn.quit()
    assert conn.data_to_send() == b".\r\n"
    events(conn, b"250 2.0.0 saved\r\n")
    assert conn.data_to_send() == b""  # one reply still owed: QUIT waits behind it
    events(conn, b"250 2.0.0 saved\r\n")
    assert conn.data_to_send() == b"QUIT\r\n"


def test_a_refused_data_is_every_accepted_recipients_outcome() -> None:
    conn = after_lhlo()
    conn.mail("a@x.test")
    conn.rcpt("a@d.test")
    conn.data()
    conn.data_to_send()
    evs = events(conn, b"250 OK\r\n250 OK\r\n451 4.3.0 try later\r\n")
    (reply,) = [e for e in evs if isinstance(e, C.MessageReply)]
    assert reply.outcomes[0].reply.code == 451


def test_answered_names_the_recipients_whose_reply_came_while_others_are_awaited() -> None:
    conn = after_lhlo()
    envelope(conn, ["a@d.test", "x@d.test", "b@d.test"],
             b"250 OK\r\n250 OK\r\n550 5.1.1 no such user\r\n250 OK\r\n354 go\r\n")
    assert not conn.answered
    conn.end_data()
    conn.data_to_send()
    events(conn, b"250 2.0.0 <a@d.test> saved\r\n")
    assert conn.answered == (C.RecipientOutcome("x@d.test", Reply(550, "5.1.1", "no such user")),
                             C.RecipientOutcome("a@d.test", Reply(250, "2.0.0", "<a@d.test> saved")))
    events(conn, b"452 4.2.2 full\r\n")
    assert not conn.answered  # the transaction is over: its MessageReply has every outcome
