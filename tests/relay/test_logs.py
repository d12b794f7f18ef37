"""The relay's log lines against the real relay: one line per event, the queue id in each (docs/operations.md).

Each test drives a relay in this process over real TCP on 127.0.0.1 and reads
what it logged (caplog), parsed back from its key=value form
(``tests/support/logfmt.py``); the process-level side (``mta serve`` writing either
format) is tests/relay/test_log_formats.py.
"""

from __future__ import annotations

import json
import logging
import os
import smtplib
import socket
import ssl
from collections.abc import Mapping
from pathlib import Path

import pytest
import trio
import trustme
from logfmt import events
from relay_support import DeliveryWatch, NextHop, RawClient, SilentHop, relay_config, start_relay

from mta.admin.control import socket_path
from mta.observe.logline import JsonFormatter, TextFormatter
from mta.smtp.common import Reply
from spool.format.record import Status

CONTROL_CHARS = {chr(c) for c in (*range(0x20), 0x7F)}


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


def rejected(relay: object, reason: str) -> float:
    registry = relay.metrics.registry  # type: ignore[attr-defined]
    return registry.get_sample_value("logspool_rejected_commands_total", {"reason": reason}) or 0.0


# ---------------------------------------------------------------- rejections


async def test_every_refusal_is_one_reject_line_with_client_command_reply_and_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """550/552/554/452/421 and the core's 5xx: each one line, counted under the same reason."""
    caplog.set_level(logging.INFO, logger="mta.smtpd")
    # No mynetworks: relaying is refused, local mail (localhost) is accepted from anyone.
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"},
                       extra="max_recipients = 1\nmax_errors = 5\n[relay]\nmynetworks = []\n")
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.command(b"EHLO client.test")
        assert (await c.command(b"FROBNICATE now"))[0].startswith(b"500 5.5.1")
        assert (await c.command(b"RCPT TO:<bob@localhost>"))[0].startswith(b"503 5.5.1")
        assert (await c.command(b"MAIL FROM:<s@example.org> SIZE=999999999999"))[0].startswith(b"552 5.3.4")
        assert (await c.command(b"MAIL FROM:<s@example.org>"))[0].startswith(b"250")
        assert (await c.command(b"RCPT TO:<x@elsewhere.example>"))[0].startswith(b"554 5.7.1")
        assert (await c.command(b"RCPT TO:<bob@localhost>"))[0].startswith(b"250")
        assert (await c.command(b"RCPT TO:<carol@localhost>"))[0].startswith(b"452 4.5.3")
        assert (await c.command(b"DATA"))[0].startswith(b"354")
        await c.send(b"Subject: bare\nLF\r\n.\r\n")
        assert (await c.reply())[0].startswith(b"550 5.6.11")
        # A hostile argument: an escape sequence and a bidi override, refused whole (501).
        assert (await c.command("RCPT TO:<\x1b[2J\u202e@localhost>".encode()))[0].startswith(b"503")
        assert (await c.command(b"NOOP \x1b]0;owned\x07"))[0].startswith(b"501 5.5.4")
        assert (await c.command(b"BAD4"))[0].startswith(b"500")
        lines = await c.reply()  # the fifth error: 421 and the session ends
        assert lines[0].startswith(b"421 4.7.0")
        await c.aclose()
        nursery.cancel_scope.cancel()
    records = _messages(caplog, "mta.smtpd")
    got = [(e["command"], " ".join(e["reply"].split()[:2]), e["reason"]) for e in events(records, "reject")]
    assert got == [
        ("FROBNICATE", "500 5.5.1", "unknown_command"),
        ("RCPT", "503 5.5.1", "sequence"),
        ("MAIL", "552 5.3.4", "size"),
        ("RCPT", "554 5.7.1", "relay"),
        ("RCPT", "452 4.5.3", "too_many_recipients"),
        ("END-OF-DATA", "550 5.6.11", "bare_newline"),
        ("RCPT", "503 5.5.1", "sequence"),
        ("NOOP", "501 5.5.4", "control_character"),
        ("BAD4", "500 5.5.1", "unknown_command"),
        ("BAD4", "421 4.7.0", "too_many_errors"),
    ], got
    every = events(records, "reject")
    assert all(e["client"] == "127.0.0.1" and e["helo"] == "client.test" for e in every)
    relay_line = every[3]
    assert (relay_line["arg"], relay_line["from"]) == ("TO:<x@elsewhere.example>", "<s@example.org>")
    assert every[3]["reply"] == "554 5.7.1 Relay access denied"
    content = every[5]
    assert "qid" in content and content["from"] == "<s@example.org>"  # the message had its id since DATA began
    for reason in ("unknown_command", "sequence", "size", "relay", "too_many_recipients", "bare_newline",
                   "control_character", "too_many_errors"):
        assert rejected(relay, reason) >= 1, reason
    assert rejected(relay, "unknown_command") == 2
    # Raw client bytes never reach a line: the escape, the BEL and the bidi override are written escaped.
    for r in records:
        for line in (TextFormatter().format(r), JsonFormatter().format(r)):
            assert not CONTROL_CHARS & set(line) and "\u202e" not in line, line
    hostile = every[6]["arg"]
    assert hostile == "TO:<\\x1b[2J\\u202e@localhost>", hostile
    as_json = json.loads(JsonFormatter().format(next(r for r in records if "NOOP" in r.getMessage())))
    assert as_json["arg"] == "\x1b]0;owned\x07" and as_json["event"] == "reject" and as_json["reason"] == \
        "control_character"


