"""Recipient tables and aliases: 550 5.1.1 at RCPT for an unknown local user, expansion, loops, live re-reads."""

from __future__ import annotations

import os
import smtplib
from pathlib import Path

import pytest
import trio
from process_support import run_mta
from relay_support import DeliveryWatch, write_relay_config

from mta.config import Config, ConfigError, load_config
from mta.process.relay import Relay
from mta.process.reload import reload
from mta.process.startup import check_start
from mta.recipients import maps
from mta.recipients.table import Expanded, Refused, Table, TableError, parse, table_of
from mta.smtp.common import Reply
from spool import Status

TABLE = """\
# users of d.test
alice@d.test
bob@d.test
Carol@D.test   carol@d.test, carol@far.example   # keeps a copy, sends one on
team@d.test    alice@d.test, bob@d.test
all@d.test     team@d.test, carol@d.test, alice@d.test
ping@d.test    pong@d.test
pong@d.test    ping@d.test
"""


def table(text: str = TABLE) -> Table:
    return table_of(parse(text.splitlines(), "t"))


def expand(address: str, text: str = TABLE, depth: int = 10, fanout: int = 100) -> Expanded | Refused:
    return table(text).expand(address, depth=depth, fanout=fanout)


def test_an_address_in_the_table_is_itself_and_an_unknown_one_of_its_domain_is_refused() -> None:
    assert expand("alice@d.test") == Expanded(("alice@d.test",))
    assert expand("ALICE@D.TEST") == Expanded(("ALICE@D.TEST",))  # compared without case, kept as written
    refused = expand("ghost@d.test")
    assert isinstance(refused, Refused) and refused.why == "unknown_recipient"
    assert (refused.reply.code, refused.reply.enhanced) == (550, "5.1.1")
    assert expand("anyone@other.test") == Expanded(("anyone@other.test",))  # a domain the table does not know


def test_aliases_expand_depth_first_without_duplicates() -> None:
    assert expand("team@d.test") == Expanded(("alice@d.test", "bob@d.test"))
    assert expand("carol@d.test") == Expanded(("carol@d.test", "carol@far.example"))
    assert expand("all@d.test") == Expanded(("alice@d.test", "bob@d.test", "carol@d.test", "carol@far.example"))


def test_a_loop_a_chain_too_deep_and_too_many_recipients_are_refused() -> None:
    loop = expand("ping@d.test")
    assert isinstance(loop, Refused) and loop.why == "alias_loop"
    assert loop.reply == Reply(550, "5.4.6", "<ping@d.test>: alias loop (ping@d.test -> pong@d.test -> ping@d.test)")
    deep = expand("all@d.test", depth=1)
    assert isinstance(deep, Refused) and (deep.why, deep.reply.enhanced) == ("alias_depth", "5.4.6")
    wide = expand("all@d.test", fanout=3)
    assert isinstance(wide, Refused) and (wide.why, wide.reply.code, wide.reply.enhanced) == (
        "alias_fanout", 452, "4.5.3")


@pytest.mark.parametrize(("text", "problem"), [
    ("alice@d.test\nalice@D.TEST\n", "t:2: alice@D.TEST is listed twice"),
    ("alice\n", "t:1: 'alice' is not an address"),
    ("team@d.test <bob@d.test>\n", "t:1: '<bob@d.test>' is not an address"),
])
def test_a_bad_table_is_named_by_file_and_line(text: str, problem: str) -> None:
    with pytest.raises(TableError) as info:
        table(text)
    assert str(info.value).startswith(problem)


def test_a_table_that_does_not_read_stops_the_start_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "recipients").write_text("alice@d.test\nnot an address\n")
    with pytest.raises(ConfigError, match=r"recipients\.tables: .*recipients:2: 'not' is not an address"):
        check_start(_config(tmp_path), listen=False)


def _config(tmp_path: Path) -> Config:
    """A relay for d.test (Maildirs in md/) whose recipients are the table ``recipients``, from a file (reload)."""
    path = write_relay_config(tmp_path, {"d.test": "maildir:md", "far.example": "maildir:far",
                                         "src.test": "maildir:bounces"})
    path.write_text(path.read_text() + '\n[recipients]\ntables = ["recipients"]\n')
    return load_config(str(path))


def rcpt_replies(port: int, recipients: list[str]) -> list[tuple[int, bytes]]:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.ehlo("client.test")
        client.mail("s@src.test")
        replies = [client.rcpt(r) for r in recipients]
        client.rset()
        return replies


def send(port: int, recipients: list[str]) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        assert client.sendmail("s@src.test", recipients, b"Subject: t\r\n\r\nto the table\r\n") == {}


