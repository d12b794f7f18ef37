"""Policy servers on the real relay: postgrey (Debian's, started by the test) greylisting a first attempt and
accepting the retry; a scripted server for the rest (down, hanging, broken, every stage and action).

The clients are smtplib from 127.0.0.5, outside ``mynetworks`` (127.0.0.1
only here), sending to a relay domain; a trusted client from 127.0.0.1 is
never asked (``skip_trusted``). Nothing waits a fixed time: a retry is
attempted until it is accepted, within a deadline.
"""

from __future__ import annotations

import email
import functools
import hashlib
import logging
import shutil
import smtplib
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID
from dns_server import DnsServer
from relay_support import NextHop, relay_config, start_relay

from mta.auth.users import add_user
from mta.config import Config
from mta.inbound.session import Port

OUTSIDE = "127.0.0.5"  # a client outside mynetworks
BODY = b"From: a@example.org\r\nTo: bob@dest.test\r\nSubject: policy\r\n\r\nhello\r\n"
POSTGREY_DELAY = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def postgrey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Debian's postgrey on 127.0.0.1, its database in the test's directory, greylisting for 1 s; its port."""
    exe = shutil.which("postgrey") or "/usr/sbin/postgrey"
    where = tmp_path_factory.mktemp("postgrey")
    port = free_port()
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    group = subprocess.run(["id", "-gn"], capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.Popen(
        [exe, f"--inet=127.0.0.1:{port}", f"--dbdir={where}", f"--delay={POSTGREY_DELAY}",
         f"--pidfile={where}/postgrey.pid", f"--user={user}", f"--group={group}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(where / "postgrey.log", "wb"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 30
        while True:  # until it listens (a condition with a deadline)
            assert proc.poll() is None, (where / "postgrey.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "postgrey did not listen within 30 s"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def policy_config(tmp: Path, hop: int, policy: str) -> Config:
    extra = f'\n[relay]\nmynetworks = ["127.0.0.1/32"]\nrelay_domains = ["dest.test"]\n[policy]\n{policy}\n'
    return relay_config(str(tmp), {"dest.test": f"smtp://127.0.0.1:{hop}"}, extra=extra)


def _attempt(port: int, sender: str, rcpts: list[str], source: str, body: bytes) -> list[tuple[int, str]]:
    """One transaction: the reply to each RCPT, then (if one was accepted) to the end of data."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30, source_address=(source, 0)) as s:
        s.ehlo("client.example")
        code, _ = s.mail(sender)
        assert code == 250
        got = [(code, text.decode()) for code, text in (s.rcpt(r) for r in rcpts)]
        if any(code == 250 for code, _ in got):
            code, text = s.data(body)  # the reply to the final dot (smtplib raises only for DATA's own)
            got.append((250, "data") if code == 250 else (code, text.decode()))
        return got


async def attempt(port: int, sender: str, rcpts: list[str], source: str = OUTSIDE,
                  body: bytes = BODY) -> list[tuple[int, str]]:
    return await trio.to_thread.run_sync(_attempt, port, sender, rcpts, source, body)


async def test_postgrey_defers_the_first_attempt_and_accepts_the_retry(tmp_path: Path, postgrey: int) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, policy_config(tmp_path, port, f'servers = ["inet:127.0.0.1:{postgrey}"]'))
        (first,) = await attempt(relay.ports[0], "grey@example.org", ["bob@dest.test"])
        assert first[0] == 450
        assert first[1].startswith("4.2.0 Greylisted, see http://postgrey.schweikert.ch/help/dest.test.html")
        with trio.fail_after(30):  # retried until postgrey's delay has passed
            while (again := await attempt(relay.ports[0], "grey@example.org", ["bob@dest.test"]))[0][0] == 450:
                await trio.sleep(0.2)
        assert [code for code, _ in again] == [250, 250]
        (got,) = await hop.wait_messages(1)
        fields = email.message_from_bytes(got.data).items()
        assert fields[0][0] == "Received" and fields[0][1].startswith("from client.example")
        assert fields[1][0] == "X-Greylist" and fields[1][1].startswith("delayed ")  # postgrey's PREPEND
        assert "by postgrey" in fields[1][1]
        assert got.data.endswith(BODY)
        # A client in mynetworks is not asked: accepted the first time.
        trusted = await attempt(relay.ports[0], "fresh@example.org", ["bob@dest.test"], source="127.0.0.1")
        assert [code for code, _ in trusted] == [250, 250]
        nursery.cancel_scope.cancel()


