"""The policy protocol's codec without sockets: requests written, replies parsed whole or byte by byte, actions read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mta.policy.codec import (
    MAX_LINE,
    Bcc,
    DeferIfPermit,
    DeferIfReject,
    Discard,
    Dunno,
    Filter,
    Hold,
    Permit,
    PolicyProtocolError,
    Prepend,
    Redirect,
    Refuse,
    ReplyParser,
    Unsupported,
    Warn,
    encode_request,
    parse_action,
)
from mta.policy.filter_route import filter_route
from mta.smtp.common import Reply


def test_a_request_is_name_value_lines_and_an_empty_line() -> None:
    assert encode_request({"request": "smtpd_access_policy", "sender": "a@b.example"}) == \
        b"request=smtpd_access_policy\nsender=a@b.example\n\n"


def test_a_value_cannot_end_the_request_or_add_an_attribute() -> None:
    data = encode_request({"helo_name": "evil\n\naction=OK\r\n", "sender": "x\0y"})
    assert data == b"helo_name=evil  action=OK  \nsender=x y\n\n"
    assert data.count(b"\n\n") == 1
    with pytest.raises(ValueError, match="not an attribute name"):
        encode_request({"Bad Name": "x"})


def replies(parser: ReplyParser) -> list[dict[str, str]]:
    got = []
    while (reply := parser.next_reply()) is not None:
        got.append(reply)
    return got


@given(st.lists(st.integers(1, 40), max_size=20))
def test_replies_are_the_same_fed_at_once_or_in_pieces(cuts: list[int]) -> None:
    data = (b"action=DEFER_IF_PERMIT 4.2.0 Greylisted, see http://x/y.html\n\n"
            b"action=dunno\nextra=1\r\n\n" b"action=PREPEND X-Greylist: delayed 3 seconds\n\n")
    whole = ReplyParser()
    whole.feed(data)
    expected = replies(whole)
    assert [r["action"] for r in expected] == ["DEFER_IF_PERMIT 4.2.0 Greylisted, see http://x/y.html", "dunno",
                                               "PREPEND X-Greylist: delayed 3 seconds"]
    assert expected[1] == {"action": "dunno", "extra": "1"}
    pieces = ReplyParser()
    got: list[dict[str, str]] = []
    at = 0
    for cut in [*cuts, len(data)]:
        pieces.feed(data[at:at + cut])
        at += cut
        got += replies(pieces)
    assert got == expected
    assert not pieces.pending


def test_a_broken_reply_is_a_protocol_error() -> None:
    for data in (b"no equals sign\n\n", b"x" * (MAX_LINE + 2), b"action=" + b"x" * (MAX_LINE + 1) + b"\n"):
        parser = ReplyParser()
        parser.feed(data)
        with pytest.raises(PolicyProtocolError):
            parser.next_reply()
    with pytest.raises(PolicyProtocolError, match="without an action"):
        parse_action({"other": "1"})


@pytest.mark.parametrize(("action", "expected"), [
    ("OK", Permit()),
    ("ok", Permit()),
    ("DUNNO", Dunno()),
    ("", Dunno()),
    ("REJECT", Refuse(Reply(554, "5.7.1", "Access denied"))),
    ("REJECT go away", Refuse(Reply(554, "5.7.1", "go away"))),
    ("REJECT 5.7.9 not here", Refuse(Reply(554, "5.7.9", "not here"))),
    ("DEFER", Refuse(Reply(450, "4.7.1", "Try again later"))),
    ("DEFER 4.3.0 later", Refuse(Reply(450, "4.3.0", "later"))),
    ("DEFER_IF_PERMIT 4.2.0 Greylisted, see http://postgrey/help/x.html",
     DeferIfPermit(Reply(450, "4.2.0", "Greylisted, see http://postgrey/help/x.html"))),
    ("DEFER_IF_REJECT wait", DeferIfReject(Reply(450, "4.7.1", "wait"))),
    ("450 4.2.0 Greylisted", Refuse(Reply(450, "4.2.0", "Greylisted"))),
    ("421 closing", Refuse(Reply(421, "4.7.1", "closing"))),
    ("550 5.1.1 no such user", Refuse(Reply(550, "5.1.1", "no such user"))),
    ("550 4.1.1 mismatched class", Refuse(Reply(550, "5.7.1", "4.1.1 mismatched class"))),
    ("554", Refuse(Reply(554, "5.7.1", "Access denied"))),
    ("PREPEND X-Greylist: delayed 3 seconds", Prepend("X-Greylist: delayed 3 seconds")),
    ("PREPEND not a header", Unsupported("PREPEND not a header")),
    ("PREPEND X-Long: " + "x" * 991, Unsupported(("PREPEND X-Long: " + "x" * 991)[:200])),
    ("PREPEND X-Long: " + "x" * 990, Prepend("X-Long: " + "x" * 990)),
    ("WARN odd client", Warn("odd client")),
    ("FILTER smtp:[10.0.0.1]", Filter("smtp:[10.0.0.1]")),
    ("FILTER", Unsupported("FILTER")),
    ("HOLD", Hold("")),
    ("hold look at it\x01", Hold("look at it")),
    ("DISCARD spam", Discard("spam")),
    ("REDIRECT a@b", Redirect("a@b")),
    ("BCC archive@dest.test", Bcc("archive@dest.test")),
    ("REDIRECT a@b, c@d", Unsupported("REDIRECT a@b, c@d")),
    ("BCC <a@b>", Unsupported("BCC <a@b>")),
    ("REDIRECT", Unsupported("REDIRECT")),
])
def test_actions(action: str, expected: object) -> None:
    assert parse_action({"action": action}) == expected


def test_a_servers_text_reaches_the_client_as_one_printable_line() -> None:
    action = parse_action({"action": "REJECT caf\u00e9\tbad\x1b[31m" + "x" * 1000})
    assert isinstance(action, Refuse)
    assert action.reply.text.startswith("caf  bad [31m")
    assert len(action.reply.to_bytes()) <= 512


@pytest.mark.parametrize(("text", "route"), [
    ("smtp:[10.0.0.1]:10025", "smtp://10.0.0.1:10025"),
    ("smtp:filter.example:10025", "smtp://filter.example:10025"),
    ("smtp:[::1]:10025", "smtp://[::1]:10025"),
    ("smtp://127.0.0.1:10025", "smtp://127.0.0.1:10025"),
    ("lmtp:unix:/run/filter.sock", "lmtp:/run/filter.sock"),
    ("lmtp:inet:127.0.0.1:24", "lmtp://127.0.0.1:24"),
    ("lmtp:relative/sock", None),
    ("maildir:/var/mail", None),
    ("discard", None),
    ("smtp:", None),
])
def test_filter_routes(text: str, route: str | None) -> None:
    assert filter_route(text) == route
