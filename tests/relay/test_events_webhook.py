"""The webhook shipper against a receiver on 127.0.0.1 that fails and recovers: every event arrives at least
once, one message's events in order, every batch signed.

The relay runs in the test; the shipper is its own process (``mta events
ship webhook``), as in production, and is killed with SIGKILL once midway
and started again. The receiver answers the first batches with a 500, drops
a connection without an answer, then is down altogether (connection
refused) for a while, then takes everything. At the end, what it took is
compared with the stream itself (``spool.EventStream``, the same events
``mta events`` shows).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import signal
import smtplib
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from process_support import MTA
from relay_support import NextHop, start_relay, write_relay_config

from mta.config import load_config
from mta.smtp.common import Reply
from spool import EventStream, load_cursor, parse_pos

pytestmark = pytest.mark.slow

SECRET = b"s3cret-for-the-test"


class Receiver:
    """An HTTP receiver whose answers follow ``script`` ("500", "drop"), then 200; ``down()`` closes its port."""

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.bodies: list[tuple[dict[str, str], bytes]] = []  # the batches it answered 200 to
        self.failed = 0
        self.port = 0
        self._scope: trio.CancelScope | None = None
        self.changed = trio.Event()

    async def start(self, nursery: trio.Nursery) -> None:
        self._scope = trio.CancelScope()
        scope = self._scope

        async def run(task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await trio.serve_tcp(self._handle, self.port, host="127.0.0.1", task_status=task_status)

        listeners = await nursery.start(run)
        self.port = listeners[0].socket.getsockname()[1]

    def down(self) -> None:
        assert self._scope is not None
        self._scope.cancel()

    async def _handle(self, stream: trio.SocketStream) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers["content-length"]):
            body += await stream.receive_some(65536)
        action = self.script.pop(0) if self.script else "200"
        if action == "drop":
            self.failed += 1
            await stream.aclose()
            return
        if action == "500":
            self.failed += 1
            await stream.send_all(b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        else:
            self.bodies.append((headers, body))
            await stream.send_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        await stream.aclose()
        self.changed.set()
        self.changed = trio.Event()

    def events(self) -> list[dict[str, Any]]:
        return [e for _, body in self.bodies for e in json.loads(body)["events"]]


def policy(stage: str, value: Any) -> Reply | None:
    if stage == "rcpt" and str(value).startswith("later"):
        return Reply(451, "4.3.0", "try again later")
    return None


def send(port: int, first: int, n: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for i in range(first, first + n):
            rcpts = [f"ok{i}@far.example"] + ([f"later{i}@far.example"] if i % 4 == 0 else [])
            s.sendmail("a@src.example", rcpts, f"Subject: w {i}\r\n\r\nbody {i}\r\n")


async def test_a_failing_receiver_gets_every_event_at_least_once_in_order_and_signed(tmp_path: Path) -> None:
    secret = tmp_path / "webhook.key"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            await hop.start(nursery)
            receiver = Receiver(["500", "500", "drop"])
            await receiver.start(nursery)
            extra = f"""
