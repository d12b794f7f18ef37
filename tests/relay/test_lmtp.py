"""LMTP delivery (RFC 2033) into Dovecot's LMTP service: one outcome per recipient, over TCP and a unix socket."""

from __future__ import annotations

import functools
import smtplib
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from dovecot_support import Dovecot
from relay_support import DeliveryWatch, relay_config, write_relay_config

from mta.config import ConfigError, LmtpRoute, format_route, load_config, parse_route
from mta.delivery.lmtp_transport import LmtpTransport
from mta.process.relay import Relay, where_mail_goes
from spool import Status

MESSAGE = b"From: s@src.test\r\nTo: alice@d.test\r\nSubject: lmtp\r\n\r\nhello over LMTP\r\n"


@pytest.fixture(scope="module")
def dovecot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dovecot]:
    server = Dovecot(tmp_path_factory.mktemp("dovecot"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_lmtp_routes_are_read_and_written_back() -> None:
    assert parse_route("lmtp://127.0.0.1") == LmtpRoute("127.0.0.1", 24)
    assert parse_route("lmtp://[::1]:2424") == LmtpRoute("::1", 2424)
    assert parse_route("lmtp:/run/dovecot/lmtp") == LmtpRoute(socket="/run/dovecot/lmtp")
    assert parse_route("lmtp:var/lmtp", "/etc/logspool") == LmtpRoute(socket="/etc/logspool/var/lmtp")
    for text in ("lmtp://127.0.0.1:24", "lmtp://[::1]:2424", "lmtp:/run/dovecot/lmtp"):
        assert format_route(parse_route(text)) == text
    with pytest.raises(ConfigError, match="lmtp:"):
        parse_route("lmtp:")


def send(port: int, recipients: list[str], body: bytes = MESSAGE) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        refused = client.sendmail("s@src.test", recipients, body)
        assert refused == {}


async def relay_with(nursery: trio.Nursery, tmp_path: Path, route: str) -> tuple[Relay, DeliveryWatch]:
    config = relay_config(str(tmp_path), {"d.test": route, "src.test": "maildir:bounces"})
    relay: Relay = await nursery.start(Relay(config).run)
    return relay, DeliveryWatch(relay)


async def test_one_transaction_delivers_defers_and_bounces_each_recipient_on_its_own(
        tmp_path: Path, dovecot: Dovecot) -> None:
    before = len(dovecot.messages("alice"))
    async with trio.open_nursery() as nursery:
        relay, watch = await relay_with(nursery, tmp_path, f"lmtp://127.0.0.1:{dovecot.port}")
        port = relay.ports[0]
        await trio.to_thread.run_sync(send, port, ["alice@d.test", "full@d.test", "ghost@d.test"])
        (delivered,) = await watch.wait_for(Status.DELIVERED, recipient="alice@d.test")
        (bounced,) = await watch.wait_for(Status.BOUNCED, recipient="ghost@d.test")
        deferred = (await watch.wait_for(Status.DEFERRED, recipient="full@d.test"))[0]
        await watch.wait_for(Status.DELIVERED, recipient="s@src.test")  # the bounce, for ghost alone
        nursery.cancel_scope.cancel()
    # Dovecot's own replies, each recorded as its recipient's outcome, from one LMTP transaction.
    assert (delivered.code, delivered.enhanced) == (250, "2.0.0") and "Saved" in delivered.reply
    assert (bounced.code, bounced.enhanced) == (550, "5.1.1")
    assert (deferred.code, deferred.enhanced) == (452, "4.2.2") and "Quota" in deferred.reply
    assert delivered.next_hop == f"lmtp:[127.0.0.1]:{dovecot.port}"
    (mail,) = dovecot.messages("alice")[before:]
    assert b"hello over LMTP" in mail and b"Subject: lmtp" in mail
    assert dovecot.messages("full") == []
    # The deferred recipient stays queued (not bounced, not delivered); the bounce names only the refused one.
    assert watch.count(Status.BOUNCED, "full@d.test") == 0 and watch.count(Status.DELIVERED, "full@d.test") == 0
    (dsn,) = [p.read_bytes() for p in (tmp_path / "bounces" / "s" / "new").iterdir()]
    assert dsn.count(b"Final-Recipient:") == 1 and b"ghost@d.test" in dsn


async def test_delivery_over_the_unix_socket_and_connection_reuse(tmp_path: Path, dovecot: Dovecot) -> None:
    before = len(dovecot.messages("bob"))
    async with trio.open_nursery() as nursery:
        relay, watch = await relay_with(nursery, tmp_path, f"lmtp:{dovecot.socket}")
        port = relay.ports[0]
        await trio.to_thread.run_sync(send, port, ["bob@d.test"])
        (first,) = await watch.wait_for(Status.DELIVERED, recipient="bob@d.test")
        await trio.to_thread.run_sync(send, port, ["bob@d.test", "carol@d.test"])
        await watch.wait_for(Status.DELIVERED, 2, recipient="bob@d.test")
        await watch.wait_for(Status.DELIVERED, recipient="carol@d.test")
        transport = relay.scheduler.transports["lmtp"]
        assert isinstance(transport, LmtpTransport)
        reused = transport.cache.reused
        nursery.cancel_scope.cancel()
    assert first.next_hop == f"lmtp:{dovecot.socket}"
    assert len(dovecot.messages("bob")) == before + 2
    assert any(b"hello over LMTP" in m for m in dovecot.messages("carol"))
    assert reused >= 1  # the second message went over the first one's connection


async def test_a_mailbox_server_that_is_down_defers(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay, watch = await relay_with(nursery, tmp_path, f"lmtp:{tmp_path}/no-such.sock")
        await trio.to_thread.run_sync(send, relay.ports[0], ["alice@d.test"])
        (deferred,) = await watch.wait_for(Status.DEFERRED, recipient="alice@d.test")
        nursery.cancel_scope.cancel()
    assert deferred.code == 0 and "connect to lmtp:" in deferred.reply


async def test_with_a_table_an_unknown_user_is_refused_at_rcpt_and_an_alias_reaches_two_mailboxes(
        tmp_path: Path, dovecot: Dovecot) -> None:
    (tmp_path / "recipients").write_text("alice@d.test\nbob@d.test\nteam@d.test alice@d.test, bob@d.test\n")
    path = write_relay_config(tmp_path, {"d.test": f"lmtp:{dovecot.socket}", "src.test": "maildir:bounces"})
    path.write_text(path.read_text() + '\n[recipients]\ntables = ["recipients"]\n')
    before = {user: len(dovecot.messages(user)) for user in ("alice", "bob")}
    async with trio.open_nursery() as nursery:
        relay: Relay = await nursery.start(Relay(load_config(str(path))).run)
        watch = DeliveryWatch(relay)

        def transaction() -> dict[str, tuple[int, bytes]]:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as client:
                return client.sendmail("s@src.test", ["ghost@d.test", "team@d.test"], MESSAGE)

        refused = await trio.to_thread.run_sync(transaction)
        await watch.wait_for(Status.DELIVERED, recipient="alice@d.test")
        await watch.wait_for(Status.DELIVERED, recipient="bob@d.test")
        nursery.cancel_scope.cancel()
    assert refused["ghost@d.test"][0] == 550 and refused["ghost@d.test"][1].startswith(b"5.1.1")
    assert watch.count(Status.BOUNCED) == 0  # refused while the client was there: no bounce
    for user in ("alice", "bob"):
        assert len(dovecot.messages(user)) == before[user] + 1


async def test_verification_asks_dovecot_at_rcpt(tmp_path: Path, dovecot: Dovecot) -> None:
    path = write_relay_config(tmp_path, {"d.test": f"lmtp://127.0.0.1:{dovecot.port}", "src.test": "maildir:bounces"})
    path.write_text(path.read_text() + '\n[recipients]\nverify = ["d.test"]\n')
    async with trio.open_nursery() as nursery:
        relay: Relay = await nursery.start(Relay(load_config(str(path))).run)

        def rcpts() -> list[tuple[int, bytes]]:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as client:
                client.ehlo("client.test")
                client.mail("s@src.test")
                return [client.rcpt(r) for r in ("alice@d.test", "ghost@d.test")]

        (alice, ghost) = await trio.to_thread.run_sync(rcpts)
        nursery.cancel_scope.cancel()
    assert alice[0] == 250
    assert ghost[0] == 550
    assert ghost[1].startswith(b"5.1.1 <ghost@d.test>: Recipient address rejected: undeliverable address: "
                               b"550 5.1.1 <ghost@d.test> User doesn't exist")


async def test_a_connection_lost_between_the_replies_keeps_the_answered_recipients_outcomes(tmp_path: Path) -> None:
    """A mailbox server that answers the first recipient after the data and then dies (Dovecot cannot be made to):
    the first is delivered, only the second is deferred, so a retry does not deliver the first again."""

    async def one_reply_then_gone(stream: trio.SocketStream) -> None:
        await stream.send_all(b"220 lmtp.test LMTP\r\n")
        buffer, in_data = b"", False
        answers = {b"LHLO": b"250 lmtp.test\r\n", b"MAIL": b"250 2.1.0 ok\r\n", b"RCPT": b"250 2.1.5 ok\r\n",
                   b"DATA": b"354 go\r\n"}
        while chunk := await stream.receive_some(65536):
            buffer += chunk
            while b"\r\n" in buffer:
                line, buffer = buffer.split(b"\r\n", 1)
                if in_data and line == b".":
                    await stream.send_all(b"250 2.0.0 <alice@d.test> saved\r\n")  # bob's reply never comes
                    await stream.aclose()
                    return
                if not in_data:
                    await stream.send_all(answers.get(line[:4].upper(), b"250 2.0.0 ok\r\n"))
                    in_data = line.upper() == b"DATA"

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, one_reply_then_gone, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        relay, watch = await relay_with(nursery, tmp_path, f"lmtp://127.0.0.1:{port}")
        await trio.to_thread.run_sync(send, relay.ports[0], ["alice@d.test", "bob@d.test"])
        (delivered,) = await watch.wait_for(Status.DELIVERED, recipient="alice@d.test")
        (deferred,) = await watch.wait_for(Status.DEFERRED, recipient="bob@d.test")
        nursery.cancel_scope.cancel()
    assert delivered.code == 250 and "saved" in delivered.reply
    assert deferred.code == 0 and "connection closed by the server" in deferred.reply


def test_the_start_line_says_which_domains_go_over_lmtp(tmp_path: Path) -> None:
    config = relay_config(str(tmp_path), {"d.test": "lmtp:/run/dovecot/lmtp", "e.test": "lmtp://127.0.0.1:24"})
    assert where_mail_goes(config).endswith(
        "local delivery: @d.test over LMTP to /run/dovecot/lmtp, @e.test over LMTP to 127.0.0.1:24")
