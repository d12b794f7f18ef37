"""Milters on the real relay: a libmilter filter (Debian's python3-milter) doing every action and reply.

The filter (``tests/support/milter_filter.py``) runs as its own process
under the system Python, one per module; what it does is chosen by the
sender, a recipient or the Subject:. What the next hop receives is what the
relay stored, so these tests also prove that a filter's changes are what is
delivered. A filter that is slow or down costs its own session the
configured default; a session beside it is not held up.
"""

from __future__ import annotations

import smtplib
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from daemon_support import SUPPORT, SYSTEM_PYTHON, Daemon, free_port
from milter_support import message, start_test_milter, transaction
from relay_support import NextHop, relay_config, start_relay

from mta.process.relay import Relay


@pytest.fixture(scope="module")
def milter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port, daemon = start_test_milter(tmp_path_factory.mktemp("milter"))
    yield port
    daemon.stop()


def filters(milter_port: int, **settings: str) -> str:
    lines = [f'smtp_milters = ["inet:{milter_port}@127.0.0.1"]'] + [f"{k} = {v}" for k, v in settings.items()]
    return "\n[filters]\n" + "\n".join(lines) + "\n"


async def relay_with(nursery: trio.Nursery, tmp: Path, milter_port: int, **settings: str) -> tuple[Relay, NextHop]:
    hop = NextHop()
    port = await hop.start(nursery)
    cfg = relay_config(str(tmp), {"dest.test": f"smtp://127.0.0.1:{port}"}, extra=filters(milter_port, **settings))
    return await start_relay(nursery, cfg), hop


def header_names(data: bytes) -> list[str]:
    head = data.split(b"\r\n\r\n", 1)[0].decode()
    return [line.split(":", 1)[0] for line in head.split("\r\n") if line[:1] not in (" ", "\t")]


def queue_id(reply: tuple[int, bytes]) -> str:
    return reply[1].decode().rsplit(" ", 1)[1]


async def test_header_changes_and_macros_are_what_is_delivered(tmp_path: Path, milter: int) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter)
        got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"],
                                message("headers", "X-Change: old value\r\nX-Remove: going\r\n"))
        assert got["data"][0] == 250
        qid = queue_id(got["data"])
        (m,) = await hop.wait_messages(1)
        names = header_names(m.data)
        # The relay's Received: stays first; the inserted field comes right after it, the added ones last.
        assert names[:2] == ["Received", "X-Inserted"]
        assert names[-3:] == ["X-Added", "X-Test-Milter", "X-Macros"]
        assert b"X-Change: changed value\r\n" in m.data and b"X-Remove" not in m.data
        assert b"X-Macros: i=" + qid.encode() + b",j=relay.test,{client_addr}=127.0.0.1,{daemon_name}=smtp," \
               b"{mail_addr}=alice@example.com\r\n" in m.data
        assert m.data.endswith(b"\r\n\r\nhello\r\n")
        nursery.cancel_scope.cancel()


async def test_body_replacement_and_envelope_changes_are_delivered(tmp_path: Path, milter: int) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter)
        got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"],
                                message("body", body="the client's body\r\n" * 2000))
        assert got["data"][0] == 250
        got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test", "gone@dest.test"],
                                message("envelope"))
        assert got["data"][0] == 250
        first, second = await hop.wait_messages(2)
        assert first.data.endswith(b"\r\n\r\nthe body the milter wrote\r\nline two\r\n")
        assert b"the client's body" not in first.data
        assert second.sender == "new-sender@example.org"
        assert sorted(second.recipients) == ["added@dest.test", "bob@dest.test"]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("subject", "code", "text"), [
    ("reject", 550, b"5.7.1 Command rejected"),
    ("tempfail", 451, b"4.7.1 Service unavailable - try again later"),
    ("custom", 554, b"5.7.0 custom words"),
])
async def test_end_of_message_refusals_store_nothing(tmp_path: Path, milter: int, subject: str, code: int,
                                                     text: bytes) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter)
        refused = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], message(subject))
        assert refused["data"] == (code, text)
        got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], message("after"))
        assert got["data"][0] == 250
        (m,) = await hop.wait_messages(1)
        assert b"Subject: after" in m.data
        nursery.cancel_scope.cancel()


async def test_mail_and_rcpt_verdicts(tmp_path: Path, milter: int) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter)
        port = relay.ports[0]
        got = await transaction(port, "reject-mail@example.com", ["bob@dest.test"], message("x"))
        assert got["mail"] == (550, b"5.7.1 Command rejected")
        got = await transaction(port, "tempfail-mail@example.com", ["bob@dest.test"], message("x"))
        assert got["mail"] == (451, b"4.7.1 Service unavailable - try again later")
        got = await transaction(port, "alice@example.com",
                                ["reject-rcpt@dest.test", "custom-rcpt@dest.test", "bob@dest.test"], message("rcpt"))
        assert got["rcpt:reject-rcpt@dest.test"] == (550, b"5.7.1 Command rejected")
        assert got["rcpt:custom-rcpt@dest.test"] == (550, b"5.1.1 no such user here")
        assert got["data"][0] == 250
        (m,) = await hop.wait_messages(1)
        assert m.recipients == ["bob@dest.test"]
        nursery.cancel_scope.cancel()


