"""DKIM signing on the real relay: keys made by ``mta dkim keygen``, published by a DNS server on 127.0.0.1.

Each message the next hop receives is verified by dkimpy's verifier, which
fetches the key over DNS (a real query to ``dns_server.DnsServer``, serving
the TXT record exactly as keygen printed it). docs/security.md, "DKIM signing".
"""

from __future__ import annotations

import logging
import re
import smtplib
from pathlib import Path

import pytest
import trio
from dkim_support import Key, key_config, keygen, opendkim_verdicts, publish, signatures, tag, verified
from dns_server import DnsServer
from relay_support import DeliveryWatch, NextHop, Received, relay_config, start_relay

from mta.smtp.common import Reply
from spool.format.record import Status


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Key]:
    """An RSA and an Ed25519 key for example.com, each made by the real ``mta dkim keygen``."""
    where = tmp_path_factory.mktemp("dkim")
    return {kind: keygen(where, "example.com", selector, kind)
            for kind, selector in (("rsa", "rsa2026"), ("ed25519", "ed2026"))}


def _send(port: int, sender: str, rcpts: list[str], body: bytes, source: str = "127.0.0.1") -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30, source_address=(source, 0)) as s:
        s.sendmail(sender, rcpts, body)


async def send(port: int, sender: str, rcpts: list[str], body: bytes, source: str = "127.0.0.1") -> None:
    await trio.to_thread.run_sync(_send, port, sender, rcpts, body, source)


def message(i: int, sender: str = "Alice <alice@example.com>", size: int = 40) -> bytes:
    return (f"From: {sender}\r\nTo: bob@dest.test\r\nSubject: message {i}\r\nDate: Thu, 26 Nov 2026 10:00:00 +0000"
            f"\r\nMessage-ID: <m{i}@example.com>\r\n\r\n".encode()
            + b"".join(b"line %d of message %d, with  two spaces and a tab\t\r\n" % (n, i) for n in range(size)))


async def test_every_message_verifies_over_dns_with_rsa_and_ed25519(tmp_path: Path, keys: dict[str, Key]) -> None:
    """Both keys sign each message; dkimpy verifies both signatures with the keys it fetched over DNS.

    Small messages are signed from the chunks kept for the body cache; the
    1.6 MB ones are past the cache's item limit, so the relay reads them back
    from the log to sign them.
    """
    async with trio.open_nursery() as nursery:
        dns_server = DnsServer()
        dns_port = await nursery.start(dns_server.serve)
        for k in keys.values():
            publish(dns_server, k.record)
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"},
                           extra=key_config(keys["rsa"], keys["ed25519"]))
        relay = await start_relay(nursery, cfg)
        sent = [message(i, size=40 if i % 2 else 30_000) for i in range(4)]  # 2 KB and 1.6 MB bodies
        for body in sent:
            await send(relay.ports[0], "alice@example.com", ["bob@dest.test"], body)
        got = await hop.wait_messages(len(sent))
        for m in got:
            sigs = signatures(m.data)
            assert [tag(s, "s") for s in sigs] == ["rsa2026", "ed2026"]
            assert [tag(s, "a") for s in sigs] == ["rsa-sha256", "ed25519-sha256"]
            assert all(tag(s, "c") == "relaxed/relaxed" and tag(s, "d") == "example.com" for s in sigs)
            assert tag(sigs[0], "h").split(":") == ["from", "subject", "date", "to", "message-id", "from"]
            assert await verified(m.data, dns_port) == [True, True]
            # The signature sits under the relay's Received:, above the client's data, which is unchanged.
            first, second, rest = m.data.split(b"\r\n", 1)[0], m.data.find(b"DKIM-Signature:"), m.data
            assert first.startswith(b"Received: from") and 0 < second < rest.find(b"From: Alice")
            assert any(rest.endswith(body) for body in sent)
        assert {("rsa2026._domainkey.example.com", "TXT"),
                ("ed2026._domainkey.example.com", "TXT")} <= set(dns_server.queries)
        nursery.cancel_scope.cancel()


async def test_what_the_relay_delivers_opendkim_verifies_at_4_kb_and_100_kb(tmp_path: Path,
                                                                           keys: dict[str, Key]) -> None:
    """The relay signs with both keys; Debian's OpenDKIM (its verifier, ``opendkim -t``) passes both signatures
    of each message the next hop received, at the two sizes the benchmarks use."""
    records = {f"{k.selector}._domainkey.{k.domain}": "".join(re.findall(r'"([^"]*)"', k.record))
               for k in keys.values()}
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"},
                           extra=key_config(keys["rsa"], keys["ed25519"]))
        relay = await start_relay(nursery, cfg)
        sent = [message(1, size=70), message(2, size=1930)]  # 4 KB and 100 KB
        for body in sent:
            await send(relay.ports[0], "alice@example.com", ["bob@dest.test"], body)
        got = await hop.wait_messages(len(sent))
        small, large = sorted(len(m.data) for m in got)
        assert 4_000 < small < 6_000 and 100_000 < large < 110_000
        for i, m in enumerate(got):
            assert len(signatures(m.data)) == 2
            verdicts = await trio.to_thread.run_sync(opendkim_verdicts, m.data, records, tmp_path / f"verify{i}")
            assert verdicts == ["pass", "pass"]
        nursery.cancel_scope.cancel()