async def test_a_session_over_the_limit_and_a_timeout_are_reject_lines(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta.smtpd")
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"},
                       extra='max_sessions = 1\nreserved_sessions = 0\ncommand_timeout = "1s"\n')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        first = await RawClient.connect(relay.ports[0])
        await first.reply()
        second = await RawClient.connect(relay.ports[0])
        assert (await second.reply())[0].startswith(b"421 4.7.0")
        await second.aclose()
        assert (await first.reply(timeout=30))[0].startswith(b"421 4.4.2")  # said nothing for command_timeout
        await first.aclose()
        nursery.cancel_scope.cancel()
    got = events(_messages(caplog, "mta.smtpd"), "reject")
    limit, timeout = got
    assert (limit["command"], limit["reason"], limit["limit"], limit["client"]) == \
        ("CONNECT", "session_limit", "total", "127.0.0.1")
    assert limit["reply"].startswith("421 4.7.0")
    assert (timeout["command"], timeout["reason"], timeout["phase"]) == ("-", "timeout", "command")
    assert timeout["reply"].startswith("421 4.4.2")


# ---------------------------------------------------------------- accepted, Received:, TLS in


def tls_extra(tmp_path: Path, ca: trustme.CA) -> str:
    cert = ca.issue_cert("relay.test", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "relay.pem"))
    return f'tls_cert = "{tmp_path / "relay.pem"}"\ntls_key = "{tmp_path / "relay.pem"}"\n'


def _send_tls(port: int, ca: trustme.CA) -> str:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.starttls(context=ctx)
        s.ehlo("client.test")
        s.mail("s@example.org")
        s.rcpt("bob@localhost")
        code, text = s.data(b"Subject: tls\r\n\r\nover tls\r\n")
        assert code == 250
        return text.decode().rsplit(" ", 1)[1]


