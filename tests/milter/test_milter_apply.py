"""The one place filters' changes are made, and rspamd's answer read as the same changes."""

from __future__ import annotations

from mta.milter.apply import Field, Message, split_header
from mta.milter.changes import (
    AddHeader,
    AddRecipient,
    ChangeHeader,
    ChangeSender,
    Continue,
    CustomReply,
    DeleteRecipient,
    Discard,
    InsertHeader,
    Quarantine,
    ReplaceBody,
)
from mta.milter.rspamd import read_answer
from mta.smtp.common import Reply

DATA = (b"From: a@example.com\r\nSubject: hi\r\nX-Long: one\r\n\ttwo\r\nX-Dup: 1\r\nX-Dup: 2\r\n\r\n"
        b"body line\r\n")


def msg() -> Message:
    return Message.parse("a@example.com", ["b@dest.test", "c@dest.test"], DATA)


def test_an_untouched_message_reads_back_byte_for_byte() -> None:
    m = msg()
    assert m.to_bytes() == DATA and not m.changed
    assert [f.name for f in m.fields] == ["From", "Subject", "X-Long", "X-Dup", "X-Dup"]
    assert m.fields[2].value == "one\n\ttwo"  # as milters are shown a folded field


def test_header_changes_follow_libmilters_rules() -> None:
    m = msg()
    m.apply([AddHeader("X-End", "last"), InsertHeader(0, "X-Top", "first"), ChangeHeader(2, "x-dup", "two"),
             ChangeHeader(1, "Subject", ""), ChangeHeader(5, "X-New", "beyond the last: added")])
    out = m.to_bytes()
    assert out.startswith(b"X-Top: first\r\nFrom: a@example.com\r\nX-Long: one\r\n\ttwo\r\nX-Dup: 1\r\nX-Dup: two\r\n")
    assert out.endswith(b"X-End: last\r\nX-New: beyond the last: added\r\n\r\nbody line\r\n")
    assert b"Subject" not in out and m.changed


def test_a_folded_value_from_a_filter_is_written_with_crlf() -> None:
    assert Field.make("X-F", "a\n\tb").raw == b"X-F: a\r\n\tb\r\n"


def test_body_pieces_join_and_envelope_changes_apply() -> None:
    m = msg()
    m.apply([ReplaceBody(b"new\nbody"), ReplaceBody(b" end"), ChangeSender("s@other.example"),
             AddRecipient("d@dest.test"), AddRecipient("b@dest.test"), DeleteRecipient("C@dest.test"),
             Quarantine("")])
    assert m.body == b"new\r\nbody end\r\n"
    assert m.sender == "s@other.example" and m.recipients == ["b@dest.test", "d@dest.test"]
    assert m.quarantine == "quarantined by a filter"


def test_a_message_without_an_empty_line_ends_its_header_at_the_first_non_field() -> None:
    fields, body = split_header(b"Subject: x\r\nnot a field\r\nmore\r\n")
    assert [f.name for f in fields] == ["Subject"] and body == b"not a field\r\nmore\r\n"


def test_rspamds_actions_become_verdicts_and_its_milter_block_changes() -> None:
    m = msg()
    spam = read_answer({"action": "reject", "score": 20.0, "messages": {"smtp_message": "Gtube pattern"}}, m)
    assert spam.verdict == CustomReply(Reply(554, "5.7.1", "Gtube pattern")) and spam.score == 20.0
    later = read_answer({"action": "soft reject"}, m)
    assert later.verdict == CustomReply(Reply(451, "4.7.1", "Try again later"))
    assert read_answer({"action": "greylist"}, m).verdict == later.verdict
    header = read_answer({"action": "add header"}, m)
    assert header.verdict == Continue() and header.changes == (AddHeader("X-Spam", "Yes"),)
    subject = read_answer({"action": "rewrite subject", "subject": "*** SPAM *** hi"}, m)
    assert subject.changes == (ChangeHeader(1, "Subject", "*** SPAM *** hi"),)
    block = read_answer({"action": "no action", "milter": {
        "remove_headers": {"X-Dup": 0, "X-Long": 1},
        "add_headers": {"X-Spamd-Result": "default: False", "X-Rspamd-Server": {"value": "r1", "order": 0},
                        "X-Multi": ["a", {"value": "b"}]},
        "change_from": "<new@example.com>", "add_rcpt": ["x@dest.test"], "del_rcpt": "c@dest.test"}}, m)
    assert block.changes == (
        ChangeHeader(1, "X-Dup", ""), ChangeHeader(1, "X-Dup", ""), ChangeHeader(1, "X-Long", ""),
        AddHeader("X-Spamd-Result", "default: False"), InsertHeader(0, "X-Rspamd-Server", "r1"),
        AddHeader("X-Multi", "a"), AddHeader("X-Multi", "b"), ChangeSender("new@example.com"),
        AddRecipient("x@dest.test"), DeleteRecipient("c@dest.test"))
    assert read_answer({"action": "no action", "milter": {"reject": "discard"}}, m).verdict == Discard()