async def test_a_message_changed_in_flight_fails_verification(tmp_path: Path, keys: dict[str, Key]) -> None:
    """What a hop between sender and receiver might do: every change of a signed part fails both signatures."""
    async with trio.open_nursery() as nursery:
        dns_server = DnsServer()
        dns_port = await nursery.start(dns_server.serve)
        for k in keys.values():
            publish(dns_server, k.record)
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"},
                           extra=key_config(keys["rsa"], keys["ed25519"]))
        relay = await start_relay(nursery, cfg)
        await send(relay.ports[0], "alice@example.com", ["bob@dest.test"], message(1))
        (m,) = await hop.wait_messages(1)
        data = m.data
        assert await verified(data, dns_port) == [True, True]
        changes = {
            "a body byte": data.replace(b"line 3 of", b"line 8 of"),
            "the subject": data.replace(b"Subject: message 1", b"Subject: message 2"),
            "a From: added on top (over-signed)": data.replace(b"From: Alice", b"From: Mallory <m@evil.test>\r\n"
                                                                               b"From: Alice", 1),
            "a line appended to the body": data + b"click here\r\n",
        }
        for what, changed in changes.items():
            assert changed != data, what
            assert await verified(changed, dns_port) == [False, False], what
        # What relaxed canonicalisation is for: refolding and trailing spaces in transit do not break it.
        refolded = data.replace(b"Subject: message 1", b"Subject:   message\r\n 1").replace(
            b"a tab\t\r\n", b"a tab \r\n")
        assert await verified(refolded, dns_port) == [True, True]
        nursery.cancel_scope.cancel()


async def test_a_retried_message_carries_the_same_signature_bytes(tmp_path: Path, keys: dict[str, Key]) -> None:
    """The next hop answers 451 at the end of data, then 250: both attempts send the same bytes, signature and all."""
    attempts: list[Received] = []

    def policy(stage: str, value: object) -> Reply | None:
        if stage != "data":
            return None
        assert isinstance(value, Received)
        attempts.append(value)
        return Reply(451, "4.3.0", "try again later") if len(attempts) == 1 else None

    async with trio.open_nursery() as nursery:
        dns_server = DnsServer()
        dns_port = await nursery.start(dns_server.serve)
        publish(dns_server, keys["rsa"].record)
        hop = NextHop(policy)
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"}, extra=key_config(keys["rsa"]))
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "alice@example.com", ["bob@dest.test"], message(7))
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        assert deferred.code == 451
        await watch.wait_for(Status.DELIVERED, 1)
        assert len(attempts) == 2
        first, second = attempts
        assert first.data == second.data
        assert len(signatures(second.data)) == 1
        assert await verified(second.data, dns_port) == [True]
        nursery.cancel_scope.cancel()


async def test_only_trusted_clients_mail_is_signed(tmp_path: Path, keys: dict[str, Key]) -> None:
    """A client outside mynetworks writing to a local domain with From: at a signed domain gets no signature;
    neither does mail from a domain without keys, nor with the key inactive."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"},
                           extra=key_config(keys["ed25519"]) + key_config(keys["rsa"], active=False)
                           + '[relay]\nmynetworks = ["127.0.0.1/32"]\nrelay_domains = ["dest.test"]\n')
        relay = await start_relay(nursery, cfg)
        await send(relay.ports[0], "x@outside.test", ["bob@dest.test"], message(1), source="127.0.0.2")
        await send(relay.ports[0], "carol@other.test", ["bob@dest.test"], message(2, "carol@other.test"))
        await send(relay.ports[0], "alice@example.com", ["bob@dest.test"], message(3))
        got = {m.data.split(b"Subject: ")[1][:9]: m.data for m in await hop.wait_messages(3)}
        assert signatures(got[b"message 1"]) == [] and signatures(got[b"message 2"]) == []
        assert [tag(s, "s") for s in signatures(got[b"message 3"])] == ["ed2026"]  # the inactive RSA key did not
        nursery.cancel_scope.cancel()


async def test_a_message_the_signer_cannot_parse_is_delivered_unsigned_and_logged(
        tmp_path: Path, keys: dict[str, Key], caplog: pytest.LogCaptureFixture) -> None:
    """A header line without a colon: the signer refuses to sign it (as dkimpy does); the mail is not refused."""
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"}, extra=key_config(keys["ed25519"]))
        relay = await start_relay(nursery, cfg)
        await send(relay.ports[0], "alice@example.com", ["bob@dest.test"], b"No colon on this line\r\n" + message(5))
        (m,) = await hop.wait_messages(1)
        assert signatures(m.data) == [] and m.data.endswith(message(5))
        (line,) = [r for r in caplog.records if "event=dkim_failed" in r.getMessage()]
        assert line.levelno == logging.WARNING and "not a header field" in line.getMessage()
        nursery.cancel_scope.cancel()