Answer = Callable[[dict[str, str]], str | None]  # the action for a request; None: never answer


class ScriptedPolicy:
    """A policy server in the test: records every request and its connection, answers as ``answer`` says."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[dict[str, str]] = []
        self.connections = 0
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._serve, 0, host="127.0.0.1"))
        self.port = int(listeners[0].socket.getsockname()[1])
        return self.port

    async def start_unix(self, nursery: trio.Nursery, path: Path) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(str(path))
        sock.listen()
        await nursery.start(trio.serve_listeners, self._serve, [trio.SocketListener(sock)])

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buf = b""
        while True:
            data = await stream.receive_some(4096)
            if not data:
                return
            buf += data
            while b"\n\n" in buf:
                request, buf = buf.split(b"\n\n", 1)
                attrs = dict(line.split("=", 1) for line in request.decode().split("\n"))
                self.requests.append(attrs)
                action = self.answer(attrs)
                if action is None:
                    await trio.sleep_forever()
                await stream.send_all(f"action={action}\n\n".encode())


async def test_a_server_that_is_down_costs_its_session_the_failure_default(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        down = free_port()
        relay = await start_relay(nursery, policy_config(tmp_path, port, f'servers = ["inet:127.0.0.1:{down}"]'))
        got = await attempt(relay.ports[0], "a@example.org", ["bob@dest.test"])
        assert got == [(451, "4.3.5 Policy service unavailable, try again later")]
        (line,) = [r.getMessage() for r in caplog.records if "event=policy_failed" in r.getMessage()]
        assert f"server=inet:127.0.0.1:{down}" in line and "default=tempfail" in line
        nursery.cancel_scope.cancel()


async def test_a_hanging_server_times_out_while_other_sessions_go_on(tmp_path: Path) -> None:
    """One session waits for a server that never answers; another (not asked) is served meanwhile; the first
    gets the failure default after ``timeout``; with ``on_failure = "dunno"`` the next server decides."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        hang = ScriptedPolicy(lambda r: None)
        await hang.start(nursery)
        relay = await start_relay(nursery, policy_config(
            tmp_path, port, f'servers = ["inet:127.0.0.1:{hang.port}"]\ntimeout = "1s"'))
        done: list[list[tuple[int, str]]] = []

        async def stuck() -> None:
            done.append(await attempt(relay.ports[0], "slow@example.org", ["bob@dest.test"]))

        started = trio.current_time()
        nursery.start_soon(stuck)
        with trio.fail_after(30):
            while not hang.requests:  # the stuck session is waiting on the server
                await trio.sleep(0.01)
        quick = await attempt(relay.ports[0], "quick@example.org", ["bob@dest.test"], source="127.0.0.1")
        assert [code for code, _ in quick] == [250, 250] and not done
        with trio.fail_after(30):
            while not done:
                await trio.sleep(0.01)
        assert done == [[(451, "4.3.5 Policy service unavailable, try again later")]]
        assert trio.current_time() - started >= 1.0
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        hang = ScriptedPolicy(lambda r: None)
        reject = ScriptedPolicy(lambda r: "REJECT 5.7.1 second says no")
        servers = f'"inet:127.0.0.1:{await hang.start(nursery)}", "inet:127.0.0.1:{await reject.start(nursery)}"'
        (tmp_path / "dunno").mkdir()
        relay = await start_relay(nursery, policy_config(
            tmp_path / "dunno", port, f'servers = [{servers}]\ntimeout = "0.3s"\non_failure = "dunno"'))
        got = await attempt(relay.ports[0], "a@example.org", ["bob@dest.test"])
        assert got == [(554, "5.7.1 second says no")]
        nursery.cancel_scope.cancel()


