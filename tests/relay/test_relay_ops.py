"""What an operator sees: queue commands, metrics, the delivery log, defaults, config errors.

The relay runs in this process where a test only needs its sockets, and as
``mta serve`` in a subprocess where the test is about the command itself
(defaults, exit codes). The admin commands are the real console script.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import smtplib
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import trio
from logfmt import events
from process_support import MTA, mta, mta_json
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay, write_relay_config

from mta.smtp.common import Reply
from spool.format.record import Status

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def _send(port: int, rcpt: str, body: str, sender: str = "a@example.org") -> str:
    """Send one message; return the queue id from the 250 after DATA."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.mail(sender)[0] == 250
        assert s.rcpt(rcpt)[0] == 250
        code, text = s.data(body.encode())
        assert code == 250, text
        m = re.search(rb"queued as ([0-9A-F]+)", text)
        assert m, text
        return m.group(1).decode()


async def send(port: int, rcpt: str, body: str) -> str:
    return await trio.to_thread.run_sync(_send, port, rcpt, body)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp_path: Path, hop_port: int) -> Path:
    return write_relay_config(tmp_path, {"*": f"smtp://127.0.0.1:{hop_port}"}, retry='["1h"]')


async def test_queue_shape_show_body_and_flush(tmp_path: Path) -> None:
    refuse = [True]

    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.3.0", "come back later") if stage == "rcpt" and refuse else None

    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        cfg_path = write_config(tmp_path, port)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"},
                                                        retry='["1h"]'))
        watch = DeliveryWatch(relay)
        ids = [await send(relay.ports[0], f"u{i}@alpha.example", f"Subject: a{i}\r\n\r\nalpha body {i}\r\n")
               for i in range(3)]
        ids.append(await send(relay.ports[0], "v@beta.example", "Subject: b\r\n\r\nbeta body\r\n"))
        await watch.wait_for(Status.DEFERRED, 4)

        shape = await mta_json(cfg_path, "queue", "shape")
        assert [(r["domain"], r["total"]) for r in shape["rows"]] == [("alpha.example", 3), ("beta.example", 1)]
        assert len(shape["rows"][0]["counts"]) == len(shape["buckets"]) and shape["buckets"][-1] is None
        assert shape["rows"][0]["counts"][0] == 3  # all younger than the first bucket (5 minutes)

        show = await mta(cfg_path, "queue", "show", ids[3], "--body")
        assert show.returncode == 0, show.stderr.decode()
        out = show.stdout.decode()
        assert f"id: {ids[3]}" in out and "v@beta.example" in out and "come back later" in out
        assert "Subject: b" in out and "beta body" in out and "Received: from client.test" in out

        refuse.clear()
        flushed = await mta_json(cfg_path, "queue", "flush", ids[3])
        assert flushed["done"] == [ids[3]] and flushed["errors"] == {}
        (out_rcpt,) = await watch.wait_for(Status.DELIVERED, 1)
        assert out_rcpt.recipient == "v@beta.example"
        (msg,) = await hop.wait_messages(1)
        assert b"beta body" in msg.data
        assert watch.count(Status.DELIVERED) == 1  # the others wait for their hour
        nursery.cancel_scope.cancel()


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def test_prometheus_endpoint_counts_accepted_mail_and_outcomes(tmp_path: Path) -> None:
    metrics_port = free_port()
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": "discard"},
                       extra=f'metrics_listen = "127.0.0.1:{metrics_port}"')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        before = await trio.to_thread.run_sync(_scrape, metrics_port)
        assert before["logspool_accepted_messages_total"] == 0
        await send(relay.ports[0], "x@localhost", "Subject: m\r\n\r\none\r\n")
        await send(relay.ports[0], "y@far.example", "Subject: m\r\n\r\ntwo\r\n")
        await watch.wait_for(Status.DELIVERED, 2)
        after = await trio.to_thread.run_sync(_scrape, metrics_port)
        assert after["logspool_accepted_messages_total"] == 2
        assert after['logspool_recipient_outcomes_total{status="delivered"}'] == 2
        assert after["logspool_delivery_latency_seconds_count"] == 2
        assert after["logspool_smtp_sessions_total"] >= 2
        assert after["logspool_fsyncs"] > before["logspool_fsyncs"]
        assert after["logspool_commits"] > before["logspool_commits"]
        assert "logspool_recovery_in_doubt" in after and "logspool_dsn_sent_total" in after
        nursery.cancel_scope.cancel()