[events]
webhook_url = "http://127.0.0.1:{receiver.port}/hook"
webhook_secret_file = "{secret}"
webhook_batch_events = 7
webhook_batch_time = "0.2s"
webhook_retry_max = "1s"
webhook_timeout = "5s"
"""
            path = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                      extra=extra)
            config = load_config(path)
            relay = await start_relay(nursery, config)
            smtp = relay.listeners[0].socket.getsockname()[1]
            await trio.to_thread.run_sync(send, smtp, 0, 12)

            said: list[str] = []
            said_more = trio.Event()

            async def read_log(proc: trio.Process) -> None:
                nonlocal said_more
                assert proc.stderr is not None
                while chunk := await proc.stderr.receive_some(65536):
                    said.extend(chunk.decode(errors="replace").splitlines())
                    said_more.set()
                    said_more = trio.Event()

            async def shipper() -> trio.Process:
                proc = await trio.lowlevel.open_process([MTA, "events", "ship", "webhook", "--config", str(path)],
                                                        cwd=str(tmp_path), stdin=subprocess.DEVNULL,
                                                        stderr=subprocess.PIPE)
                nursery.start_soon(read_log, proc)
                return proc

            proc = await shipper()
            try:
                with trio.fail_after(60):
                    while not receiver.bodies:
                        await receiver.changed.wait()
                assert receiver.failed == 3  # two 500s and a dropped connection, each retried
                proc.send_signal(signal.SIGKILL)  # a crash of the shipper midway
                await proc.wait()
                receiver.down()
                await trio.to_thread.run_sync(send, smtp, 12, 12)
                proc = await shipper()
                # it retries against the closed port (connection refused), twice, before the receiver is back
                with trio.fail_after(30):
                    while sum("Connection refused" in line for line in said) < 2:
                        await said_more.wait()
                await receiver.start(nursery)
                stream = EventStream(config.spool.dir)
                with trio.fail_after(90):
                    while True:
                        want = {e.id for e in (await trio.to_thread.run_sync(stream.read)).events}
                        oks = {f"ok{i}@far.example" for i in range(24)}
                        done = oks <= {r for m in hop.messages for r in m.recipients}
                        # The shipper stores its cursor after the receiver's 2xx reached it: wait for that too.
                        stored = load_cursor(relay.aspool.core.io, config.spool.dir, "webhook")
                        if done and want <= {e["id"] for e in receiver.events()} and stored is not None \
                                and stored >= max(parse_pos(i.split("/")[0]) for i in want):
                            break
                        await trio.sleep(0.2)  # polling the receiver's and the relay's state, with a deadline
            finally:
                proc.kill()
            got = receiver.events()
            assert want <= {e["id"] for e in got}
            assert {e["id"] for e in got} <= want | {e.id for e in stream.read().events}
            # in order per message: each message's events, first arrivals, in the order of their ids
            first_seen: dict[str, list[tuple[int, int]]] = {}
            shown: set[str] = set()
            for e in got:
                if e["id"] in shown:
                    continue
                shown.add(e["id"])
                pos, _, index = e["id"].partition("/")
                first_seen.setdefault(e["queue_id"], []).append((parse_pos(pos), int(index or -1)))
            assert all(ids == sorted(ids) for ids in first_seen.values())
            kinds = {e["kind"] for e in got}
            assert {"received", "delivered", "deferred", "retry_scheduled"} <= kinds
            for headers, body in receiver.bodies:
                expected = "sha256=" + hmac.new(SECRET, headers["x-logspool-timestamp"].encode() + b"." + body,
                                                hashlib.sha256).hexdigest()
                assert headers["x-logspool-signature"] == expected
                assert len(json.loads(body)["events"]) <= 7 + 1  # a record's outcomes are never split
            cursor = load_cursor(relay.aspool.core.io, config.spool.dir, "webhook")
            assert cursor is not None and cursor >= max(parse_pos(i.split("/")[0]) for i in want)
            nursery.cancel_scope.cancel()


def test_the_shipper_refuses_to_run_without_a_url_or_with_a_secret_others_can_read(tmp_path: Path) -> None:
    path = write_relay_config(tmp_path, {})
    (tmp_path / "spool" / "log").mkdir(parents=True)
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    out = run([MTA, "events", "ship", "webhook", "--config", str(path)])
    assert out.returncode == 2 and "events.webhook_url: not set" in out.stderr and len(out.stderr.splitlines()) == 1
    key = tmp_path / "open.key"
    key.write_text("k")
    key.chmod(0o644)
    path.write_text(path.read_text() + f'\n[events]\nwebhook_url = "http://127.0.0.1:9/"\n'
                                       f'webhook_secret_file = "{key}"\n')
    out = run([MTA, "events", "ship", "webhook", "--config", str(path)])
    assert out.returncode == 2 and "is open to other users (mode 0644)" in out.stderr, out.stderr
    path.write_text(path.read_text().replace("http://127.0.0.1:9/", "ftp://x/"))
    out = run([MTA, "events", "ship", "webhook", "--config", str(path)])
    assert out.returncode == 2 and "is not an http:// or https:// URL" in out.stderr, out.stderr