async def test_accepted_line_and_received_header_name_the_queue_id_and_the_tls_cipher(
        tmp_path: Path, ca: trustme.CA, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"}, extra=tls_extra(tmp_path, ca))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        qid = await trio.to_thread.run_sync(_send_tls, relay.ports[0], ca)
        await watch.wait_for(Status.DELIVERED, 1)
        nursery.cancel_scope.cancel()
    (tls,) = events(_messages(caplog, "mta.smtpd"), "tls")
    assert (tls["direction"], tls["client"], tls["verified"], tls["peer_cert"]) == ("in", "127.0.0.1", "no", "none")
    assert tls["protocol"].startswith("TLSv1.") and tls["cipher"] and int(tls["bits"]) >= 128
    (accepted,) = events(_messages(caplog, "mta.smtpd"), "accepted")
    assert (accepted["qid"], accepted["from"], accepted["nrcpt"], accepted["client"]) == \
        (qid, "<s@example.org>", "1", "127.0.0.1")
    assert (accepted["proto"], accepted["tls"], accepted["helo"]) == ("ESMTPS", tls["protocol"], "client.test")
    (delivery,) = events(_messages(caplog, "mta.delivery"), "delivery")
    assert (delivery["qid"], delivery["to"], delivery["status"]) == (qid, "<bob@localhost>", "sent")
    (name,) = os.listdir(tmp_path / "maildir" / "bob" / "new")
    header = (tmp_path / "maildir" / "bob" / "new" / name).read_bytes().split(b"\r\n\r\n", 1)[0].decode()
    received = "Received:" + header.split("\r\nReceived:", 1)[1].split("\r\nSubject:", 1)[0]
    using = f"(using {tls['protocol']} with cipher {tls['cipher']} ({tls['bits']}/{tls['bits']} bits))"
    assert received.startswith("Received: from client.test (unknown [127.0.0.1])\r\n"), received
    assert f"\r\n\t{using}\r\n\t(No client certificate requested)\r\n" in received, received
    assert f"\tby relay.test with ESMTPS id {qid}\r\n\tfor <bob@localhost>;" in received, received


async def test_queue_ids_decided_at_data_are_unique_and_increase_in_the_order_data_began(tmp_path: Path) -> None:
    """Two sessions in DATA at once: the one that began first has the lower id, whichever ends first."""
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"})
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        clients = []
        for name in ("first", "second"):
            c = await RawClient.connect(relay.ports[0])
            await c.reply()
            for line in (b"EHLO c.test", b"MAIL FROM:<s@example.org>", f"RCPT TO:<{name}@localhost>".encode()):
                await c.command(line)
            assert (await c.command(b"DATA"))[0].startswith(b"354")
            clients.append(c)
        ids = {}
        for name, c in reversed(list(zip(("first", "second"), clients, strict=True))):  # the second ends first
            ids[name] = (await c.command(b"Subject: x\r\n\r\nbody\r\n.\r\n"))[0].split()[-1].decode()
            await c.aclose()
        await watch.wait_for(Status.DELIVERED, 2)
        nursery.cancel_scope.cancel()
    assert int(ids["first"], 16) < int(ids["second"], 16), ids
    for name, qid in ids.items():
        (box,) = os.listdir(tmp_path / "maildir" / name / "new")
        assert f" id {qid}\r\n".encode() in (tmp_path / "maildir" / name / "new" / box).read_bytes()


# ---------------------------------------------------------------- TLS out


def hop_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    return ctx


@pytest.mark.parametrize("mode", ["verify", "opportunistic"])
async def test_outbound_tls_line_says_whether_the_certificate_was_verified(
        tmp_path: Path, ca: trustme.CA, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    caplog.set_level(logging.INFO)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    async with trio.open_nursery() as nursery:
        hop = NextHop(ssl_context=hop_context(ca))
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{port}?tls={mode}"},
                           extra=f'[delivery]\ntls_ca_file = "{tmp_path / "ca.pem"}"\n')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await trio.to_thread.run_sync(_plain_send, relay.ports[0], "w@far.example")
        await watch.wait_for(Status.DELIVERED, 1)
        nursery.cancel_scope.cancel()
    (tls,) = events(_messages(caplog, "mta.smtp"), "tls")
    (delivery,) = events(_messages(caplog, "mta.delivery"), "delivery")
    assert (tls["direction"], tls["relay"], tls["qids"]) == ("out", f"127.0.0.1[127.0.0.1]:{port}", delivery["qid"])
    assert tls["protocol"].startswith("TLSv1.") and tls["cipher"] and int(tls["bits"]) >= 128
    expected = ("yes", "verified", "verified") if mode == "verify" else ("no", "unverified", "encrypted")
    assert (tls["verified"], tls["peer_cert"], delivery["tls"]) == expected


def _plain_send(port: int, rcpt: str, sender: str = "s@localhost") -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(sender)
        s.rcpt(rcpt)
        code, text = s.data(b"Subject: out\r\n\r\nbody\r\n")
        assert code == 250
        return text.decode().rsplit(" ", 1)[1]


# ---------------------------------------------------------------- failures to connect


def closed_port() -> int:
    """A port on 127.0.0.1 with nothing listening: a connection there is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("cause", ["refused", "timeout", "tls"])
async def test_a_failed_address_is_named_with_its_cause(tmp_path: Path, ca: trustme.CA,
                                                       caplog: pytest.LogCaptureFixture, cause: str) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        if cause == "refused":
            port, tls, words = closed_port(), "none", "connection refused"
        elif cause == "timeout":
            silent = SilentHop()
            port, tls, words = await silent.start(nursery), "none", \
                "timed out while receiving the initial server greeting"
        else:  # a certificate from a CA the relay does not trust
            hop = NextHop(ssl_context=hop_context(trustme.CA()))
            port, tls, words = await hop.start(nursery), "verify", "TLS handshake failed: "
        cfg = relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{port}?tls={tls}"},
                           extra='[delivery]\ncommand_timeout = "1s"\n')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        qid = await trio.to_thread.run_sync(_plain_send, relay.ports[0], "w@far.example")
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        if cause == "timeout":
            silent.release()
        nursery.cancel_scope.cancel()
    label = f"127.0.0.1[127.0.0.1]:{port}"
    (failed,) = events(_messages(caplog, "mta.smtp"), "connect_failed")
    assert (failed["qids"], failed["relay"], failed["cause"]) == (qid, label, cause)
    assert words in failed["detail"], failed
    if cause == "tls":
        assert "certificate verify failed" in failed["detail"], failed
    assert words in deferred.reply and label in deferred.reply and "all attempts" not in deferred.reply
    (delivery,) = events(_messages(caplog, "mta.delivery"), "delivery")
    assert (delivery["qid"], delivery["status"], delivery["reply"]) == (qid, "deferred", deferred.reply)


async def test_every_address_tried_is_named_and_a_dns_failure_says_so(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from dns_server import DnsServer

    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        dns = DnsServer()
        dns_port = await nursery.start(dns.serve)
        silent = SilentHop()
        port = await silent.start(nursery)
        dns.mx("two.test", 10, "mx1.two.test")
        dns.mx("two.test", 20, "mx2.two.test")
        dns.a("mx1.two.test", "127.0.0.2")  # nothing listens there: refused
        dns.a("mx2.two.test", "127.0.0.1")  # the silent hop: a timeout
        dns.exists("broken.test")
        dns.servfail("broken.test")
        extra = f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\ncommand_timeout = "1s"\n'
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": "mx"}, extra=extra, retry='["1h"]'))
        watch = DeliveryWatch(relay)
        two = await trio.to_thread.run_sync(_plain_send, relay.ports[0], "a@two.test")
        broken = await trio.to_thread.run_sync(_plain_send, relay.ports[0], "b@broken.test")
        await watch.wait_for(Status.DEFERRED, 1, recipient="a@two.test")
        await watch.wait_for(Status.DEFERRED, 1, recipient="b@broken.test")
        silent.release()
        nursery.cancel_scope.cancel()
    failed = events(_messages(caplog, "mta.smtp"), "connect_failed")
    by = {(f["qids"], f["cause"]): f for f in failed}
    assert set(by) == {(two, "refused"), (two, "timeout"), (broken, "dns")}, failed
    assert by[(two, "refused")]["relay"] == f"mx1.two.test[127.0.0.2]:{port}"
    assert by[(two, "timeout")]["relay"] == f"mx2.two.test[127.0.0.1]:{port}"
    assert by[(broken, "dns")]["relay"] == "broken.test" and "DNS lookup for broken.test failed" in \
        by[(broken, "dns")]["detail"]
    reply = {o.recipient: o.reply for _, o in watch.outcomes}
    assert reply["a@two.test"] == (f"connect to mx1.two.test[127.0.0.2]:{port}: connection refused; "
                                   f"mx2.two.test[127.0.0.1]:{port}: timed out while receiving the initial server "
                                   "greeting"), reply


# ---------------------------------------------------------------- bounces and DSNs


async def test_a_bounce_logs_the_dsn_and_the_dsn_names_the_remote_mta_and_the_queue_id(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import email
    import email.message
    import email.policy
    import email.utils

    from dns_server import DnsServer

    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        dns = DnsServer()
        dns_port = await nursery.start(dns.serve)
        hop = NextHop(lambda stage, value: Reply(550, "5.1.1", "no such user") if stage == "rcpt" else None)
        port = await hop.start(nursery)
        dns.mx("dest.test", 10, "mx.dest.test")
        dns.a("mx.dest.test", "127.0.0.1")
        extra = f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\n'
        relay = await start_relay(nursery, relay_config(
            str(tmp_path), {"localhost": "maildir:maildir", "*": "mx"}, extra=extra))
        watch = DeliveryWatch(relay)
        qid = await trio.to_thread.run_sync(lambda: _plain_send(relay.ports[0], "nobody@dest.test", "alice@localhost"))
        await watch.wait_for(Status.DELIVERED, 1, recipient="alice@localhost")  # the DSN, in alice's Maildir
        nursery.cancel_scope.cancel()
    deliveries = events(_messages(caplog, "mta.delivery"), "delivery")
    (bounce,) = events(_messages(caplog, "mta.delivery"), "bounce")
    bounced = next(d for d in deliveries if d["status"] == "bounced")
    dsn_line = next(d for d in deliveries if d["status"] == "sent")
    assert (bounced["qid"], bounced["relay"], bounced["reply"]) == \
        (qid, f"mx.dest.test[127.0.0.1]:{port}", "550 no such user")
    assert (bounce["qid"], bounce["to"], bounce["dsn"], bounce["nrcpt"]) == (qid, "<alice@localhost>",
                                                                            dsn_line["qid"], "1")
    (name,) = os.listdir(tmp_path / "maildir" / "alice" / "new")
    dsn = email.message_from_bytes((tmp_path / "maildir" / "alice" / "new" / name).read_bytes(),
                                   policy=email.policy.default)
    parts = list(dsn.iter_parts())
    status = parts[1].get_payload()
    assert isinstance(status, list)
    per_message, per_recipient = status[0], status[1]
    assert isinstance(per_message, email.message.Message) and isinstance(per_recipient, email.message.Message)
    assert per_message["Reporting-MTA"] == "dns; relay.test"
    assert per_message["X-Logspool-Queue-ID"] == qid
    assert per_message["X-Logspool-Sender"] == "rfc822; alice@localhost"
    assert email.utils.parsedate_to_datetime(per_message["Arrival-Date"]).tzinfo is not None
    assert per_recipient["Remote-MTA"] == "dns; mx.dest.test"
    assert per_recipient["Diagnostic-Code"] == "smtp; 550 5.1.1 no such user"
    assert f"queue id {qid}" in parts[0].get_content()


# ---------------------------------------------------------------- admin actions


def _ask(path: str, request: Mapping[str, object]) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            assert chunk, buf
            buf += chunk
    answer = json.loads(buf)
    assert isinstance(answer, dict)
    return answer


async def test_each_admin_action_is_one_line_with_the_command_the_messages_and_the_uid(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mta.control")
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(451, "4.3.0", "try later") if stage == "rcpt" else None)
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{port}"}, retry='["1h"]')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        qid = await trio.to_thread.run_sync(_plain_send, relay.ports[0], "w@far.example")
        await watch.wait_for(Status.DEFERRED, 1)
        path = socket_path(cfg)
        held = await trio.to_thread.run_sync(_ask, path, {"op": "hold", "ids": [qid, "FFFFFF"]})
        listed = await trio.to_thread.run_sync(_ask, path, {"op": "list"})
        bad = await trio.to_thread.run_sync(_ask, path, {"op": "hold"})
        nursery.cancel_scope.cancel()
    assert held["ok"] and listed["ok"] and not bad["ok"]
    records = _messages(caplog, "mta.control")
    hold, lst, refused = events(records, "admin")
    assert (hold["command"], hold["ids"], hold["result"], hold["done"], hold["failed"]) == \
        ("hold", f"{qid},FFFFFF", "ok", qid, "FFFFFF")
    assert (hold["uid"], hold["peer_pid"]) == (str(os.getuid()), str(os.getpid()))
    assert (lst["command"], lst["result"], lst["uid"]) == ("list", "ok", str(os.getuid()))
    assert (refused["command"], refused["result"], refused["uid"]) == ("-", "bad_request", str(os.getuid()))
    assert "needs at least one queue id" in refused["error"]
    levels = [r.levelno for r in records if r.getMessage().startswith("event=admin")]
    assert levels == [logging.INFO, logging.DEBUG, logging.INFO]  # reads are debug; changes and refusals info


# ---------------------------------------------------------------- what a search of the log finds


async def test_message_id_last_error_and_deletion_are_in_the_log_and_the_queue(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The Message-ID in the accepted and delivery lines; a deferral's last error with its codes and the host
    that sent it; ``mta queue delete`` a ``status=deleted`` line per recipient (issue 25)."""
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(451, "4.3.0", "try later") if stage == "rcpt" else None)
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"far.example": f"smtp://127.0.0.1:{port}"}, retry='["1h"]')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)

        def send() -> str:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                s.ehlo("client.test")
                s.mail("s@localhost")
                s.rcpt("w@far.example")
                code, text = s.data(b"Subject: out\r\nMessage-ID:\r\n <abc.123@client.test>\r\n\r\nbody\r\n")
                assert code == 250
                return text.decode().rsplit(" ", 1)[1]

        qid = await trio.to_thread.run_sync(send)
        await watch.wait_for(Status.DEFERRED, 1)
        path = socket_path(cfg)
        listed = await trio.to_thread.run_sync(_ask, path, {"op": "list"})
        deleted = await trio.to_thread.run_sync(_ask, path, {"op": "delete", "ids": [qid]})
        nursery.cancel_scope.cancel()
    (accepted,) = events(_messages(caplog, "mta.smtpd"), "accepted")
    assert (accepted["qid"], accepted["message_id"]) == (qid, "<abc.123@client.test>")
    (deferred,) = [d for d in events(_messages(caplog, "mta.delivery"), "delivery") if d["status"] == "deferred"]
    assert deferred["message_id"] == "<abc.123@client.test>"
    messages = listed["messages"]
    assert isinstance(messages, list)
    assert messages[0]["last_error"] == f"451 4.3.0 try later (from 127.0.0.1[127.0.0.1]:{port})", messages
    assert deleted["ok"], deleted
    (gone,) = list(events(_messages(caplog, "mta.control"), "delivery"))
    assert (gone["qid"], gone["to"], gone["status"]) == (qid, "<w@far.example>", "deleted")