async def test_servers_in_order_at_rcpt_and_end_of_data_over_one_connection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DUNNO asks the next; OK ends the asking; a rejection at END-OF-MESSAGE refuses the data; the attributes
    are Postfix's; one connection per server carries every request; an unsupported action is logged and
    costs the failure default."""
    caplog.set_level(logging.INFO)

    def first(r: dict[str, str]) -> str:
        rcpt = r["recipient"]
        if r["protocol_state"] == "END-OF-MESSAGE":
            return "REJECT 5.7.0 content refused" if r["sender"] == "spam@example.org" else "DUNNO"
        return {"ok@dest.test": "OK", "odd@dest.test": "FILTER maildir:/var/mail", "warn@dest.test": "WARN looked odd",
                "nobody@dest.test": "DEFER_IF_REJECT 4.7.1 wait"}.get(rcpt, "DUNNO")

    def second(r: dict[str, str]) -> str:
        return "550 5.1.1 no such user" if r["recipient"] == "nobody@dest.test" else "DUNNO"

    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        one, two = ScriptedPolicy(first), ScriptedPolicy(second)
        servers = f'"inet:127.0.0.1:{await one.start(nursery)}", "inet:127.0.0.1:{await two.start(nursery)}"'
        relay = await start_relay(nursery, policy_config(
            tmp_path, port, f'servers = [{servers}]\nstages = ["rcpt", "data"]'))
        got = await attempt(relay.ports[0], "a@example.org",
                            ["ok@dest.test", "nobody@dest.test", "odd@dest.test", "warn@dest.test"])
        assert got == [(250, "2.1.5 Ok"), (450, "4.7.1 wait"),  # DEFER_IF_REJECT turned the 550 into its deferral
                       (451, "4.3.5 Policy service unavailable, try again later"), (250, "2.1.5 Ok"),
                       (250, "data")]
        assert [r["recipient"] for r in two.requests] == ["nobody@dest.test", "warn@dest.test", ""]
        eom = [r for r in one.requests if r["protocol_state"] == "END-OF-MESSAGE"]
        assert len(eom) == 1 and eom[0]["recipient_count"] == "2" and eom[0]["recipient"] == ""
        assert eom[0]["queue_id"] and int(eom[0]["size"]) > len(BODY)
        rcpt = one.requests[0]
        assert rcpt["request"] == "smtpd_access_policy" and rcpt["protocol_state"] == "RCPT"
        assert rcpt["protocol_name"] == "ESMTP" and rcpt["helo_name"] == "client.example"
        assert rcpt["client_address"] == OUTSIDE and rcpt["sender"] == "a@example.org"
        assert rcpt["recipient_count"] == "0" and rcpt["instance"] == eom[0]["instance"]
        refused = await attempt(relay.ports[0], "spam@example.org", ["ok@dest.test"])
        assert refused == [(250, "2.1.5 Ok"), (554, "5.7.0 content refused")]
        assert len({r["instance"] for r in one.requests}) == 2  # one per transaction
        assert (one.connections, two.connections) == (1, 1)  # kept between requests, and between sessions
        messages = [r.getMessage() for r in caplog.records]
        assert any("event=policy_unsupported" in m and 'action="FILTER maildir:/var/mail"' in m for m in messages)
        assert any("event=policy_warn" in m and 'text="looked odd"' in m for m in messages)
        await hop.wait_messages(1)
        nursery.cancel_scope.cancel()



async def test_a_server_on_a_unix_socket(tmp_path: Path) -> None:
    """``unix:policy.sock`` resolves against the config file's directory, as every path in it."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        server = ScriptedPolicy(lambda r: "REJECT 5.7.1 not from " + r["client_address"])
        await server.start_unix(nursery, tmp_path / "policy.sock")
        relay = await start_relay(nursery, policy_config(tmp_path, port, 'servers = ["unix:policy.sock"]'))
        got = await attempt(relay.ports[0], "a@example.org", ["bob@dest.test"])
        assert got == [(554, "5.7.1 not from 127.0.0.5")]
        nursery.cancel_scope.cancel()


