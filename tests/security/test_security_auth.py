"""SMTP AUTH on the submission ports, against the running relay, with swaks and raw clients (docs/security.md,
"SMTP AUTH"): PLAIN and LOGIN over STARTTLS (587) and implicit TLS (465), AUTH refused before TLS, MAIL refused
before AUTH, wrong passwords answered 535 and rate-limited, an authenticated client relaying where an
unauthenticated one is denied, and the user logged and kept with the message."""

from __future__ import annotations

import base64
import email
import logging
import os
import ssl
import subprocess
from pathlib import Path

import pytest
import trio
import trustme
from dkim_support import Key, key_config, keygen, publish, signatures, tag, verified
from dns_server import DnsServer
from logfmt import events
from relay_support import DeliveryWatch, NextHop, RawClient, relay_config, start_relay, tls_files

from mta.auth.users import add_user
from mta.inbound.session import Port
from mta.process.relay import Relay
from mta.smtp.common import Reply
from spool.format.record import Status
from spool.read import listing as admin
from spool.read.listing import SpoolView

PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def users_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One user, alice (made once: an Argon2 hash takes a third of a second)."""
    path = tmp_path_factory.mktemp("users") / "users"
    add_user(str(path), "alice", PASSWORD)
    return path


def auth_config_extra(tmp_path: Path, ca: trustme.CA, users: Path, *, failures: int = 3, more: str = "",
                      header: bool = True) -> str:
    """The relay port and both submission ports, TLS, ``users``; mynetworks empty: only AUTH lets a client relay."""
    cert, key = tls_files(tmp_path, ca)
    return f"""tls_cert = "{cert}"
