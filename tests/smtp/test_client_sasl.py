"""The client's SASL (``mta.smtp.client_sasl``): which mechanism, and the lines of each exchange."""

from __future__ import annotations

import base64

import pytest

from mta.smtp.client_sasl import ClientLogin, LoginRefused, NoMechanism, choose
from mta.smtp.common import Reply


def test_the_mechanism_is_the_forced_one_else_plain_else_login() -> None:
    assert choose("LOGIN PLAIN CRAM-MD5") == "PLAIN" and choose("login") == "LOGIN"
    assert choose("PLAIN LOGIN", "LOGIN") == "LOGIN"
    with pytest.raises(NoMechanism, match="offers AUTH CRAM-MD5"):
        choose("CRAM-MD5")
    with pytest.raises(NoMechanism):
        choose("PLAIN", "LOGIN")


def test_plain_is_one_line_login_answers_two_challenges_and_a_refusal_carries_the_reply() -> None:
    plain = ClientLogin("PLAIN", "alice", "pw")
    assert plain.start() == "AUTH PLAIN " + base64.b64encode(b"\0alice\0pw").decode()
    assert plain.answer(Reply(235, "2.7.0", "ok")) is None
    login = ClientLogin("LOGIN", "alice", "pw")
    assert login.start() == "AUTH LOGIN"
    assert login.answer(Reply(334, None, "VXNlcm5hbWU6")) == base64.b64encode(b"alice").decode()
    assert login.answer(Reply(334, None, "UGFzc3dvcmQ6")) == base64.b64encode(b"pw").decode()
    with pytest.raises(LoginRefused) as refused:
        login.answer(Reply(535, "5.7.8", "bad"))
    assert refused.value.reply.code == 535
    assert "pw" not in repr(login) and "pw" not in str(refused.value)
