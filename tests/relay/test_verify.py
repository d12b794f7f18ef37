"""Recipient verification at RCPT: the next hop is asked (MAIL, RCPT, RSET, never DATA) and its answer cached."""

from __future__ import annotations

import smtplib
import socket
from pathlib import Path
from typing import Any

import trio
from dns_server import DnsServer
from process_support import RelayProcess
from relay_support import DeliveryWatch, NextHop, SilentHop, write_relay_config

from mta.config import load_config
from mta.process.relay import Relay
from mta.smtp.common import Reply
from spool import Status


def policy(stage: str, value: Any) -> Reply | None:
    if stage == "rcpt" and value.startswith("nobody@"):
        return Reply(550, "5.1.1", "No such user here")
    if stage == "rcpt" and value.startswith("later@"):
        return Reply(450, "4.2.1", "Mailbox busy")
    return None


def config_for(tmp_path: Path, routes: dict[str, str], verify: str) -> Path:
    path = write_relay_config(tmp_path, {**routes, "src.test": "maildir:bounces"})
    path.write_text(path.read_text() + f'\n[recipients]\nverify = [{verify}]\nverify_timeout = "5s"\n')
    return path


def rcpt_replies(port: int, recipients: list[str]) -> list[tuple[int, bytes]]:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.ehlo("client.test")
        client.mail("s@src.test")
        replies = [client.rcpt(r) for r in recipients]
        client.rset()
        return replies