tls_key = "{key}"
[relay]
mynetworks = []
[submission]
listen = ["127.0.0.1:0"]
implicit_tls_listen = ["127.0.0.1:0"]
users_file = "{users}"
max_auth_failures = {failures}
auth_failure_delay = "0s"
authenticated_header = {"true" if header else "false"}
{more}
"""


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def plain(user: str, password: str) -> bytes:
    return base64.b64encode(f"\0{user}\0{password}".encode())


def swaks(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["swaks", "--server", f"127.0.0.1:{port}", "--from", "alice@example.org",
                           "--to", "bob@far.example", "--header", "Subject: submitted", "--timeout", "30", *args],
                          capture_output=True, text=True, timeout=60, check=False)


async def tls_client(relay: Relay, ca: trustme.CA, port: Port = Port.SUBMISSION) -> RawClient:
    """A raw client past EHLO over TLS: STARTTLS on 587, or TLS from the first byte on 465."""
    if port is Port.SUBMISSIONS:
        c = await RawClient.connect(relay.ports_of(port)[0])
        tls = trio.SSLStream(c.stream, client_context(ca), server_hostname="relay.test")
        with trio.fail_after(30):
            await tls.do_handshake()
        c.stream = tls
        await c.reply()
    else:
        c = await RawClient.connect(relay.ports_of(port)[0])
        await c.reply()
        await c.command(b"EHLO client.example")
        assert (await c.command(b"STARTTLS"))[0].startswith(b"220")
        await c.starttls(client_context(ca))
    caps = await c.command(b"EHLO client.example")
    assert caps[-1] == b"250 AUTH PLAIN LOGIN" or b"250-AUTH PLAIN LOGIN" in caps
    return c


@pytest.mark.parametrize(("mechanism", "port"), [("PLAIN", Port.SUBMISSION), ("LOGIN", Port.SUBMISSION),
                                                  ("PLAIN", Port.SUBMISSIONS), ("LOGIN", Port.SUBMISSIONS)],
                         ids=["587-plain", "587-login", "465-plain", "465-login"])
async def test_swaks_authenticates_and_relays_to_a_far_domain_and_the_user_goes_with_the_message(
        tmp_path: Path, ca: trustme.CA, users_file: Path, caplog: pytest.LogCaptureFixture,
        mechanism: str, port: Port) -> None:
    caplog.set_level(logging.INFO, logger="mta.smtpd")
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{hop_port}"},
                           extra=auth_config_extra(tmp_path, ca, users_file))
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        tls = "--tls" if port is Port.SUBMISSION else "--tlsc"
        run = await trio.to_thread.run_sync(lambda: swaks(
            relay.ports_of(port)[0], tls, "--auth", mechanism, "--auth-user", "alice", "--auth-password", PASSWORD))
        assert run.returncode == 0, run.stdout + run.stderr
        assert "<~  235 2.7.0 Authentication successful" in run.stdout
        assert "250 2.0.0 Ok: queued as" in run.stdout
        await watch.wait_for(Status.DELIVERED, 1)
        (msg,) = await hop.wait_messages(1)
        assert msg.recipients == ["bob@far.example"]
        assert b"(Authenticated sender: alice)" in msg.data and b"with ESMTPSA" in msg.data
        (auth,) = events(caplog.records, "auth")
        assert (auth["user"], auth["mechanism"], auth["port"]) == ("alice", mechanism, port.value)
        (accepted,) = events(caplog.records, "accepted")
        assert accepted["auth"] == "alice" and accepted["proto"] == "ESMTPSA"
        nursery.cancel_scope.cancel()


async def test_an_authenticated_users_mail_is_dkim_signed_and_verifies_over_dns(
        tmp_path: Path, ca: trustme.CA, users_file: Path) -> None:
    """mynetworks is empty: the signature is there because alice authenticated (swaks, AUTH PLAIN after
    STARTTLS on 587); dkimpy verifies it with the key keygen made, fetched from the DNS server on 127.0.0.1."""
    key: Key = keygen(tmp_path, "example.org", "sub2026", "ed25519")
    async with trio.open_nursery() as nursery:
        dns_server = DnsServer()
        dns_port = await nursery.start(dns_server.serve)
        publish(dns_server, key.record)
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{hop_port}"},
                           extra=auth_config_extra(tmp_path, ca, users_file) + key_config(key))
        relay = await start_relay(nursery, cfg)
        run = await trio.to_thread.run_sync(lambda: swaks(
            relay.ports_of(Port.SUBMISSION)[0], "--tls", "--auth", "PLAIN", "--auth-user", "alice",
            "--auth-password", PASSWORD))
        assert run.returncode == 0, run.stdout + run.stderr
        (msg,) = await hop.wait_messages(1)
        (sig,) = signatures(msg.data)
        assert (tag(sig, "d"), tag(sig, "s"), tag(sig, "a")) == ("example.org", "sub2026", "ed25519-sha256")
        assert await verified(msg.data, dns_port) == [True]
        assert ("sub2026._domainkey.example.org", "TXT") in dns_server.queries
        nursery.cancel_scope.cancel()


async def test_an_authenticated_users_message_is_received_with_esmtpsa_and_no_name_by_default(
        tmp_path: Path, ca: trustme.CA, users_file: Path) -> None:
    """RFC 3848: the relay's Received: says ``with ESMTPSA`` (TLS and AUTH) for alice's message; with
    ``authenticated_header`` at its default (false) the header does not name her."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{hop_port}"},
                           extra=auth_config_extra(tmp_path, ca, users_file, header=False))
        relay = await start_relay(nursery, cfg)
        run = await trio.to_thread.run_sync(lambda: swaks(
            relay.ports_of(Port.SUBMISSIONS)[0], "--tlsc", "--auth", "LOGIN", "--auth-user", "alice",
            "--auth-password", PASSWORD))
        assert run.returncode == 0, run.stdout + run.stderr
        queue_id = run.stdout.split("Ok: queued as ", 1)[1].split()[0]
        (msg,) = await hop.wait_messages(1)
        received = email.message_from_bytes(msg.data).get_all("Received") or []
        assert len(received) == 1, received  # the relay's own; swaks adds none
        ours = " ".join(received[0].split())
        assert f"by relay.test with ESMTPSA id {queue_id} for <bob@far.example>;" in ours, ours
        assert "(using TLSv1." in ours and "alice" not in ours and "Authenticated sender" not in ours, ours
        nursery.cancel_scope.cancel()