async def test_the_clients_names_from_the_dns_and_the_listener_reach_the_server(tmp_path: Path) -> None:
    """``client_name`` is the PTR's name only if it resolves back to the client; ``reverse_client_name`` is the
    PTR's name whatever it resolves to; without a PTR both are ``unknown``."""
    dns_server = DnsServer()
    dns_server.ptr("127.0.0.5", "mail.client.test")
    dns_server.a("mail.client.test", "127.0.0.5")
    dns_server.ptr("127.0.0.6", "forged.client.test")
    dns_server.a("forged.client.test", "10.9.9.9")
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        dns_port = await nursery.start(dns_server.serve)
        server = ScriptedPolicy(lambda r: "DUNNO")
        await server.start(nursery)
        relay = await start_relay(nursery, policy_config(
            tmp_path, port, f'servers = ["inet:127.0.0.1:{server.port}"]\n'
                            f'[delivery]\nresolver = "127.0.0.1:{dns_port}"'))
        for source in ("127.0.0.5", "127.0.0.6", "127.0.0.7"):
            got = await attempt(relay.ports[0], "a@example.org", ["bob@dest.test"], source=source)
            assert [code for code, _ in got] == [250, 250]
        names = [(r["client_address"], r["client_name"], r["reverse_client_name"]) for r in server.requests]
        assert names == [("127.0.0.5", "mail.client.test", "mail.client.test"),
                         ("127.0.0.6", "unknown", "forged.client.test"),
                         ("127.0.0.7", "unknown", "unknown")]
        assert {(r["server_address"], r["server_port"]) for r in server.requests} == {
            ("127.0.0.1", str(relay.ports[0]))}
        nursery.cancel_scope.cancel()


