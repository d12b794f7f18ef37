"""The milter wire codec without a socket: framing, every reply type, negotiation, and a fuzzed decoder."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mta.milter import protocol as p
from mta.milter.changes import (
    Accept,
    AddHeader,
    AddRecipient,
    ChangeHeader,
    ChangeSender,
    Continue,
    CustomReply,
    DeleteRecipient,
    Discard,
    InsertHeader,
    Negotiated,
    Progress,
    Quarantine,
    Reject,
    ReplaceBody,
    Skip,
    Tempfail,
)
from mta.milter.protocol import MilterProtocolError, Packet
from mta.smtp.common import Reply


def test_a_packet_is_length_command_data() -> None:
    assert p.packet(b"B", b"abc") == b"\x00\x00\x00\x04Babc"
    assert p.optneg(0x1FF, 0x1FFF) == b"\x00\x00\x00\x0dO" + struct.pack(">III", 6, 0x1FF, 0x1FFF)


def test_commands_carry_their_strings_nul_terminated() -> None:
    assert p.connect("mx.example", "192.0.2.1", 2525) == p.packet(b"C", b"mx.example\x004\x09\xdd192.0.2.1\x00")
    assert p.connect("unknown", "2001:db8::1", 25)[5:].startswith(b"unknown\x006\x00\x19")
    assert p.envelope(p.C_MAIL, "a@b.example", ["SIZE=10", "BODY=8BITMIME"]) == \
        p.packet(b"M", b"<a@b.example>\x00SIZE=10\x00BODY=8BITMIME\x00")
    assert p.macros(p.C_RCPT, {"i": "ABC", "{rcpt_addr}": "x@y"}) == \
        p.packet(b"D", b"Ri\x00ABC\x00{rcpt_addr}\x00x@y\x00")
    assert p.header("Subject", "hi") == p.packet(b"L", b"Subject\x00hi\x00")
    with pytest.raises(MilterProtocolError):
        p.helo("bad\0name")


def test_the_body_goes_in_chunks_of_at_most_65535() -> None:
    chunks = p.body_chunks(b"x" * 140_000)
    assert [len(c) - 5 for c in chunks] == [65535, 65535, 140_000 - 131_070]


def _one(command: bytes, data: bytes = b"") -> object:
    return p.parse_reply(Packet(command, data))


def test_every_reply_decodes_to_its_record() -> None:
    assert _one(b"a") == Accept() and _one(b"c") == Continue() and _one(b"d") == Discard()
    assert _one(b"r") == Reject() and _one(b"t") == Tempfail() and _one(b"p") == Progress() and _one(b"s") == Skip()
    assert _one(b"y", b"550 5.7.1 go away\x00") == CustomReply(Reply(550, "5.7.1", "go away"))
    assert _one(b"h", b"X-A\x00one\x00") == AddHeader("X-A", "one")
    assert _one(b"i", struct.pack(">I", 0) + b"X-B\x00two\x00") == InsertHeader(0, "X-B", "two")
    assert _one(b"m", struct.pack(">I", 2) + b"X-C\x00\x00") == ChangeHeader(2, "X-C", "")
    assert _one(b"b", b"new body\r\n") == ReplaceBody(b"new body\r\n")
    assert _one(b"e", b"<s@x.example>\x00") == ChangeSender("s@x.example")
    assert _one(b"e", b"<s@x.example>\x00SIZE=5\x00") == ChangeSender("s@x.example", "SIZE=5")
    assert _one(b"+", b"<r@x.example>\x00") == AddRecipient("r@x.example")
    assert _one(b"2", b"<r@x.example>\x00NOTIFY=NEVER\x00") == AddRecipient("r@x.example", "NOTIFY=NEVER")
    assert _one(b"-", b"<r@x.example>\x00") == DeleteRecipient("r@x.example")
    assert _one(b"q", b"looks bad\x00") == Quarantine("looks bad")


def test_a_custom_reply_must_be_a_refusal_with_a_matching_class() -> None:
    assert p.parse_custom_reply("451 4.7.1 later") == Reply(451, "4.7.1", "later")
    assert p.parse_custom_reply("554 no enhanced code") == Reply(554, None, "no enhanced code")
    assert p.parse_custom_reply("550-5.7.1 line one\r\n550 5.7.1 line two") == \
        Reply(550, "5.7.1", "line one\nline two")
    for bad in ("250 2.0.0 fine", "hello", "55", "550 4.7.1 wrong class"):
        with pytest.raises(MilterProtocolError):
            p.parse_custom_reply(bad)


def test_negotiation_reads_the_flags_and_the_macro_lists() -> None:
    data = struct.pack(">III", 6, 0x11, 0x40) + struct.pack(">I", 2) + b"{mail_addr} i\x00" \
        + struct.pack(">I", 5) + b"i\x00"
    assert p.parse_negotiation(data) == Negotiated(6, 0x11, 0x40, {p.C_MAIL: ("mail_addr", "i"), p.C_BODYEOB: ("i",)})
    with pytest.raises(MilterProtocolError):
        p.parse_negotiation(b"\x00\x00")


def test_unknown_and_malformed_replies_are_protocol_errors() -> None:
    for command, data in ((b"Z", b""), (b"h", b"only-name\x00"), (b"i", b"\x00\x00"), (b"a", b"junk")):
        with pytest.raises(MilterProtocolError):
            _one(command, data)


def test_a_zero_or_huge_length_is_refused() -> None:
    for length in (0, p.MAX_PACKET + 1):
        d = p.Decoder()
        d.receive_data(struct.pack(">I", length) + b"a")
        with pytest.raises(MilterProtocolError):
            d.next_packet()


def _decode_all(data: bytes, step: int) -> list[object]:
    d = p.Decoder()
    out: list[object] = []
    for i in range(0, len(data), step):
        d.receive_data(data[i:i + step])
        while (packet := d.next_packet()) is not None:
            out.append(packet)
    return out


@given(st.lists(st.tuples(st.sampled_from(b"acdrtpyhimb+-eq"), st.binary(max_size=300)), max_size=8),
       st.integers(1, 17))
def test_the_decoder_gives_the_same_packets_whatever_the_split(packets: list[tuple[int, bytes]], step: int) -> None:
    wire = b"".join(p.packet(bytes([c]), d) for c, d in packets)
    whole = _decode_all(wire, max(len(wire), 1))
    assert whole == _decode_all(wire, step) == [Packet(bytes([c]), d) for c, d in packets]


@given(st.binary(max_size=400))
def test_fuzzed_bytes_give_replies_or_a_protocol_error_and_nothing_else(data: bytes) -> None:
    d = p.Decoder()
    d.receive_data(data)
    try:
        while (packet := d.next_packet()) is not None:
            p.parse_reply(packet)
    except MilterProtocolError:
        pass
