"""The relay end to end on loopback: real SMTP clients in, real next hops out."""

from __future__ import annotations

import email
import logging
import os
import smtplib
import subprocess
from pathlib import Path

import pytest
import trio
from process_support import mta_json
from relay_support import DeliveryWatch, NextHop, Received, relay_config, start_relay, write_relay_config

from mta.smtp.common import Reply
from spool.format.record import Status


def _send(port: int, sender: str, rcpts: list[str], body: str) -> dict[str, tuple[int, bytes]]:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        return s.sendmail(sender, rcpts, body)


async def send(port: int, sender: str, rcpts: list[str], body: str) -> None:
    await trio.to_thread.run_sync(_send, port, sender, rcpts, body)


async def test_smtplib_to_localhost_lands_in_the_maildir(tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": "discard"})
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "alice@example.org", ["someone@localhost"], "Subject: hi\r\n\r\nhello there\r\n")
        await watch.wait_for(Status.DELIVERED, 1)
        files = os.listdir(tmp_path / "maildir" / "someone" / "new")
        assert len(files) == 1
        text = (tmp_path / "maildir" / "someone" / "new" / files[0]).read_bytes()
        assert b"hello there" in text
        assert b"Received: from" in text and b"by relay.test" in text
        nursery.cancel_scope.cancel()


async def test_relayed_mail_reaches_the_next_hop_over_few_connections(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"})
        relay = await start_relay(nursery, cfg)
        for i in range(10):
            await send(relay.ports[0], "a@example.org", [f"r{i}@far.example", f"s{i}@far.example"],
                       f"Subject: m{i}\r\n\r\nbody {i}\r\n")
        msgs = await hop.wait_messages(10)
        got = sorted(tuple(m.recipients) for m in msgs)
        assert got == sorted((f"r{i}@far.example", f"s{i}@far.example") for i in range(10))
        assert all(m.sender == "a@example.org" for m in msgs)
        assert hop.connections <= 10
        nursery.cancel_scope.cancel()


async def test_a_4xx_defers_and_a_later_runner_delivers(tmp_path: Path) -> None:
    answered: dict[str, int] = {}

    def policy(stage: str, value: object) -> Reply | None:
        if stage == "rcpt":
            n = answered.get(str(value), 0)
            answered[str(value)] = n + 1
            if n == 0:
                return Reply(451, "4.3.0", "try again later")
        return None

    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "a@example.org", ["later@far.example"], "Subject: x\r\n\r\nretry me\r\n")
        deferred = await watch.wait_for(Status.DEFERRED, 1)
        assert deferred[0].code == 451 and "try again later" in deferred[0].reply
        await watch.wait_for(Status.DELIVERED, 1)
        msgs = await hop.wait_messages(1)
        assert b"retry me" in msgs[0].data
        assert answered["later@far.example"] == 2
        nursery.cancel_scope.cancel()


async def test_a_5xx_bounces_and_the_dsn_reaches_the_sender(tmp_path: Path) -> None:
    def policy(stage: str, value: object) -> Reply | None:
        return Reply(550, "5.1.1", "no such user") if stage == "rcpt" else None

    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{port}"})
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "alice@localhost", ["ghost@far.example"], "Subject: lost\r\n\r\nnobody\r\n")
        bounced = await watch.wait_for(Status.BOUNCED, 1)
        assert bounced[0].code == 550 and bounced[0].enhanced == "5.1.1"
        await watch.wait_for(Status.DELIVERED, 1, recipient="alice@localhost")
        box = tmp_path / "maildir" / "alice" / "new"
        (name,) = os.listdir(box)
        dsn = email.message_from_bytes((box / name).read_bytes())
        assert dsn.get_content_type() == "multipart/report"
        status = next(p for p in dsn.walk() if p.get_content_type() == "message/delivery-status")
        text = status.as_string()
        assert "rfc822;ghost@far.example" in text.replace(" ", "") and "5.1.1" in text
        assert "Subject: lost" in dsn.as_string()
        nursery.cancel_scope.cancel()


async def test_no_relaying_for_clients_outside_mynetworks(tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": "discard"},
                       extra='[relay]\nmynetworks = ["127.0.0.1/32"]')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        port = relay.ports[0]

        def outsider() -> tuple[int, int]:
            with smtplib.SMTP("127.0.0.1", port, timeout=30, source_address=("127.0.0.2", 0)) as s:
                s.ehlo("outsider")
                s.mail("spammer@example.org")
                foreign = s.rcpt("victim@far.example")
                local = s.rcpt("someone@localhost")
                return foreign[0], local[0]

        foreign, local = await trio.to_thread.run_sync(outsider)
        assert foreign == 554
        assert local == 250
        nursery.cancel_scope.cancel()


def _swaks(port: int, to: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["swaks", "--server", f"127.0.0.1:{port}", "--to", to, "--from", "s@example.org",
                           "--header", "Subject: via swaks", "--timeout", "30"],
                          capture_output=True, text=True, timeout=60, check=False)


