"""One milter conversation's state table without a socket: every stage's allowed replies and no others."""

from __future__ import annotations

import struct

import pytest

from mta.milter import protocol as p
from mta.milter.changes import (
    Accept,
    AddHeader,
    Continue,
    Discard,
    Progress,
    Quarantine,
    ReplaceBody,
    Skip,
)
from mta.milter.protocol import MilterProtocolError
from mta.milter.session import ALLOWED, Conversation, Stage

REPLY_BYTES: dict[type, bytes] = {
    Accept: p.packet(b"a"), Continue: p.packet(b"c"), Discard: p.packet(b"d"), Progress: p.packet(b"p"),
    Skip: p.packet(b"s"), AddHeader: p.packet(b"h", b"X\x00y\x00"), Quarantine: p.packet(b"q", b"why\x00"),
    ReplaceBody: p.packet(b"b", b"new"),
}


def negotiated(actions: int = p.ALL_ACTIONS, protocol: int = p.P_SKIP, macros: bytes = b"") -> Conversation:
    conv = Conversation()
    assert conv.start().startswith(b"\x00\x00\x00\x0dO")
    conv.receive_data(p.packet(b"O", struct.pack(">III", 6, actions, protocol) + macros))
    assert conv.next_event() is not None and conv.awaiting is None
    return conv


def test_every_stage_takes_exactly_the_replies_in_its_row() -> None:
    for stage in Stage:
        if stage is Stage.NEGOTIATE:
            continue
        for kind, wire in REPLY_BYTES.items():
            conv = negotiated()
            assert conv.send(stage, [p.packet(b"X")], {}) != b""
            conv.receive_data(wire)
            if issubclass(kind, ALLOWED[stage]):
                assert isinstance(conv.next_event(), kind)
            else:
                with pytest.raises(MilterProtocolError):
                    conv.next_event()


def test_a_change_not_negotiated_is_refused() -> None:
    conv = negotiated(actions=p.F_ADDHDRS)
    conv.send(Stage.EOM, [p.packet(p.C_BODYEOB)], {})
    conv.receive_data(REPLY_BYTES[AddHeader] + REPLY_BYTES[ReplaceBody])
    assert conv.next_event() == AddHeader("X", "y")
    with pytest.raises(MilterProtocolError, match="not negotiated"):
        conv.next_event()


def test_a_filter_wanting_more_than_offered_is_refused() -> None:
    conv = Conversation(actions=p.F_ADDHDRS)
    conv.start()
    conv.receive_data(p.packet(b"O", struct.pack(">III", 6, p.F_CHGBODY, 0)))
    with pytest.raises(MilterProtocolError):
        conv.next_event()


def test_steps_not_wanted_are_not_sent_and_no_reply_steps_are_not_waited_for() -> None:
    conv = negotiated(protocol=p.P_NOHELO | p.P_NR_MAIL)
    assert conv.send(Stage.HELO, [p.helo("x")], {}) == b""
    assert conv.send(Stage.MAIL, [p.envelope(p.C_MAIL, "a@b")], {}) != b"" and conv.awaiting is None
    assert conv.send(Stage.RCPT, [p.envelope(p.C_RCPT, "c@d")], {}) != b"" and conv.awaiting is Stage.RCPT


def test_macros_are_sent_first_as_asked_or_postfix_default() -> None:
    conv = negotiated()
    out = conv.send(Stage.MAIL, [p.envelope(p.C_MAIL, "a@b")], {"i": "Q1", "mail_addr": "a@b", "rcpt_addr": "no"})
    assert out.startswith(p.macros(p.C_MAIL, {"i": "Q1", "{mail_addr}": "a@b"}))
    asked = negotiated(macros=struct.pack(">I", 2) + b"{client_addr}\x00")
    out = asked.send(Stage.MAIL, [p.envelope(p.C_MAIL, "a@b")], {"i": "Q1", "client_addr": "192.0.2.1"})
    assert out.startswith(p.macros(p.C_MAIL, {"{client_addr}": "192.0.2.1"}))


def test_accept_ends_the_message_or_the_session_and_skip_ends_the_body() -> None:
    conv = negotiated()
    conv.send(Stage.MAIL, [b""], {})
    conv.receive_data(REPLY_BYTES[Accept])
    assert conv.next_event() == Accept() and not conv.asks(Stage.RCPT) and not conv.asks(Stage.EOM)
    assert conv.new_message() == p.packet(p.C_ABORT) and conv.asks(Stage.MAIL)
    conv.send(Stage.BODY, [b""], {})
    conv.receive_data(REPLY_BYTES[Skip])
    assert conv.next_event() == Skip() and not conv.asks(Stage.BODY) and conv.asks(Stage.EOM)
    conv.send(Stage.CONNECT, [b""], {})
    conv.receive_data(REPLY_BYTES[Accept])
    conv.next_event()
    assert not any(conv.asks(s) for s in Stage)


def test_skip_needs_negotiating_and_a_reply_needs_a_question() -> None:
    conv = negotiated(protocol=0)
    conv.send(Stage.BODY, [b""], {})
    conv.receive_data(REPLY_BYTES[Skip])
    with pytest.raises(MilterProtocolError):
        conv.next_event()
    idle = negotiated()
    idle.receive_data(REPLY_BYTES[Continue])
    with pytest.raises(MilterProtocolError, match="none was owed"):
        idle.next_event()
    busy = negotiated()
    busy.send(Stage.MAIL, [b""], {})
    with pytest.raises(MilterProtocolError, match="owed"):
        busy.send(Stage.RCPT, [b""], {})


def test_progress_keeps_the_stage_open_until_its_verdict() -> None:
    conv = negotiated()
    conv.send(Stage.EOM, [b""], {})
    conv.receive_data(REPLY_BYTES[Progress] + REPLY_BYTES[Quarantine] + REPLY_BYTES[Continue])
    assert conv.next_event() == Progress() and conv.awaiting is Stage.EOM
    assert conv.next_event() == Quarantine("why") and conv.awaiting is Stage.EOM
    assert conv.next_event() == Continue() and conv.awaiting is None