async def test_the_relay_refuses_unknown_users_expands_aliases_and_refuses_loops(tmp_path: Path) -> None:
    (tmp_path / "recipients").write_text(TABLE)
    async with trio.open_nursery() as nursery:
        relay: Relay = await nursery.start(Relay(_config(tmp_path)).run)
        watch = DeliveryWatch(relay)
        port = relay.ports[0]
        replies = await trio.to_thread.run_sync(rcpt_replies, port, ["ghost@d.test", "ping@d.test", "team@d.test"])
        assert replies[0][0] == 550 and replies[0][1].startswith(b"5.1.1 <ghost@d.test>: Recipient address rejected")
        assert replies[1][0] == 550 and replies[1][1].startswith(b"5.4.6 <ping@d.test>: alias loop")
        assert replies[2][0] == 250
        await trio.to_thread.run_sync(send, port, ["team@d.test"])  # one RCPT, two recipients in the envelope
        await watch.wait_for(Status.DELIVERED, recipient="alice@d.test")
        await watch.wait_for(Status.DELIVERED, recipient="bob@d.test")
        nursery.cancel_scope.cancel()
    for user in ("alice", "bob"):
        (mail,) = (tmp_path / "md" / user / "new").iterdir()
        assert b"to the table" in mail.read_bytes()
    assert not (tmp_path / "md" / "team").exists()


async def test_an_edited_table_is_used_without_a_restart_and_a_bad_edit_keeps_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "recipients"
    path.write_text("alice@d.test\n")
    async with trio.open_nursery() as nursery:
        relay: Relay = await nursery.start(Relay(_config(tmp_path)).run)
        assert relay.server is not None
        port = relay.ports[0]
        assert (await trio.to_thread.run_sync(rcpt_replies, port, ["dave@d.test"]))[0][0] == 550
        # An edit moved into place, as a deploy does: seen at the next look at the files (made due at once here).
        monkeypatch.setattr(maps, "CHECK_EVERY", 0.0)
        (tmp_path / "new").write_text("alice@d.test\ndave@d.test\n")
        os.replace(tmp_path / "new", path)
        assert (await trio.to_thread.run_sync(rcpt_replies, port, ["dave@d.test"]))[0][0] == 250
        # A bad edit is logged and the table read before stays in use.
        path.write_text("alice@d.test\ndave@d.test\nbroken line here\n")
        assert [c for c, _ in await trio.to_thread.run_sync(rcpt_replies, port, ["dave@d.test", "eve@d.test"])] \
            == [250, 550]
        # SIGHUP (mta reload) reads the tables at once, whatever the time since the last look.
        monkeypatch.setattr(maps, "CHECK_EVERY", 3600.0)
        path.write_text("alice@d.test\neve@d.test\n")
        assert reload(relay)
        assert [c for c, _ in await trio.to_thread.run_sync(rcpt_replies, port, ["dave@d.test", "eve@d.test"])] \
            == [550, 250]
        # A reload whose tables do not read is refused whole, as any config that fails the start checks.
        path.write_text("eve@d.test\neve@d.test\n")
        assert not reload(relay)
        assert [c for c, _ in await trio.to_thread.run_sync(rcpt_replies, port, ["eve@d.test"])] == [250]
        nursery.cancel_scope.cancel()


def test_mta_config_check_names_a_bad_table_by_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "recipients").write_text("alice@d.test\nalice@d.test\n")
    path = write_relay_config(tmp_path, {"d.test": "maildir:md"})
    path.write_text(path.read_text() + '\n[recipients]\ntables = ["recipients"]\n')
    run = run_mta("config", "check", "--config", str(path), cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines() == [
        f"mta: {path}: recipients.tables: {tmp_path}/recipients:2: alice@d.test is listed twice"]


async def test_strict_local_refuses_every_unlisted_recipient_of_a_local_domain(tmp_path: Path) -> None:
    (tmp_path / "recipients").write_text("alice@d.test\n")
    path = write_relay_config(tmp_path, {"d.test": "maildir:md", "e.test": "maildir:md", "far.example": "maildir:far",
                                         "src.test": "maildir:bounces", "*": "discard"})
    path.write_text(path.read_text() + '\n[recipients]\ntables = ["recipients"]\nstrict_local = true\n')
    async with trio.open_nursery() as nursery:
        relay: Relay = await nursery.start(Relay(load_config(str(path))).run)
        replies = await trio.to_thread.run_sync(rcpt_replies, relay.ports[0], [
            "alice@d.test", "bob@e.test", "anyone@elsewhere.test", "postmaster"])
        nursery.cancel_scope.cancel()
    # e.test has no address in the table but is local: refused; a relayed domain and the postmaster are not.
    assert [code for code, _ in replies] == [250, 550, 250, 250]