async def test_discard_accept_and_quarantine(tmp_path: Path, milter: int) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter)
        port = relay.ports[0]
        discarded = await transaction(port, "alice@example.com", ["bob@dest.test"], message("discard"))
        assert discarded["data"][0] == 250
        held = await transaction(port, "alice@example.com", ["bob@dest.test"], message("quarantine"))
        assert held["data"][0] == 250
        accepted = await transaction(port, "alice@example.com", ["bob@dest.test"], message("accept"))
        assert accepted["data"][0] == 250
        (m,) = await hop.wait_messages(1)
        assert b"Subject: accept" in m.data and b"X-Test-Milter" not in m.data  # ACCEPT: asked nothing more
        found = await relay.aspool.find(int(queue_id(held["data"]), 16))
        assert found.held
        with pytest.raises(LookupError):
            await relay.aspool.find(int(queue_id(discarded["data"]), 16))
        assert len(hop.messages) == 1
        nursery.cancel_scope.cancel()


async def test_a_slow_milter_costs_its_session_the_default_and_no_other_session(tmp_path: Path,
                                                                                milter: int) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter, milter_command_timeout='"2s"')
        port = relay.ports[0]
        finished: list[str] = []

        async def slow() -> None:
            refused = await transaction(port, "alice@example.com", ["bob@dest.test"], message("slow"))
            assert refused["data"] == (451, b"4.7.1 Service unavailable - try again later")
            finished.append("slow")

        async def beside() -> None:
            for i in range(3):
                got = await transaction(port, "alice@example.com", ["bob@dest.test"], message(f"quick {i}"))
                assert got["data"][0] == 250
            finished.append("quick")

        async with trio.open_nursery() as both:
            both.start_soon(slow)
            both.start_soon(beside)
        assert finished == ["quick", "slow"]
        got = await transaction(port, "alice@example.com", ["bob@dest.test"], message("progress"))
        assert got["data"][0] == 250  # 3 s of progress notes, each within the 2 s per reply
        await hop.wait_messages(4)
        nursery.cancel_scope.cancel()


async def test_the_whole_message_timeout_holds_however_often_the_milter_reports_progress(tmp_path: Path,
                                                                                         milter: int) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter, milter_command_timeout='"2s"',
                                      milter_message_timeout='"1s"')
        got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], message("progress"))
        assert got["data"] == (451, b"4.7.1 Service unavailable - try again later")
        assert hop.messages == []
        nursery.cancel_scope.cancel()


async def test_a_milter_on_a_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "milter.sock"
    daemon = Daemon([SYSTEM_PYTHON, str(SUPPORT / "milter_filter.py"), f"unix:{path}"], tmp_path / "milter.log")
    daemon.start([path])
    try:
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            hop_port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"},
                               extra=f'\n[filters]\nsmtp_milters = ["unix:{path}"]\n')
            relay = await start_relay(nursery, cfg)
            got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], message("unix"))
            assert got["data"][0] == 250
            (m,) = await hop.wait_messages(1)
            assert b"X-Test-Milter: seen" in m.data
            nursery.cancel_scope.cancel()
    finally:
        daemon.stop()


@pytest.mark.parametrize(("action", "mail_reply", "delivered"), [
    ("tempfail", (451, b"4.7.1 Service unavailable - try again later"), False),
    ("reject", (554, b"5.7.1 Service unavailable, message rejected"), False),
    ("accept", (250, b"2.1.0 Ok"), True),
])
async def test_a_milter_that_is_down_gets_the_failure_default(tmp_path: Path, action: str,
                                                              mail_reply: tuple[int, bytes], delivered: bool) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, free_port(), milter_default_action=f'"{action}"')
        got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], message("down"))
        assert got["mail"][0] == mail_reply[0] and got["mail"][1] == mail_reply[1]
        if delivered:
            (m,) = await hop.wait_messages(1)
            assert b"X-Test-Milter" not in m.data
        nursery.cancel_scope.cancel()


def _refused_at_data(port: int, sender: str) -> dict[str, tuple[int, bytes]]:
    """MAIL, RCPT, DATA by hand (smtplib's ``data`` would send the content whatever DATA was answered); then a
    clean message in the same session, after RSET."""
    got: dict[str, tuple[int, bytes]] = {}
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.ehlo("client.test")
        s.mail(sender)
        s.rcpt("bob@dest.test")
        got["data"] = s.docmd("DATA")
        got["rset"] = s.rset()
        s.mail("alice@example.com")
        s.rcpt("bob@dest.test")
        got["next"] = s.data(message("after a refused DATA"))
    return got


@pytest.mark.parametrize(("sender", "reply"), [
    ("reject-data@example.com", (550, b"5.7.1 Command rejected")),
    ("tempfail-data@example.com", (451, b"4.7.1 Service unavailable - try again later")),
    ("custom-data@example.com", (550, b"5.7.2 refused at data")),
])
async def test_a_refusal_at_data_is_the_answer_to_data_instead_of_354(tmp_path: Path, milter: int, sender: str,
                                                                      reply: tuple[int, bytes]) -> None:
    async with trio.open_nursery() as nursery:
        relay, hop = await relay_with(nursery, tmp_path, milter)
        got = await trio.to_thread.run_sync(_refused_at_data, relay.ports[0], sender)
        assert got["data"] == reply
        assert got["rset"][0] == 250
        assert got["next"][0] == 250
        (m,) = await hop.wait_messages(1)
        assert m.sender == "alice@example.com" and b"Subject: after a refused DATA" in m.data
        nursery.cancel_scope.cancel()