def test_recovery_lines_name_their_event_and_queue_id_in_json(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """``jq 'select(.qid == ...)'`` finds the in-doubt line, and ``select(.event == "recovered")`` the summary."""
    import time

    from spool.config.engine import SpoolConfig
    from spool.engine.spool import Spool

    sp = Spool.open(str(tmp_path / "spool"), SpoolConfig())
    mid = sp.enqueue("a@example.org", ["b@far.example"], b"Subject: x\r\n\r\ny\r\n")
    sp.commit()
    for attempt in sp.poll_due(time.time()):
        sp.record_sending(attempt, attempt.remaining)  # the final dot went out
    sp.commit()
    sp.close()  # no outcome, no FINISH: as after kill -9 before the next hop's reply
    caplog.clear()  # the first open's summary is captured too when an earlier test left "spool" at INFO
    with caplog.at_level(logging.INFO, logger="spool"):
        Spool.open(str(tmp_path / "spool"), SpoolConfig()).close()
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "spool.engine.recovery"]
    (doubt,) = [line for line in lines if line.get("event") == "in_doubt"]
    assert doubt["qid"] == f"{mid:X}" and doubt["msg"].startswith(f"in doubt: queue id {mid:X} "), doubt
    (summary,) = [line for line in lines if line.get("event") == "recovered"]
    assert "1 in doubt" in summary["msg"] and "qid" not in summary, summary
