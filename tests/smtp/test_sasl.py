"""The SASL exchange (mta.smtp.sasl) and AUTH in the server core: RFC 4954's replies, and fuzzing.

The fuzz tests hold the parser to its contract: for any argument and any
response lines it returns one of its three outcomes, never raises, never
puts a byte of what the client sent into a reply, and ends every exchange
within two lines; the core, fed any bytes in AUTH, stays on its table and
never keeps a credential in a Rejection.
"""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.smtp import sasl
from mta.smtp import server as S
from mta.smtp.common import LocalProtocolError, Reply, ReplyParser


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def test_plain_with_an_initial_response_completes_at_once() -> None:
    exchange, outcome = sasl.start("PLAIN " + b64(b"\0alice\0pw"))
    assert exchange is None and outcome == sasl.Credentials("PLAIN", "alice", "pw")
    assert "pw" not in repr(outcome)


def test_plain_with_the_same_authzid_is_accepted_and_another_is_not() -> None:
    assert sasl.start("plain " + b64(b"alice\0alice\0pw"))[1] == sasl.Credentials("PLAIN", "alice", "pw")
    assert sasl.start("PLAIN " + b64(b"root\0alice\0pw"))[1] == sasl.Failed(sasl.R_BAD_CREDENTIALS, "auth_malformed")


def test_login_asks_for_the_user_then_the_password() -> None:
    exchange, outcome = sasl.start("LOGIN")
    assert outcome == sasl.Challenge(Reply(334, None, "VXNlcm5hbWU6")) and exchange is not None
    assert exchange.respond(b64(b"alice").encode()) == sasl.Challenge(Reply(334, None, "UGFzc3dvcmQ6"))
    assert exchange.respond(b64(b"pw").encode()) == sasl.Credentials("LOGIN", "alice", "pw")
    with pytest.raises(ValueError):
        exchange.respond(b"*")


def test_login_with_the_user_as_initial_response_asks_only_for_the_password() -> None:
    exchange, outcome = sasl.start("LOGIN " + b64(b"alice"))
    assert outcome == sasl.Challenge(Reply(334, None, "UGFzc3dvcmQ6")) and exchange is not None
    assert exchange.respond(b64(b"pw").encode()) == sasl.Credentials("LOGIN", "alice", "pw")


@pytest.mark.parametrize(("argument", "reply"), [
    ("", sasl.R_SYNTAX), ("PLAIN a b", sasl.R_SYNTAX), ("PLAIN ", sasl.R_SYNTAX),
    ("CRAM-MD5", sasl.R_UNKNOWN_MECHANISM), ("PLAIN *", sasl.R_CANCELLED), ("PLAIN ===", sasl.R_NOT_BASE64),
    ("PLAIN =", sasl.R_BAD_CREDENTIALS), ("PLAIN " + b64(b"\0\0pw"), sasl.R_BAD_CREDENTIALS),
    ("PLAIN " + b64(b"\0alice\0"), sasl.R_BAD_CREDENTIALS), ("PLAIN " + b64(b"\0al\x01ce\0pw"), sasl.R_BAD_CREDENTIALS),
    ("PLAIN " + b64(b"\0\xff\0pw"), sasl.R_BAD_CREDENTIALS), ("PLAIN " + b64(b"\0" + b"a" * 256 + b"\0pw"),
                                                              sasl.R_BAD_CREDENTIALS),
    ("PLAIN " + b64(b"\0alice\0" + b"p" * 1025), sasl.R_BAD_CREDENTIALS),
    ("PLAIN " + "A" * (sasl.MAX_SASL_LINE + 4), sasl.R_LINE_TOO_LONG),
], ids=["empty", "three-words", "trailing-space", "unknown", "cancel", "not-base64", "empty-response", "no-user",
        "no-password", "control-in-user", "not-utf8", "user-too-long", "password-too-long", "line-too-long"])
