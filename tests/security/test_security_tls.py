"""STARTTLS in both directions, against real clients and a real next hop (docs/security.md, "TLS")."""

from __future__ import annotations

import logging
import os
import smtplib
import ssl
import subprocess
from pathlib import Path

import pytest
import trio
import trustme
from relay_support import DeliveryWatch, NextHop, RawClient, relay_config, start_relay

from spool.format.record import Status


def tls_extra(tmp_path: Path, ca: trustme.CA) -> str:
    cert = ca.issue_cert("relay.test", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "relay.pem"))
    return f'tls_cert = "{tmp_path / "relay.pem"}"\ntls_key = "{tmp_path / "relay.pem"}"\n'


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def hop_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    return ctx


def only_message(box: Path) -> bytes:
    (name,) = os.listdir(box)
    return (box / name).read_bytes()


# ---------------------------------------------------------------- server side


async def test_swaks_starttls_delivers_and_the_received_header_says_esmtps(tmp_path: Path, ca: trustme.CA) -> None:
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"}, extra=tls_extra(tmp_path, ca))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        run = await trio.to_thread.run_sync(lambda: subprocess.run(
            ["swaks", "--server", f"127.0.0.1:{relay.ports[0]}", "--tls", "--to", "someone@localhost",
             "--from", "s@example.org", "--header", "Subject: over tls", "--timeout", "30"],
            capture_output=True, text=True, timeout=60, check=False))
        assert run.returncode == 0, run.stdout + run.stderr
        assert "<-  220 2.0.0 Ready to start TLS" in run.stdout and " ~> MAIL FROM:<s@example.org>" in run.stdout
        assert "TLS started" in run.stdout
        await watch.wait_for(Status.DELIVERED, 1)
        assert b"with ESMTPS" in only_message(tmp_path / "maildir" / "someone" / "new")
        nursery.cancel_scope.cancel()


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion:DeprecationWarning")
async def test_tls_below_1_2_is_refused_and_the_default_client_gets_1_2_or_later(
        tmp_path: Path, ca: trustme.CA) -> None:
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"}, extra=tls_extra(tmp_path, ca))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        old = client_context(ca)
        old.set_ciphers("DEFAULT:@SECLEVEL=0")  # so that it is the server, not our own OpenSSL, that says no
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.command(b"EHLO old.example")
        assert (await c.command(b"STARTTLS"))[0].startswith(b"220")
        with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
            await c.starttls(old)
        await c.aclose()

        def modern() -> str | None:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                s.starttls(context=client_context(ca))
                assert isinstance(s.sock, ssl.SSLSocket)
                return s.sock.version()

        assert await trio.to_thread.run_sync(modern) in ("TLSv1.2", "TLSv1.3")
        nursery.cancel_scope.cancel()


async def test_the_ehlo_after_starttls_forgets_the_one_before(tmp_path: Path, ca: trustme.CA) -> None:
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"}, extra=tls_extra(tmp_path, ca))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        assert b"250 STARTTLS" in await c.command(b"EHLO before.example")
        assert (await c.command(b"STARTTLS"))[0].startswith(b"220")
        await c.starttls(client_context(ca))
        assert (await c.command(b"MAIL FROM:<a@example.org>"))[0].startswith(b"503")
        caps = await c.command(b"EHLO after.example")
        assert not any(b"STARTTLS" in line for line in caps)
        for line in (b"MAIL FROM:<a@example.org>", b"RCPT TO:<someone@localhost>"):
            assert (await c.command(line))[0].startswith(b"250")
        assert (await c.command(b"DATA"))[0].startswith(b"354")
        assert (await c.command(b"Subject: t\r\n\r\nhi\r\n."))[0].startswith(b"250")
        await c.aclose()
        await watch.wait_for(Status.DELIVERED, 1)
        text = only_message(tmp_path / "maildir" / "someone" / "new")
        assert b"from after.example" in text and b"before.example" not in text
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("injected", [b"RSET\r\n", b"MAIL FROM:<injected@example.org>\r\n"])
async def test_commands_pipelined_behind_starttls_are_discarded_cve_2011_0411(
        tmp_path: Path, ca: trustme.CA, injected: bytes) -> None:
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"}, extra=tls_extra(tmp_path, ca))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.command(b"EHLO x.example")
        await c.send(b"STARTTLS\r\n" + injected)  # one write: one TCP segment on loopback
        assert (await c.reply())[0].startswith(b"220")
        await c.starttls(client_context(ca))  # raises if anything followed the 220 in plaintext
        first = await c.command(b"EHLO x.example")
        assert first[0].startswith(b"250-relay.test"), first  # not a late answer to the injected command
        # An injected MAIL FROM would make this RCPT acceptable.
        assert (await c.command(b"RCPT TO:<someone@localhost>"))[0].startswith(b"503")
        assert (await c.command(b"NOOP"))[0].startswith(b"250")
        await c.aclose()
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- client side


async def test_route_tls_require_never_sends_in_clear_to_a_hop_without_starttls(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=require"}))
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "secret@far.example")
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        assert "does not offer STARTTLS" in deferred.reply
        assert hop.connections >= 1 and hop.messages == []
        nursery.cancel_scope.cancel()


async def test_route_tls_verify_delivers_to_a_trusted_hop_and_logs_it(
        tmp_path: Path, ca: trustme.CA, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    async with trio.open_nursery() as nursery:
        hop = NextHop(ssl_context=hop_context(ca))
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=verify"},
                           extra=f'[delivery]\ntls_ca_file = "{tmp_path / "ca.pem"}"\n')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "v@far.example")
        (done,) = await watch.wait_for(Status.DELIVERED, 1)
        assert done.next_hop.endswith("tls=verified")
        (msg,) = await hop.wait_messages(1)
        assert msg.tls
        lines = [r.getMessage() for r in caplog.records if "to=<v@far.example>" in r.getMessage()]
        assert any("tls=verified" in line and "status=sent" in line for line in lines), lines
        nursery.cancel_scope.cancel()


async def test_route_tls_verify_defers_on_an_untrusted_certificate(tmp_path: Path, ca: trustme.CA) -> None:
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    async with trio.open_nursery() as nursery:
        hop = NextHop(ssl_context=hop_context(trustme.CA()))  # a CA the relay does not trust
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}?tls=verify"},
                           extra=f'[delivery]\ntls_ca_file = "{tmp_path / "ca.pem"}"\n')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "v@far.example")
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        assert "TLS handshake" in deferred.reply and "CERTIFICATE_VERIFY_FAILED" in deferred.reply
        assert hop.messages == []
        nursery.cancel_scope.cancel()


async def test_opportunistic_tls_encrypts_when_offered(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop(ssl_context=hop_context(trustme.CA()))  # untrusted: opportunistic does not check
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "o@far.example")
        (done,) = await watch.wait_for(Status.DELIVERED, 1)
        assert done.next_hop.endswith("tls=encrypted")
        (msg,) = await hop.wait_messages(1)
        assert msg.tls
        nursery.cancel_scope.cancel()


async def send(port: int, rcpt: str) -> None:
    def run() -> None:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.sendmail("a@example.org", [rcpt], "Subject: s\r\n\r\nbody\r\n")

    await trio.to_thread.run_sync(run)