def send(port: int, recipient: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        assert client.sendmail("s@src.test", [recipient], b"Subject: v\r\n\r\nverified\r\n") == {}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_next_hop_is_asked_once_and_its_no_refuses_at_rcpt(tmp_path: Path) -> None:
    hop = NextHop(policy)
    async with trio.open_nursery() as nursery:
        port = await hop.start(nursery)
        down = closed_port()
        path = config_for(tmp_path, {"far.test": f"smtp://127.0.0.1:{port}?tls=none",
                                     "down.test": f"smtp://127.0.0.1:{down}?tls=none",
                                     "other.test": f"smtp://127.0.0.1:{port}?tls=none"}, '"far.test", "down.test"')
        relay: Relay = await nursery.start(Relay(load_config(str(path))).run)
        assert relay.server is not None
        verifier = relay.server.recipient_check.verifier
        watch = DeliveryWatch(relay)
        replies = await trio.to_thread.run_sync(rcpt_replies, relay.ports[0], [
            "known@far.test", "nobody@far.test", "later@far.test", "x@down.test", "nobody@other.test"])
        codes = [code for code, _ in replies]
        assert codes == [250, 550, 450, 450, 250]  # other.test is not verified: its next hop decides later
        assert replies[1][1] == (b"5.1.1 <nobody@far.test>: Recipient address rejected: undeliverable address: "
                                 b"550 5.1.1 No such user here")
        assert replies[2][1].startswith(b"4.1.1 <later@far.test>: Recipient address rejected: unverified address")
        assert replies[3][1].startswith(b"4.1.1 <x@down.test>")
        assert verifier.probes == 3  # far.test three times; down.test never connected
        # Answers are cached (yes and no); a temporary failure is not, so it is asked again.
        replies = await trio.to_thread.run_sync(rcpt_replies, relay.ports[0], [
            "known@far.test", "NOBODY@far.test", "later@far.test"])
        assert [code for code, _ in replies] == [250, 550, 450]
        assert verifier.probes == 4
        assert hop.messages == []  # probes never send DATA
        await trio.to_thread.run_sync(send, relay.ports[0], "known@far.test")
        await watch.wait_for(Status.DELIVERED, recipient="known@far.test")
        nursery.cancel_scope.cancel()
    (message,) = hop.messages
    assert message.recipients == ["known@far.test"]
    assert hop.rsets >= 4  # each probe ended its transaction with RSET


async def test_a_next_hop_that_never_answers_costs_the_rcpt_a_450_within_verify_timeout(tmp_path: Path) -> None:
    silent = SilentHop()
    async with trio.open_nursery() as nursery:
        port = await silent.start(nursery)
        path = config_for(tmp_path, {"slow.test": f"smtp://127.0.0.1:{port}?tls=none"}, '"slow.test"')
        path.write_text(path.read_text().replace('verify_timeout = "5s"', 'verify_timeout = "1s"'))
        relay: Relay = await nursery.start(Relay(load_config(str(path))).run)
        with trio.fail_after(30):
            ((code, text),) = await trio.to_thread.run_sync(rcpt_replies, relay.ports[0], ["a@slow.test"])
        assert silent.connected.is_set()
        silent.release()
        nursery.cancel_scope.cancel()
    assert code == 450 and text.startswith(b"4.1.1 <a@slow.test>")


async def test_an_mx_routed_domain_is_verified_at_its_mail_hosts_in_preference_order(tmp_path: Path) -> None:
    """A backup MX's case: the first mail host is down, the second (the primary's stand-in) answers."""
    hop = NextHop(policy)
    dns_server = DnsServer()
    async with trio.open_nursery() as nursery:
        port = await hop.start(nursery)
        dns_port = await nursery.start(dns_server.serve)
        dns_server.mx("mx.test", 10, "down.mx.test")
        dns_server.mx("mx.test", 20, "up.mx.test")
        dns_server.a("down.mx.test", "127.0.0.2")  # nothing listens there on the port
        dns_server.a("up.mx.test", "127.0.0.1")
        path = config_for(tmp_path, {"mx.test": "mx?tls=none"}, '"mx.test"')
        path.write_text(path.read_text() + f'\n[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\n')
        relay: Relay = await nursery.start(Relay(load_config(str(path))).run)
        replies = await trio.to_thread.run_sync(rcpt_replies, relay.ports[0], ["known@mx.test", "nobody@mx.test"])
        nursery.cancel_scope.cancel()
    assert [code for code, _ in replies] == [250, 550]
    assert replies[1][1].startswith(b"5.1.1 <nobody@mx.test>: Recipient address rejected: undeliverable address: "
                                    b"550 5.1.1 No such user here")
    assert hop.messages == []


async def test_answers_are_shared_by_relays_and_kept_across_a_restart(tmp_path: Path) -> None:
    """Two relays with their own spools and one ``verify_cache`` file, then both gone and a third started (a
    restart's state: nothing in memory, the file on disk): the next hop is probed once per address, whichever
    relay asks. (A relay stopped inside this process keeps its spool's lock, so the third has a spool of its
    own; the cache file is what carries over.)"""
    hop = NextHop(policy)
    cache = tmp_path / "verify-cache"
    async with trio.open_nursery() as nursery:
        port = await hop.start(nursery)
        configs = []
        for name in ("one", "two", "three"):
            (tmp_path / name).mkdir()
            path = config_for(tmp_path / name, {"far.test": f"smtp://127.0.0.1:{port}?tls=none"}, '"far.test"')
            path.write_text(path.read_text() + f'verify_cache = "{cache}"\n')
            configs.append(load_config(str(path)))
        async with trio.open_nursery() as first_life:
            one: Relay = await first_life.start(Relay(configs[0]).run)
            replies = await trio.to_thread.run_sync(rcpt_replies, one.ports[0], ["known@far.test", "nobody@far.test"])
            assert [code for code, _ in replies] == [250, 550]
            assert one.server is not None and one.server.recipient_check.verifier.probes == 2
            two: Relay = await first_life.start(Relay(configs[1]).run)
            replies = await trio.to_thread.run_sync(rcpt_replies, two.ports[0], ["KNOWN@far.test", "nobody@far.test",
                                                                                  "new@far.test"])
            assert [code for code, _ in replies] == [250, 550, 250]
            assert two.server is not None and two.server.recipient_check.verifier.probes == 1  # new@ only
            first_life.cancel_scope.cancel()
        again: Relay = await nursery.start(Relay(configs[2]).run)  # nothing in memory, the same file
        replies = await trio.to_thread.run_sync(rcpt_replies, again.ports[0], ["known@far.test", "nobody@far.test",
                                                                                "new@far.test"])
        assert [code for code, _ in replies] == [250, 550, 250]
        assert replies[1][1].endswith(b"550 5.1.1 No such user here")  # the next hop's words, from the file
        assert again.server is not None and again.server.recipient_check.verifier.probes == 0
        assert hop.rsets == 3  # three probes in all, one per address
        nursery.cancel_scope.cancel()
    assert oct(cache.stat().st_mode & 0o777) == "0o600"


async def test_a_killed_and_restarted_relay_process_probes_no_address_again(tmp_path: Path) -> None:
    """``mta serve`` as a child process, killed with SIGKILL and started again on the same spool: the answers
    in ``verify_cache`` are what the new process goes by (the next hop sees one probe per address)."""
    hop = NextHop(policy)
    async with trio.open_nursery() as nursery:
        port = await hop.start(nursery)
        path = config_for(tmp_path, {"far.test": f"smtp://127.0.0.1:{port}?tls=none"}, '"far.test"')
        relay = RelayProcess(path)
        await relay.start(nursery)
        replies = await trio.to_thread.run_sync(rcpt_replies, relay.port, ["known@far.test", "nobody@far.test"])
        assert [code for code, _ in replies] == [250, 550]
        assert hop.rsets == 2  # one probe each (the client's own RSET is the relay's, not the hop's)
        await relay.kill()
        await relay.start(nursery)
        replies = await trio.to_thread.run_sync(rcpt_replies, relay.port, ["known@far.test", "nobody@far.test",
                                                                            "new@far.test"])
        assert [code for code, _ in replies] == [250, 550, 250]
        assert hop.rsets == 3  # new@ only
        assert (tmp_path / "spool" / "verify-cache").is_file()
        nursery.cancel_scope.cancel()