async def test_swaks_client_and_smtp_sink_next_hop(tmp_path: Path) -> None:
    sink_dir = tmp_path / "sink"
    sink_dir.mkdir()
    async with trio.open_nursery() as nursery:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        sink_port = listener.getsockname()[1]
        listener.close()
        sink = await trio.lowlevel.open_process(["smtp-sink", "-u", "root", "-d", f"{sink_dir}/%M.", "-c",
                                                 f"127.0.0.1:{sink_port}", "50"])
        try:
            relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{sink_port}"}))
            watch = DeliveryWatch(relay)
            result = await trio.to_thread.run_sync(_swaks, relay.ports[0], "x@far.example")
            assert result.returncode == 0, result.stdout + result.stderr
            assert "250 2.0.0 Ok: queued as" in result.stdout
            delivered = await watch.wait_for(Status.DELIVERED, 1)
            assert delivered[0].code == 250 and str(sink_port) in delivered[0].next_hop
            dumped = list(sink_dir.iterdir())
            assert len(dumped) == 1 and b"via swaks" in dumped[0].read_bytes()
        finally:
            sink.kill()
            await sink.wait()
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_admin_cli_reaches_the_running_relay(tmp_path: Path) -> None:
    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.4.2", "busy") if stage == "rcpt" else None

    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        cfg_path = write_relay_config(tmp_path, {"*": f"smtp://127.0.0.1:{port}"}, retry='["1h"]')
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}, retry='["1h"]')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "a@example.org", ["b@far.example"], "Subject: q\r\n\r\nqueued\r\n")
        await watch.wait_for(Status.DEFERRED, 1)

        listing = await mta_json(cfg_path, "queue", "list")
        msgs = listing["messages"]
        assert isinstance(msgs, list) and len(msgs) == 1
        qid = msgs[0]["id"]
        assert msgs[0]["recipients"] == ["b@far.example"] and "busy" in msgs[0]["last_error"]
        await mta_json(cfg_path, "queue", "hold", qid)
        held = await mta_json(cfg_path, "queue", "list", "--held")
        assert [m["id"] for m in held["messages"]] == [qid]
        await mta_json(cfg_path, "queue", "release", qid)
        count = await mta_json(cfg_path, "queue", "count", "--held")
        assert count["count"] == 0
        await mta_json(cfg_path, "queue", "delete", qid)
        assert (await mta_json(cfg_path, "queue", "count"))["count"] == 0
        nursery.cancel_scope.cancel()


def test_received_type_is_plain() -> None:
    assert Received("a", ["b"], b"c").recipients == ["b"]


async def test_pipelined_data_after_refused_recipients_gets_its_reply(tmp_path: Path) -> None:
    """Regression: a reply the core queued while returning NeedData (554 to DATA) must be sent before we read."""
    cfg = relay_config(str(tmp_path), {"*": "discard"}, extra='[relay]\nmynetworks = ["127.0.0.1/32"]')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.2", 0))
        await sock.connect(("127.0.0.1", relay.ports[0]))
        stream = trio.SocketStream(sock)
        buf = b""
        with trio.fail_after(30):
            while b"\r\n" not in buf:
                buf += await stream.receive_some(4096)
            await stream.send_all(b"EHLO x\r\n")
            while b"250 " not in buf:
                buf += await stream.receive_some(4096)
            buf = b""
            await stream.send_all(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@far.example>\r\nDATA\r\n")
            while buf.count(b"\r\n") < 3:
                buf += await stream.receive_some(4096)
        lines = buf.split(b"\r\n")
        assert lines[0].startswith(b"250") and lines[1].startswith(b"554 5.7.1") and lines[2].startswith(b"554")
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_large_body_full_of_line_start_dots_reaches_the_next_hop_byte_for_byte(tmp_path: Path) -> None:
    """300 KB through the relay's fast body paths: more line-start dots than ``bodybytes`` loops over, dots
    alone and doubled, long lines, a line that is ``.`` followed by more text: it must arrive unchanged."""
    lines = [b"Subject: dots", b""]
    lines.extend([b".", b"..", b".x %d" % i, b"plain line %d." % i, b"y" * 900, b". .\x7f"][i % 6] for i in range(6000))
    body = b"\r\n".join(lines) + b"\r\n"
    assert len(body) > 300_000
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))
        await trio.to_thread.run_sync(_send_bytes, relay.ports[0], body)
        (msg,) = await hop.wait_messages(1)
        assert msg.data.startswith(b"Received: ")
        assert msg.data[msg.data.index(b"Subject: dots") :] == body
        nursery.cancel_scope.cancel()


def _send_bytes(port: int, body: bytes) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:  # smtplib dot-stuffs the body itself
        assert s.sendmail("a@example.org", ["r@far.example"], body) == {}


async def test_a_host_name_that_is_no_fqdn_is_said_once_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25: the banner fell back to ``localhost`` and nothing said why."""
    from mta.config import parse_config, values

    monkeypatch.setattr("socket.getfqdn", lambda: "myhost")
    values.default_hostname.cache_clear()
    try:
        config = parse_config(f'[server]\nlisten = ["127.0.0.1:0"]\n[spool]\ndir = "{tmp_path / "spool"}"\n'
                              '[routes]\n"*" = "discard"\n', str(tmp_path / "relay.toml"), base_dir=str(tmp_path))
    finally:
        values.default_hostname.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mta"):
        async with trio.open_nursery() as nursery:
            relay = await start_relay(nursery, config)

            def banner() -> bytes:
                with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                    return s.ehlo()[1]

            assert (await trio.to_thread.run_sync(banner)).startswith(b"localhost")
            nursery.cancel_scope.cancel()
    warned = [r.getMessage() for r in caplog.records if "no fully qualified" in r.getMessage()]
    assert len(warned) == 1 and "'localhost'" in warned[0] and "[server] hostname" in warned[0], warned