async def test_auth_before_starttls_gets_538_and_is_not_offered_and_mail_needs_starttls(
        tmp_path: Path, ca: trustme.CA, users_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {}, extra=auth_config_extra(
            tmp_path, ca, users_file)))
        c = await RawClient.connect(relay.ports_of(Port.SUBMISSION)[0])
        await c.reply()
        caps = await c.command(b"EHLO client.example")
        assert not any(b"AUTH" in line for line in caps) and any(b"STARTTLS" in line for line in caps)
        assert await c.command(b"AUTH PLAIN " + plain("alice", PASSWORD)) == [
            b"538 5.7.11 Encryption required for requested authentication mechanism"]
        assert await c.command(b"MAIL FROM:<alice@example.org>") == [b"530 5.7.0 Must issue a STARTTLS command first"]
        await c.aclose()
        run = await trio.to_thread.run_sync(lambda: swaks(
            relay.ports_of(Port.SUBMISSION)[0], "--auth", "PLAIN", "--auth-user", "alice", "--auth-password",
            PASSWORD, "--auth-plaintext"))
        assert run.returncode != 0  # a real client will not send its password where AUTH is not offered
        # "235 2.7.0", not "235": the port swaks names may hold those digits.
        assert "did not advertise authentication" in run.stderr and "235 2.7.0" not in run.stdout, run.stdout
        nursery.cancel_scope.cancel()


async def test_unauthenticated_client_on_587_cannot_mail_and_on_25_is_denied_relay(
        tmp_path: Path, ca: trustme.CA, users_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{hop_port}"},
                                                        extra=auth_config_extra(tmp_path, ca, users_file)))
        c = await tls_client(relay, ca)
        assert await c.command(b"MAIL FROM:<alice@example.org>") == [b"530 5.7.0 Authentication required"]
        await c.aclose()
        run = await trio.to_thread.run_sync(lambda: swaks(relay.ports[0], "--tls"))
        assert "554 5.7.1 Relay access denied" in run.stdout, run.stdout
        c = await RawClient.connect(relay.ports[0])  # the relay port offers no AUTH at all
        await c.reply()
        await c.command(b"EHLO client.example")
        assert await c.command(b"AUTH PLAIN " + plain("alice", PASSWORD)) == [
            b"502 5.5.1 AUTH not available on this port"]
        await c.aclose()
        assert hop.messages == []
        nursery.cancel_scope.cancel()


async def test_wrong_password_is_535_and_after_the_limit_the_address_gets_421(
        tmp_path: Path, ca: trustme.CA, users_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta.smtpd")
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {}, extra=auth_config_extra(
            tmp_path, ca, users_file, failures=3)))
        run = await trio.to_thread.run_sync(lambda: swaks(
            relay.ports_of(Port.SUBMISSION)[0], "--tls", "--auth", "LOGIN", "--auth-user", "alice",
            "--auth-password", "Tr0ub4dor&3"))
        assert run.returncode != 0 and "535 5.7.8 Authentication credentials invalid" in run.stdout, run.stdout
        c = await tls_client(relay, ca, Port.SUBMISSIONS)
        assert await c.command(b"AUTH PLAIN " + plain("nobody", PASSWORD)) == [
            b"535 5.7.8 Authentication credentials invalid"]  # an unknown user reads the same
        assert await c.command(b"AUTH PLAIN " + plain("alice", "Tr0ub4dor&4")) == [
            b"421 4.7.0 Too many failed authentication attempts; try again later"]
        assert await c.closed() == b""
        c = await tls_client(relay, ca)  # a new connection from the same address, with the right password
        assert await c.command(b"AUTH PLAIN " + plain("alice", PASSWORD)) == [
            b"421 4.7.0 Too many failed authentication attempts; try again later"]
        await c.closed()
        failed = events(caplog.records, "auth_failed")
        assert [(e["user"], e["reason"]) for e in failed] == [
            ("alice", "credentials"), ("nobody", "credentials"), ("alice", "rate_limit"), ("alice", "rate_limit")]
        assert all(e["client"] == "127.0.0.1" for e in failed)
        # The metric: three passwords checked and wrong (the third locked the address), one refused unchecked.
        counted = {r: relay.metrics.registry.get_sample_value("logspool_auth_total", {"result": r})
                   for r in ("failure", "rate_limit", "success")}
        assert counted == {"failure": 3.0, "rate_limit": 1.0, "success": None}, counted
        assert "Tr0ub4dor" not in caplog.text and plain("alice", "Tr0ub4dor&4").decode() not in caplog.text
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("said", "reply"), [
    (b"*", b"501 5.0.0 Authentication cancelled"),
    (b"not base64!", b"501 5.5.2 Cannot decode response: not base64"),
    (b"A" * 13000, b"500 5.5.6 Authentication exchange line is too long"),
    (base64.b64encode(b"no nuls here"), b"535 5.7.8 Authentication credentials invalid"),
    (b"\x1b[2J", b"501 5.5.2 Cannot decode response: not base64"),
], ids=["cancel", "not-base64", "too-long", "malformed", "escape"])
async def test_a_bad_response_line_is_answered_and_the_session_goes_on(
        tmp_path: Path, ca: trustme.CA, users_file: Path, said: bytes, reply: bytes) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {}, extra=auth_config_extra(
            tmp_path, ca, users_file)))
        c = await tls_client(relay, ca)
        assert await c.command(b"AUTH PLAIN") == [b"334"]
        assert await c.command(said) == [reply]
        assert await c.command(b"NOOP") == [b"250 2.0.0 Ok"]
        assert await c.command(b"AUTH PLAIN " + plain("alice", PASSWORD)) == [b"235 2.7.0 Authentication successful"]
        assert await c.command(b"AUTH PLAIN " + plain("alice", PASSWORD)) == [b"503 5.5.1 Already authenticated"]
        await c.aclose()
        nursery.cancel_scope.cancel()