def _send(port: int, sender: str, rcpts: list[str]) -> tuple[int, str]:
    """One message from outside mynetworks: the reply to its end of data, with its queue id."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30, source_address=(OUTSIDE, 0)) as s:
        s.ehlo("client.example")
        s.mail(sender)
        for r in rcpts:
            assert s.rcpt(r)[0] == 250
        code, text = s.data(BODY)
        return code, text.decode()


async def test_redirect_bcc_hold_and_discard_act_on_the_whole_message(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    actions = {"redirect@example.org": "REDIRECT trap@dest.test", "bcc@example.org": "BCC archive@dest.test",
               "hold@example.org": "HOLD looks odd", "discard@example.org": "DISCARD not wanted"}
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        server = ScriptedPolicy(lambda r: actions.get(r["sender"], "DUNNO"))
        await server.start(nursery)
        relay = await start_relay(nursery, policy_config(tmp_path, port, f'servers = ["inet:127.0.0.1:{server.port}"]'))
        rcpts = ["bob@dest.test", "carol@dest.test"]
        ids = {}
        for sender in actions:
            code, text = await trio.to_thread.run_sync(_send, relay.ports[0], sender, rcpts)
            assert code == 250, text
            ids[sender] = int(text.rsplit(" ", 1)[1], 16)
        delivered = {m.sender: m for m in await hop.wait_messages(2)}
        assert sorted(delivered) == ["bcc@example.org", "redirect@example.org"]
        assert delivered["redirect@example.org"].recipients == ["trap@dest.test"]
        assert sorted(delivered["bcc@example.org"].recipients) == ["archive@dest.test", *rcpts]
        held = await relay.aspool.find(ids["hold@example.org"])
        assert held.held and held.envelope.extra["quarantine"] == "policy: looks odd"
        with pytest.raises(LookupError):
            await relay.aspool.find(ids["discard@example.org"])
        messages = [r.getMessage() for r in caplog.records]
        assert any("event=discarded" in m and "reason=policy" in m and 'detail="not wanted"' in m for m in messages)
        assert len(hop.messages) == 2
        nursery.cancel_scope.cancel()


def _submit_with_cert(port: int, ca: trustme.CA, client: trustme.LeafCert) -> tuple[int, bytes]:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    client.configure_cert(ctx)
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.example")
        s.starttls(context=ctx)
        s.ehlo("client.example")
        s.login("alice", "correct horse battery staple")
        s.mail("alice@example.org")
        s.rcpt("bob@dest.test")
        return s.data(BODY)


async def test_tls_sasl_and_the_client_certificate_reach_the_server(tmp_path: Path, ca: trustme.CA) -> None:
    """On the submission port, with ``skip_trusted = false``: STARTTLS with a client certificate, AUTH PLAIN."""
    relay_cert = ca.issue_cert("127.0.0.1")
    relay_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    relay_cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    (tmp_path / "key.pem").chmod(0o600)
    ca.cert_pem.write_to_path(str(tmp_path / "clients-ca.pem"))
    add_user(str(tmp_path / "users"), "alice", "correct horse battery staple")
    client = ca.issue_cert("client.test", common_name="laptop.client.test")
    der = x509.load_pem_x509_certificate(client.cert_chain_pems[0].bytes())
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        server = ScriptedPolicy(lambda r: "DUNNO")
        await server.start(nursery)
        extra = (f'tls_cert = "{tmp_path}/cert.pem"\ntls_key = "{tmp_path}/key.pem"\n'
                 f'[submission]\nlisten = ["127.0.0.1:0"]\nusers_file = "{tmp_path}/users"\n'
                 f'[client_certs]\nca_file = "{tmp_path}/clients-ca.pem"\n'
                 f'[policy]\nservers = ["inet:127.0.0.1:{server.port}"]\nskip_trusted = false\n')
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"},
                                                        extra=extra))
        submission = relay.ports_of(Port.SUBMISSION)[0]
        got = await trio.to_thread.run_sync(_submit_with_cert, submission, ca, client)
        assert got[0] == 250
        (r,) = server.requests
        assert (r["server_address"], r["server_port"]) == ("127.0.0.1", str(submission))
        assert r["encryption_protocol"] == "TLSv1.3" and r["encryption_cipher"] == "TLS_AES_256_GCM_SHA384"
        assert r["encryption_keysize"] == "256"
        assert (r["sasl_method"], r["sasl_username"]) == ("PLAIN", "alice")
        assert r["ccert_subject"] == "laptop.client.test"
        assert r["ccert_issuer"] == der.issuer.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
        assert r["ccert_fingerprint"] == ":".join(f"{b:02X}" for b in der.fingerprint(hashes.SHA256()))
        spki = der.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
        assert r["ccert_pubkey_fingerprint"] == ":".join(f"{b:02X}" for b in hashlib.sha256(spki).digest())
        nursery.cancel_scope.cancel()


async def test_filter_sends_the_whole_message_to_the_named_next_hop(tmp_path: Path) -> None:
    """``FILTER smtp:[127.0.0.1]:PORT`` (Postfix's transport:destination, as amavis setups write it): every
    recipient of that message goes to the content filter, whatever the routes say; other mail goes its way."""
    async with trio.open_nursery() as nursery:
        hop, content_filter = NextHop(), NextHop()
        port = await hop.start(nursery)
        filter_port = await content_filter.start(nursery)
        server = ScriptedPolicy(lambda r: f"FILTER smtp:[127.0.0.1]:{filter_port}"
                                if r["sender"] == "scan@example.org" else "DUNNO")
        await server.start(nursery)
        relay = await start_relay(nursery, policy_config(tmp_path, port, f'servers = ["inet:127.0.0.1:{server.port}"]'))
        for sender in ("scan@example.org", "plain@example.org"):
            code, text = await trio.to_thread.run_sync(_send, relay.ports[0], sender, ["bob@dest.test",
                                                                                       "carol@dest.test"])
            assert code == 250, text
        (filtered,) = await content_filter.wait_messages(1)
        assert filtered.sender == "scan@example.org"
        assert sorted(filtered.recipients) == ["bob@dest.test", "carol@dest.test"]
        (plain,) = await hop.wait_messages(1)
        assert plain.sender == "plain@example.org"
        nursery.cancel_scope.cancel()