async def test_one_structured_log_line_per_delivery_attempt(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    tries: list[str] = []

    def policy(stage: str, value: object) -> Reply | None:
        if stage == "rcpt":
            tries.append(str(value))
            if len(tries) == 1:
                return Reply(451, "4.3.0", "greylisted")
        return None

    caplog.set_level(logging.INFO, logger="mta.delivery")
    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))
        watch = DeliveryWatch(relay)
        qid = await send(relay.ports[0], "w@far.example", "Subject: log\r\n\r\nlogged\r\n")
        await watch.wait_for(Status.DELIVERED, 1)
        nursery.cancel_scope.cancel()
    lines = [r for r in caplog.records if r.name == "mta.delivery"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    first, second = events(lines, "delivery")
    assert (first["qid"], first["to"], first["status"], first["dsn"]) == (qid, "<w@far.example>", "deferred", "4.3.0")
    assert first["reply"] == "451 greylisted" and first["relay"] == f"127.0.0.1[127.0.0.1]:{port}"
    assert (first["tls"], first["attempts"], second["attempts"]) == ("none", "1", "2")
    assert (second["qid"], second["status"], second["dsn"]) == (qid, "sent", "2.0.0")
    assert second["reply"].startswith("250 ")
    assert re.fullmatch(r"\d+\.\d\d", first["delay"]) and float(second["delay"]) >= float(first["delay"])


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


async def test_serve_with_no_config_uses_the_make_run_defaults(tmp_path: Path) -> None:
    """Empty directory, no file: 127.0.0.1:2525, spool in ./var/spool, @localhost into ./var/maildir."""
    env = {k: v for k, v in os.environ.items() if k != "LOGSPOOL_CONFIG"}
    port = 2525
    source = "built-in defaults (no config file)"
    if _port_busy(port):  # someone else uses 2525: change only the port, and check every other default
        port = free_port()
        override = tmp_path / "port.toml"  # a file's relative defaults resolve in its directory: this one
        override.write_text(f'[server]\nlisten = ["127.0.0.1:{port}"]\n')
        env["LOGSPOOL_CONFIG"] = str(override)
        source = str(override)
    assert os.listdir(tmp_path) in ([], ["port.toml"])
    lines: list[str] = []
    changed = [trio.Event()]

    async def read(stream: trio.abc.ReceiveStream) -> None:
        buf = b""
        while chunk := await stream.receive_some(65536):
            *done, buf = (buf + chunk).split(b"\n")
            lines.extend(x.decode("utf-8", "replace") for x in done)
            changed[0].set()
            changed[0] = trio.Event()

    async def wait_line(pattern: str) -> re.Match[str]:
        with trio.fail_after(60):
            while True:
                for line in lines:
                    if m := re.search(pattern, line):
                        return m
                await changed[0].wait()

    proc = await trio.lowlevel.open_process([MTA, "serve"], cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stderr is not None
            nursery.start_soon(read, proc.stderr)
            ready = await wait_line(r"listening on (\S+), spool (\S+)")
            assert ready.group(1) == f"127.0.0.1:{port}"
            assert ready.group(2) == str(tmp_path / "var" / "spool")
            maildir = tmp_path / "var" / "maildir"
            await wait_line(re.escape(f"config {source}; local delivery: @localhost into {maildir}/<localpart>/new/"))
            qid = await send(port, "someone@localhost", "Subject: default\r\n\r\nmake run works\r\n")
            sent = await wait_line(rf"event=delivery qid={qid} to=<someone@localhost> relay=(\S+) .* status=sent")
            assert sent.group(1) == f"maildir:{tmp_path / 'var' / 'maildir'}"
            box = tmp_path / "var" / "maildir" / "someone" / "new"
            (name,) = os.listdir(box)
            assert b"make run works" in (box / name).read_bytes()
            assert (tmp_path / "var" / "spool" / "control.sock").exists()
            count = await mta(None, "queue", "count", "--json", cwd=tmp_path, env=env)
            assert count.returncode == 0 and json.loads(count.stdout) == {"ok": True, "count": 0}
            # What make run says to try: its curl line (curl everywhere; swaks is tested elsewhere).
            (hint,) = [line for line in MAKEFILE.read_text().splitlines() if "| curl " in line]
            command = hint.split("or: ", 1)[1].rstrip('"').replace(":2525", f":{port}")
            tried = await trio.run_process(["sh", "-c", command], cwd=str(tmp_path), check=False,
                                           capture_stdout=True, capture_stderr=True)
            assert tried.returncode == 0 and tried.stderr == b"", tried.stderr
            await wait_line(r"to=<you@localhost> .* status=sent")  # logged once the maildir file is durable
            box = maildir / "you" / "new"
            (name,) = os.listdir(box)
            assert b"Subject: test" in (box / name).read_bytes()
            # Mail for anywhere else is routed by MX, and relaying is open to 127.0.0.0/8 only: accepted here.
            with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
                s.ehlo("client.test")
                s.mail("a@example.org")
                assert s.rcpt("b@example.invalid")[0] == 250
                s.rset()
            # SIGTERM drains (nothing in flight here) and exits 0 (tests/relay/test_lifecycle.py).
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                await proc.wait()
            assert proc.returncode == 0
            assert not any("Traceback" in line for line in lines), lines
    finally:
        proc.kill()
        await proc.wait()


async def test_a_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nlisen = ["127.0.0.1:2525"]\n')
    expected = rf"^mta: {re.escape(str(bad))}: server\.lisen: unknown key; did you mean 'listen'\?$"
    proc = await mta(bad, "serve")
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert re.match(expected, err.strip()), err
    assert "Traceback" not in err and proc.stdout == b""
    assert not (tmp_path / "spool").exists() and not (tmp_path / "var").exists()


async def test_a_missing_config_file_is_exit_2(tmp_path: Path) -> None:
    proc = await mta(tmp_path / "nope.toml", "serve")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"mta: {tmp_path / 'nope.toml'}: cannot read config file") and "Traceback" not in err
