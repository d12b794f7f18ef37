"""A run of ``mta serve`` that makes every kind of log line once, in either format ([log] format).

tests/relay/test_log_formats.py runs it and checks the lines; docs/operations.md
shows its output. To print a sample of each kind (what the docs show)::

    .venv/bin/python tests/support/log_scenario.py text
    .venv/bin/python tests/support/log_scenario.py json
    .venv/bin/python tests/support/log_scenario.py mail   # the Received: header and a DSN it wrote

What it does, against real next hops on 127.0.0.1: a message over STARTTLS
to a Maildir (accepted, tls in, delivery sent); one relayed over TLS to a next
hop (tls out); one the next hop refuses (bounced, bounce, the DSN delivered);
one to a port where nothing listens until it expires (connect_failed,
deferred, expired); one the next hop defers, then held and released with
``mta queue`` (admin); refused commands (reject, with an escape sequence in
one); and a client that breaks off its TLS handshake (tls_failed).
"""

from __future__ import annotations

import json
import os
import re
import smtplib
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trustme
from logfmt import parse_kv
from relay_support import NextHop, RawClient

from mta.smtp.common import Reply

MTA = os.path.join(os.path.dirname(sys.executable), "mta")
TIMEOUT = 120
# The kinds of line the scenario must produce: (event, a field that tells the variants apart, or None).
KINDS: tuple[tuple[str, str, str], ...] = (
    ("accepted", "", ""),
    ("reject", "reason", "unknown_command"),
    ("reject", "reason", "relay"),
    ("reject", "reason", "control_character"),
    ("tls", "direction", "in"),
    ("tls", "direction", "out"),
    ("tls_failed", "direction", "in"),
    ("delivery", "status", "sent"),
    ("delivery", "status", "bounced"),
    ("delivery", "status", "deferred"),
    ("delivery", "status", "expired"),
    ("bounce", "", ""),
    ("connect_failed", "cause", "refused"),
    ("admin", "command", "hold"),
    ("admin", "command", "release"),
)


def parse_line(line: str, fmt: str) -> dict[str, Any]:
    """One stderr line as a dict: the JSON object, or the text line's prefix fields and logfmt pairs."""
    if fmt == "json":
        parsed = json.loads(line)
        assert isinstance(parsed, dict), line
        return parsed
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (\S+)\[(\d+)\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                     r"(.*)", line)
    assert m, f"not a text log line: {line!r}"
    out: dict[str, Any] = {"ts": m.group(1), "logger": m.group(2), "pid": int(m.group(3)),
                           "level": m.group(4).lower()}
    message = m.group(5)
    if message.startswith("event="):
        out.update(parse_kv(message))
    else:
        out["msg"] = message
    return out


