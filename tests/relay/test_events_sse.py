"""``GET /events`` as server-sent events, read by curl: frames with the event ids, live as mail arrives,
heartbeats when there is nothing, resumption at ``Last-Event-ID`` in the middle of a record's events, the
stream ended after ``sse_max_time``, and clear refusals.

The relay runs in the test; mail goes in over SMTP and out to a discarding
route. curl (``-N``: no buffering) is the client, as an operator would
first try it.
"""

from __future__ import annotations

import json
import smtplib
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from relay_support import relay_config, start_relay

EXTRA = """
[events]
listen = "127.0.0.1:0"
sse_heartbeat = "0.3s"
sse_max_time = "{max_time}"
"""

pytestmark = pytest.mark.slow


def send(port: int, tag: str, recipients: int = 1) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("a@src.example", [f"{tag}{i}@sink.test" for i in range(recipients)],
                   f"Subject: {tag}\r\n\r\nbody\r\n")


class Curl:
    """``curl -N`` reading the stream; ``frames`` its events as (id, data), ``comments`` its comment lines."""

    def __init__(self, port: int, *headers: str, query: str = "") -> None:
        self.argv = ["curl", "-sS", "-N", "-H", "Accept: text/event-stream"]
        for h in headers:
            self.argv += ["-H", h]
        self.argv.append(f"http://127.0.0.1:{port}/events{query}")
        self.frames: list[dict[str, Any]] = []
        self.comments = 0
        self.ended = trio.Event()
        self._more = trio.Event()
        self._buf = ""
        self.proc: trio.Process | None = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.proc = await trio.lowlevel.open_process(self.argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        task_status.started()
        assert self.proc.stdout is not None
        while chunk := await self.proc.stdout.receive_some(65536):
            self._buf += chunk.decode()
            while "\n\n" in self._buf:
                block, self._buf = self._buf.split("\n\n", 1)
                fields: dict[str, Any] = {}
                for line in block.split("\n"):
                    if line.startswith(":"):
                        self.comments += 1
                    else:
                        name, _, value = line.partition(": ")
                        fields[name] = value
                if "data" in fields:
                    self.frames.append(fields)
            self._more.set()
            self._more = trio.Event()
        await self.proc.wait()
        self.ended.set()

    async def until(self, done: Any) -> None:
        while not done(self):
            await self._more.wait()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(f["data"]) for f in self.frames if "event" not in f]

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()


def kinds(curl: Curl, kind: str) -> int:
    return sum(e["kind"] == kind for e in curl.events())


async def test_a_curl_client_gets_the_stream_live_with_heartbeats_and_resumes_at_last_event_id(
        tmp_path: Path) -> None:
    config = relay_config(str(tmp_path), {"sink.test": "discard"}, extra=EXTRA.format(max_time="60s"))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            relay = await start_relay(nursery, config)
            port = relay.events_listeners[0].socket.getsockname()[1]
            smtp = relay.listeners[0].socket.getsockname()[1]
            await trio.to_thread.run_sync(send, smtp, "two", 2)  # one record with two recipients' outcomes
            first = Curl(port)
            await nursery.start(first.run)
            await first.until(lambda c: kinds(c, "delivered") >= 2)
            for f in first.frames:
                assert f["id"] == json.loads(f["data"])["id"]  # id: is the event id
            beats = first.comments
            await first.until(lambda c: c.comments >= beats + 2)  # nothing new: heartbeats
            await trio.to_thread.run_sync(send, smtp, "live")  # and new mail shows up on the open stream
            await first.until(lambda c: kinds(c, "delivered") >= 3)
            ids = [e["id"] for e in first.events()]
            assert len(ids) == len(set(ids))
            first.kill()

            # Resume in the middle of a record's events: after the first recipient's outcome, the second comes
            # first and nothing is repeated.
            outcome = next(e["id"] for e in first.events() if e["kind"] == "delivered" and e["id"].endswith("/0"))
            again = Curl(port, f"Last-Event-ID: {outcome}")
            await nursery.start(again.run)
            await again.until(lambda c: len(c.events()) >= len(ids) - ids.index(outcome) - 1)
            assert [e["id"] for e in again.events()] == ids[ids.index(outcome) + 1:]
            again.kill()

            # A whole-record id resumes after that record.
            received = next(e["id"] for e in first.events() if e["kind"] == "received")
            third = Curl(port, f"Last-Event-ID: {received}")
            await nursery.start(third.run)
            await third.until(lambda c: len(c.events()) >= len(ids) - ids.index(received) - 1)
            assert [e["id"] for e in third.events()] == ids[ids.index(received) + 1:]
            third.kill()
            nursery.cancel_scope.cancel()


async def test_a_stream_ends_after_sse_max_time_and_bad_requests_get_a_400(tmp_path: Path) -> None:
    config = relay_config(str(tmp_path), {"sink.test": "discard"}, extra=EXTRA.format(max_time="1s"))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            relay = await start_relay(nursery, config)
            port = relay.events_listeners[0].socket.getsockname()[1]
            curl = Curl(port)
            nursery.start_soon(curl.run)
            with trio.fail_after(20):
                await curl.ended.wait()  # the relay ended the stream; an EventSource reconnects
            assert curl.comments >= 1

            def status(*headers: str, query: str = "") -> tuple[str, str]:
                argv = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "-H", "Accept: text/event-stream"]
                for h in headers:
                    argv += ["-H", h]
                out = subprocess.run([*argv, f"http://127.0.0.1:{port}/events{query}"], capture_output=True,
                                     text=True, timeout=30).stdout
                body, _, code = out.rpartition("\n")
                return code, body

            code, body = await trio.to_thread.run_sync(status, "Last-Event-ID: nonsense")
            assert code == "400" and "Last-Event-ID: not an event id" in json.loads(body)["error"]
            code, body = await trio.to_thread.run_sync(lambda: status(query="?consumer=c1"))
            assert code == "400" and "consumer: not with Accept: text/event-stream" in json.loads(body)["error"]
            nursery.cancel_scope.cancel()
