"""mta.smtp.dsn_params: xtext both ways, and each DSN parameter's strict syntax (RFC 3461 §4)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mta.delivery.dsn_notify import DEFAULT_NOTIFY_DELAY, delay_due
from mta.smtp import dsn_params as D
from mta.smtp.common import RemoteProtocolError


@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127)))
def test_xtext_decodes_what_it_encodes(text: str) -> None:
    encoded = D.xtext_encode(text)
    assert all("!" <= c <= "~" and c != "=" for c in encoded)
    assert D.xtext_decode(encoded) == text


@pytest.mark.parametrize("bad", ["a b", "a=b", "+2", "+2g", "+zz", "caf\u00e9", "tab\there"])
def test_xtext_refuses_what_it_does_not_allow(bad: str) -> None:
    with pytest.raises(ValueError):
        D.xtext_decode(bad)


def test_notify_is_normalised_and_checked() -> None:
    assert D.parse_notify("delay,success") == "SUCCESS,DELAY"
    assert D.parse_notify("never") == "NEVER"
    for bad in (None, "", "NEVER,DELAY", "SUCCESS,SUCCESS", "SOMETIMES", "SUCCESS,"):
        with pytest.raises(RemoteProtocolError) as info:
            D.parse_notify(bad)
        assert (info.value.reply.code, info.value.reply.enhanced) == (501, "5.5.4")


def test_orcpt_ret_and_envid() -> None:
    assert D.parse_orcpt("rfc822;a+2Bb@x.example") == "rfc822;a+b@x.example"
    assert D.parse_ret("hdrs") == "HDRS"
    assert D.parse_envid("Q+2B1") == "Q+1"
    for call, value in ((D.parse_orcpt, "a@x"), (D.parse_orcpt, ";a@x"), (D.parse_orcpt, "rfc822;"),
                        (D.parse_orcpt, "rfc822;a+0Ab"), (D.parse_ret, "ALL"), (D.parse_envid, "x" * 101),
                        (D.parse_envid, "+00")):
        with pytest.raises(RemoteProtocolError):
            call(value)


def test_the_next_hop_gets_the_request_encoded_again() -> None:
    extra = {"params": {"RET": "FULL", "ENVID": "a b"},
             "dsn_rcpt": {"x@y.example": {"notify": "SUCCESS", "orcpt": "rfc822;o=1@y.example"}, "z@y.example": {}}}
    assert D.mail_params(extra) == {"RET": "FULL", "ENVID": "a+20b"}
    assert D.rcpt_params(extra, "x@y.example") == {"NOTIFY": "SUCCESS", "ORCPT": "rfc822;o+3D1@y.example"}
    assert D.rcpt_params({"dsn_rcpt": {"x@y.example": {"notify": "NEVER"}}}, "x@y.example") == {
        "NOTIFY": "NEVER", "ORCPT": "rfc822;x@y.example"}
    assert D.rcpt_params(extra, "z@y.example") == {}


def test_delay_notices_follow_notify_and_the_setting() -> None:
    def extra(notify: str) -> dict[str, object]:
        return {"dsn_rcpt": {"r@x": {"notify": notify}}}
    assert not delay_due({}, "r@x", None, 10**6)  # no NOTIFY, no setting: none (as Postfix)
    assert delay_due({}, "r@x", 60.0, 61.0)
    assert not delay_due(extra("FAILURE"), "r@x", 60.0, 10**6)
    assert not delay_due(extra("NEVER"), "r@x", 60.0, 10**6)
    assert delay_due(extra("DELAY"), "r@x", 60.0, 61.0)
    assert not delay_due(extra("DELAY"), "r@x", None, DEFAULT_NOTIFY_DELAY - 1)
    assert delay_due(extra("DELAY"), "r@x", None, DEFAULT_NOTIFY_DELAY)