async def test_a_user_added_while_the_relay_runs_can_log_in(tmp_path: Path, ca: trustme.CA) -> None:
    users = tmp_path / "users"
    add_user(str(users), "alice", PASSWORD)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {}, extra=auth_config_extra(
            tmp_path, ca, users)))
        c = await tls_client(relay, ca)
        assert (await c.command(b"AUTH PLAIN " + plain("carol", "s3cret")))[0].startswith(b"535")
        await trio.to_thread.run_sync(add_user, str(users), "carol", "s3cret")
        assert oct(os.stat(users).st_mode & 0o777) == "0o600"
        assert await c.command(b"AUTH PLAIN " + plain("carol", "s3cret")) == [b"235 2.7.0 Authentication successful"]
        await c.aclose()
        nursery.cancel_scope.cancel()


async def test_the_user_is_kept_in_the_envelope_of_a_message_that_waits(
        tmp_path: Path, ca: trustme.CA, users_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(451, "4.3.0", "later") if stage == "rcpt" else None)
        hop_port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{hop_port}"},
                                                        extra=auth_config_extra(tmp_path, ca, users_file)))
        watch = DeliveryWatch(relay)
        c = await tls_client(relay, ca, Port.SUBMISSIONS)
        assert (await c.command(b"AUTH PLAIN " + plain("alice", PASSWORD)))[0].startswith(b"235")
        for line in (b"MAIL FROM:<alice@example.org>", b"RCPT TO:<bob@far.example>", b"DATA",
                     b"Subject: waits\r\n\r\nhi\r\n."):
            assert (await c.command(line))[0][:1] in (b"2", b"3")
        await c.aclose()
        await watch.wait_for(Status.DEFERRED, 1)
        nursery.cancel_scope.cancel()
    (message,) = admin.iter_live(SpoolView(str(tmp_path / "spool")))
    assert message.envelope.extra["auth"] == "alice" and message.envelope.extra["client"] == "127.0.0.1"


async def test_password_checks_run_beside_the_loop_so_other_sessions_are_answered_meanwhile(
        tmp_path: Path, ca: trustme.CA, users_file: Path) -> None:
    """Three AUTHs queue for one worker (auth_concurrency = 1: three Argon2 checks, a second of CPU at least);
    a NOOP on another connection, sent after them, is answered before any of them. Were a check run on the
    loop, nothing else could be answered while it ran."""
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {}, extra=auth_config_extra(
            tmp_path, ca, users_file, more="auth_concurrency = 1")))
        clients = [await tls_client(relay, ca, Port.SUBMISSIONS) for _ in range(3)]
        other = await RawClient.connect(relay.ports[0])
        await other.reply()
        answered: list[str] = []

        async def auth(i: int) -> None:
            assert await clients[i].reply() == [b"235 2.7.0 Authentication successful"]
            answered.append(f"auth{i}")

        async with trio.open_nursery() as inner:
            for i, c in enumerate(clients):
                await c.send(b"AUTH PLAIN " + plain("alice", PASSWORD) + b"\r\n")
                inner.start_soon(auth, i)
            assert await other.command(b"NOOP") == [b"250 2.0.0 Ok"]
            answered.append("noop")
        assert len(answered) == 4 and answered[0] == "noop", answered
        for c in [*clients, other]:
            await c.aclose()
        nursery.cancel_scope.cancel()