def test_a_bad_start_is_answered_with_rfc_4954s_reply(argument: str, reply: Reply) -> None:
    exchange, outcome = sasl.start(argument)
    assert exchange is None and isinstance(outcome, sasl.Failed) and outcome.reply == reply


def outcomes(argument: str, lines: list[bytes]) -> list[sasl.Outcome]:
    exchange, outcome = sasl.start(argument)
    seen = [outcome]
    for line in lines:
        if exchange is None or exchange.done:
            break
        seen.append(exchange.respond(line))
    return seen


# Arguments and lines: mostly near the grammar (a mechanism and base64), sometimes anything at all.
mechanisms = st.sampled_from(["PLAIN", "LOGIN", "plain", "Login", "XOAUTH2", ""])
credentials = st.tuples(st.binary(max_size=20), st.binary(max_size=20), st.binary(max_size=20)).map(
    lambda t: b"\0".join(t))
responses = st.one_of(credentials.map(lambda b: base64.b64encode(b)), st.binary(max_size=40), st.just(b"*"),
                      st.text(max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass")))
arguments = st.one_of(
    st.tuples(mechanisms, st.none() | responses).map(
        lambda t: t[0] + ("" if t[1] is None else " " + t[1].decode("latin-1"))),
    st.text(max_size=40))


@settings(max_examples=500, deadline=None)
@given(arguments, st.lists(responses, max_size=4))
def test_the_parser_returns_an_outcome_for_anything_and_never_shows_what_it_was_sent(
        argument: str, lines: list[bytes]) -> None:
    seen = outcomes(argument, lines)
    assert all(isinstance(o, sasl.Credentials | sasl.Challenge | sasl.Failed) for o in seen)
    assert len(seen) <= 3  # LOGIN: the start, the user, the password
    fixed = {sasl.R_CANCELLED, sasl.R_NOT_BASE64, sasl.R_LINE_TOO_LONG, sasl.R_BAD_CREDENTIALS,
             sasl.R_UNKNOWN_MECHANISM, sasl.R_SYNTAX}
    for o in seen:
        if isinstance(o, sasl.Failed):
            assert o.reply in fixed
        elif isinstance(o, sasl.Challenge):
            assert o.reply.text in ("", "VXNlcm5hbWU6", "UGFzc3dvcmQ6")
        else:
            assert o.username and len(o.username) <= sasl.MAX_USERNAME and o.password


@settings(max_examples=300, deadline=None)
@given(credentials)
def test_plain_gives_back_exactly_the_credentials_it_was_given(message: bytes) -> None:
    _, outcome = sasl.start("PLAIN " + b64(message))
    if isinstance(outcome, sasl.Credentials):
        authzid, authcid, passwd = message.split(b"\0")
        assert (outcome.username.encode(), outcome.password.encode()) == (authcid, passwd)
        assert authzid in (b"", authcid)
    else:
        assert outcome == sasl.Failed(sasl.R_BAD_CREDENTIALS, "auth_malformed")


# ---------------------------------------------------------------- AUTH in the server core


def session(**opts: object) -> tuple[S.ServerConnection, list[S.Rejection]]:
    rejections: list[S.Rejection] = []
    options: dict[str, object] = {"auth": True, "require_auth": True, "tls_active": True, **opts}
    conn = S.ServerConnection("mx.test", on_reject=rejections.append, **options)  # type: ignore[arg-type]
    conn.data_to_send()
    return conn, rejections


def feed(conn: S.ServerConnection, data: bytes, decide: bool | None = True) -> list[Reply]:
    conn.receive_data(data)
    out = bytearray()
    for _ in range(1000):
        ev = conn.next_event()
        if isinstance(ev, S.AuthRequest):
            if decide is None:
                break
            conn.accept() if decide and ev.password == "pw" else conn.reject(sasl.R_BAD_CREDENTIALS, "auth_failed")
        elif isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData | S.StartTls):
            conn.accept()
        out += conn.data_to_send()
        if isinstance(ev, S.NeedData | S.ConnectionClosed) or conn.state is S.State.TLS:  # TLS: the shell's turn
            break
    return ReplyParser().feed(bytes(out))


def test_ehlo_offers_auth_over_tls_and_mail_needs_it() -> None:
    conn, _ = session()
    (ehlo, mail) = feed(conn, b"EHLO c.example\r\nMAIL FROM:<a@b.example>\r\n")
    assert "AUTH PLAIN LOGIN" in ehlo.lines and str(mail) == "530 5.7.0 Authentication required"
    replies = feed(conn, b"AUTH LOGIN\r\n" + b64(b"alice").encode() + b"\r\n" + b64(b"pw").encode() +
                   b"\r\nMAIL FROM:<a@b.example>\r\nRSET\r\nEHLO again.example\r\nAUTH PLAIN\r\n")
    assert [r.code for r in replies] == [334, 334, 235, 250, 250, 250, 503]
    assert conn.authenticated == "alice"  # EHLO and RSET keep it (RFC 4954 §4)


def test_tls_started_forgets_an_authentication() -> None:
    conn, _ = session(tls_active=False, tls_available=True, auth_without_tls=True)
    feed(conn, b"EHLO c.example\r\nAUTH PLAIN " + b64(b"\0alice\0pw").encode() + b"\r\nSTARTTLS\r\n")
    assert conn.authenticated == "alice"
    conn.tls_started()
    assert conn.authenticated is None


def test_no_credential_reaches_a_rejection() -> None:
    conn, rejections = session()
    secret = b64(b"\0alice\0hunter2").encode()
    feed(conn, b"AUTH PLAIN " + secret + b"\r\nEHLO c.example\r\nMAIL FROM:<a@b.example>\r\nRCPT TO:<x@y>\r\n"
               b"AUTH PLAIN\r\n" + b64(b"\0alice\0hunter2").encode() + b"\r\nAUTH LOGIN " + secret + b"\r\n*\r\n")
    assert [r.command for r in rejections] == ["AUTH", "MAIL", "RCPT", "AUTH", "AUTH", "*"]
    assert all(r.argument in ("", "PLAIN", "LOGIN") for r in rejections if r.command == "AUTH")
    assert not any("hunter2" in r.argument or secret.decode() in r.argument for r in rejections)


def test_a_pending_auth_request_blocks_the_next_command() -> None:
    conn, _ = session()
    feed(conn, b"EHLO c.example\r\nAUTH PLAIN " + b64(b"\0alice\0pw").encode() + b"\r\nNOOP\r\n", decide=None)
    assert isinstance(conn.pending, S.AuthRequest) and conn.state is S.State.AUTH
    with pytest.raises(LocalProtocolError):
        conn.next_event()
    conn.accept()
    assert [str(r) for r in feed(conn, b"")] == ["235 2.7.0 Authentication successful", "250 2.0.0 Ok"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(responses.map(lambda b: b + b"\r\n"), st.binary(max_size=30),
                          st.sampled_from([b"AUTH PLAIN\r\n", b"AUTH LOGIN\r\n", b"EHLO c\r\n", b"*\r\n"])),
                max_size=12))
def test_any_bytes_in_an_auth_exchange_keep_the_core_on_its_table(pieces: list[bytes]) -> None:
    steps: list[tuple[S.State, S.Step, S.State]] = []
    rejections: list[S.Rejection] = []
    conn = S.ServerConnection("mx.test", auth=True, tls_active=True, max_errors=1000, on_reject=rejections.append,
                              on_transition=lambda a, s, b: steps.append((a, s, b)))
    feed(conn, b"EHLO c.example\r\nAUTH LOGIN\r\n")
    for piece in pieces:
        feed(conn, piece)
    assert all(S.TRANSITIONS[a][s] is b for a, s, b in steps)
    assert all(r.reply.code in (500, 501, 502, 503, 504, 535, 538) for r in rejections)
    assert all(r.argument in ("", "PLAIN", "LOGIN") or r.command != "AUTH" for r in rejections)