class Serve:
    """``mta serve`` in a subprocess, its stderr read line by line; tests wait for lines, never for time."""

    def __init__(self, config: Path, fmt: str) -> None:
        self.config = config
        self.fmt = fmt
        self.lines: list[str] = []
        self.parsed: list[dict[str, Any]] = []
        self._changed = trio.Event()
        self.proc: trio.Process | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.proc = await trio.lowlevel.open_process(
            [MTA, "serve", "--config", str(self.config)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        task_status.started()
        assert self.proc.stderr is not None
        buf = b""
        try:
            while chunk := await self.proc.stderr.receive_some(65536):
                *done, buf = (buf + chunk).split(b"\n")
                for raw in done:
                    line = raw.decode("utf-8")  # the relay writes UTF-8 (JSON: ASCII); anything else fails here
                    self.lines.append(line)
                    self.parsed.append(parse_line(line, self.fmt))
                self._changed.set()
                self._changed = trio.Event()
        finally:
            self.proc.kill()
            await self.proc.wait()

    async def wait(self, what: Callable[[dict[str, Any]], bool], n: int = 1) -> list[dict[str, Any]]:
        with trio.fail_after(TIMEOUT):
            while len(found := [p for p in self.parsed if what(p)]) < n:
                await self._changed.wait()
        return found

    async def wait_event(self, event: str, **fields: str) -> dict[str, Any]:
        def match(p: dict[str, Any]) -> bool:
            return p.get("event") == event and all(str(p.get(k)) == v for k, v in fields.items())
        return (await self.wait(match))[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _send(port: int, rcpt: str, ca: trustme.CA | None = None, sender: str = "alice@localhost") -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.example")
        if ca is not None:
            ctx = ssl.create_default_context()
            ca.configure_trust(ctx)
            s.starttls(context=ctx)
            s.ehlo("client.example")
        s.mail(sender)
        s.rcpt(rcpt)
        code, text = s.data(f"Subject: to {rcpt}\r\n\r\nhello\r\n".encode())
        assert code == 250, text
        return text.decode().rsplit(" ", 1)[1]


async def _change(config: Path, op: str, qid: str) -> None:
    """``mta queue OP QID``; again while the message is busy being delivered (it is retried every second)."""
    for _ in range(50):
        done = await trio.run_process([MTA, "queue", op, qid, "--json", "--config", str(config)],
                                      capture_stdout=True, capture_stderr=True, check=False)
        answer = json.loads(done.stdout or b"{}")
        if qid in answer.get("done", []):
            return
        # Busy: being delivered, or moved by its retry between the look and the change (asked again either way).
        why = answer.get("errors", {}).get(qid, "")
        assert "being delivered" in why or "changed while we looked" in why, (done.stdout, done.stderr)
    raise AssertionError(f"{op} {qid} never went through")


async def scenario(tmp: Path, fmt: str) -> Serve:
    """Run the relay in ``fmt`` through every kind of line (``KINDS``); returns what it wrote."""
    ca = trustme.CA()
    cert = ca.issue_cert("relay.example", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp / "relay.pem"))
    os.chmod(tmp / "relay.pem", 0o600)  # the relay refuses a key other users could read
    hop_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(hop_ctx)

    def policy(stage: str, value: object) -> Reply | None:
        if stage == "rcpt" and str(value).startswith("nobody@"):
            return Reply(550, "5.1.1", "no such user")
        if stage == "rcpt" and str(value).startswith("later@"):
            return Reply(451, "4.3.0", "try again later")
        return None

    async with trio.open_nursery() as nursery:
        hop = NextHop(policy, ssl_context=hop_ctx)
        hop_port = await hop.start(nursery)
        config = tmp / "relay.toml"
        config.write_text(f"""
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.example"
tls_cert = "{tmp / 'relay.pem'}"
tls_key = "{tmp / 'relay.pem'}"
command_timeout = "5s"
[relay]
mynetworks = []
relay_domains = ["far.example", "down.example"]
[spool]
dir = "{tmp / 'spool'}"
retry_intervals = ["1s"]
max_queue_lifetime = "15s"  # down.example expires; later@ must outlive a hold and a release under load
[log]
format = "{fmt}"
[routes]
"localhost" = "maildir:{tmp / 'maildir'}"
"far.example" = "smtp://127.0.0.1:{hop_port}"
"down.example" = "smtp://127.0.0.1:{_closed_port()}"
""")
        serve = Serve(config, fmt)
        await nursery.start(serve.run)
        ready = await serve.wait(lambda p: "listening on" in str(p.get("msg", "")))
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", ready[0]["msg"]).group(1))  # type: ignore[union-attr]

        tls_qid = await trio.to_thread.run_sync(lambda: _send(port, "bob@localhost", ca))
        await serve.wait_event("delivery", qid=tls_qid, status="sent")
        far = await trio.to_thread.run_sync(_send, port, "carol@far.example")
        await serve.wait_event("delivery", qid=far, status="sent")
        bounced = await trio.to_thread.run_sync(_send, port, "nobody@far.example")
        await serve.wait_event("bounce", qid=bounced)
        down = await trio.to_thread.run_sync(_send, port, "dave@down.example")
        later = await trio.to_thread.run_sync(_send, port, "later@far.example")
        await serve.wait_event("delivery", qid=later, status="deferred")
        await _change(config, "hold", later)
        await _change(config, "release", later)

        c = await RawClient.connect(port)
        await c.reply()
        await c.command(b"EHLO client.example")
        await c.command(b"FROB")
        await c.command(b"MAIL FROM:<alice@localhost>")
        await c.command(b"RCPT TO:<eve@elsewhere.example>")
        await c.command(b"NOOP \x1b[31mred")
        await c.command(b"QUIT")
        await c.aclose()
        c = await RawClient.connect(port)
        await c.reply()
        await c.command(b"EHLO client.example")
        assert (await c.command(b"STARTTLS"))[0].startswith(b"220")
        await c.send(b"this is not a TLS ClientHello\r\n" * 4)
        await c.closed()
        await c.aclose()
        await serve.wait_event("tls_failed")

        await serve.wait_event("delivery", qid=down, status="expired")
        await serve.wait_event("bounce", qid=down)
        nursery.cancel_scope.cancel()
    return serve


def samples(serve: Serve) -> list[str]:
    """One line of each kind (the first), in ``KINDS``' order, then the first plain message."""
    out = []
    for event, key, value in KINDS:
        for line, parsed in zip(serve.lines, serve.parsed, strict=True):
            if parsed.get("event") == event and (not key or parsed.get(key) == value):
                out.append(line)
                break
    out += [line for line, parsed in zip(serve.lines, serve.parsed, strict=True) if "msg" in parsed][:1]
    return out


def mail_samples(tmp: Path) -> str:
    """The trace header of the message received over TLS, and the DSN's report (its second part)."""
    (name,) = os.listdir(tmp / "maildir" / "bob" / "new")
    message = (tmp / "maildir" / "bob" / "new" / name).read_bytes().decode()
    received = "Received:" + message.split("\r\nReceived:", 1)[1].split("\r\nSubject:", 1)[0]
    for name in sorted(os.listdir(tmp / "maildir" / "alice" / "new")):
        dsn = (tmp / "maildir" / "alice" / "new" / name).read_bytes().decode()
        if "no such user" in dsn:
            boundary = re.search(r'boundary="([^"]+)"', dsn).group(1)  # type: ignore[union-attr]
            report = dsn.split(f"--{boundary}")[2].strip()
            text = dsn.split(f"--{boundary}")[1].strip()
            return "\n\n".join(x.replace("\r\n", "\n") for x in (received, text, report))
    raise AssertionError("no DSN for nobody@far.example")


def main() -> None:
    """``text`` or ``json``: a sample of each kind of line; ``mail``: what the relay wrote into mail."""
    import tempfile

    what = sys.argv[1] if len(sys.argv) > 1 else "text"
    with tempfile.TemporaryDirectory() as tmp:
        serve = trio.run(scenario, Path(tmp), "text" if what == "mail" else what)
        print(mail_samples(Path(tmp)) if what == "mail" else "\n".join(samples(serve)))


if __name__ == "__main__":
    main()
