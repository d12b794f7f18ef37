"""The server core sends the wire form of its recurring replies from memory: the same bytes."""

from __future__ import annotations

from mta.smtp import server_replies as replies
from mta.smtp.common import Reply
from mta.smtp.server import ServerConnection


def test_remembered_replies_are_their_own_bytes() -> None:
    assert replies._WIRE, "the constants are remembered at import"
    for reply, wire in replies._WIRE.items():
        assert wire == reply.to_bytes()


def test_a_reply_built_per_message_is_encoded_and_not_kept() -> None:
    queued = Reply(250, "2.0.0", "Ok: queued as 0123456789ABCDEF")
    before = len(replies._WIRE)
    assert replies.wire(queued) == b"250 2.0.0 Ok: queued as 0123456789ABCDEF\r\n"
    assert queued not in replies._WIRE and len(replies._WIRE) == before


def test_greeting_and_ehlo_are_the_bytes_they_were() -> None:
    conn = ServerConnection("relay.test", max_message_size=1000)
    greeting = conn.data_to_send()
    assert greeting.startswith(b"220 relay.test ") and greeting.endswith(b"\r\n")
    conn.receive_data(b"EHLO client.test\r\n")
    conn.next_event()
    assert conn.data_to_send() == replies.ehlo("relay.test", 1000, False, False).to_bytes()
    assert conn.data_to_send() == b""
    assert replies.ehlo("relay.test", 1000, False, False).to_bytes() == (
        b"250-relay.test\r\n250-PIPELINING\r\n250-SIZE 1000\r\n250-8BITMIME\r\n250-SMTPUTF8\r\n"
        b"250-ENHANCEDSTATUSCODES\r\n250-DSN\r\n250 CHUNKING\r\n")
