"""The control socket: whatever one request holds, it gets one error line and the relay goes on.

Each test talks to the real relay's Unix socket with raw bytes, then proves
the relay still serves: a fresh SMTP client gets 220, its message reaches the
next hop, and ``mta queue list`` (the real console script) answers.
"""

from __future__ import annotations

import json
import logging
import smtplib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from process_support import run_mta
from relay_support import NextHop, start_relay, write_relay_config

from mta.admin.control import ERROR_CODES, MAX_REQUEST
from mta.config import parse_config
from mta.process.relay import Relay
from spool.read import listing as admin


def write_config(tmp_path: Path, hop_port: int) -> Path:
    return write_relay_config(tmp_path, {"*": f"smtp://127.0.0.1:{hop_port}?tls=none"}, retry=None)


def load(path: Path) -> Any:
    return parse_config(path.read_text(), source=str(path), base_dir=str(path.parent))


def ask_raw(sock_path: str, payload: bytes) -> bytes:
    """Send raw bytes as one request (then half-close) and return everything the relay answers."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock_path)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        buf = bytearray()
        while chunk := s.recv(65536):
            buf += chunk
    return bytes(buf)


def one_answer(raw: bytes) -> dict[str, Any]:
    """The answer is exactly one line holding one JSON object with a boolean ``ok``."""
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1, raw[:200]
    answer = json.loads(raw)
    assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool), answer
    if not answer["ok"]:
        assert isinstance(answer["error"], str) and "\n" not in answer["error"], answer
        assert answer["code"] in ERROR_CODES, answer
    return answer


def send_mail(port: int, tag: str) -> None:
    """A fresh client: 220 at connect, then one message accepted."""
    s = smtplib.SMTP(timeout=30)
    try:
        code, _ = s.connect("127.0.0.1", port)
        assert code == 220
        s.ehlo("client.test")
        s.sendmail("a@example.org", ["b@far.example"], f"Subject: {tag}\r\n\r\n{tag}\r\n")
    finally:
        s.close()


def queue_list(config: Path) -> list[Any]:
    run = run_mta("queue", "list", "--json", "--config", str(config), cwd=config.parent)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    messages: list[Any] = json.loads(run.stdout)["messages"]  # every message
    return messages


async def still_serving(relay: Relay, hop: NextHop, config: Path, tag: str) -> None:
    n = len(hop.messages) + 1
    await trio.to_thread.run_sync(send_mail, relay.ports[0], tag)
    got = await hop.wait_messages(n)
    assert tag.encode() in got[-1].data
    assert isinstance(await trio.to_thread.run_sync(queue_list, config), list)


BAD_REQUESTS = {
    "not json": b"list please\n",
    "bad utf-8": b'{"op": "list", "sender": "\xff\xfe"}\n',
    "not an object": b'["list"]\n',
    "float overflow": b'{"op": "list", "limit": 1e400}\n',
    "float overflow in a filter": b'{"op": "list", "min_age": -1e400}\n',
    "nan": b'{"op": "count", "max_age": NaN}\n',
    "huge int": b'{"op": "list", "limit": ' + b"9" * 5000 + b"}\n",
    "big int cursor": b'{"op": "list", "cursor": ' + b"9" * 100 + b"}\n",
    "list for the cursor": b'{"op": "list", "cursor": ["0-1"]}\n',
    "object for the id": b'{"op": "show", "id": {"id": "1A"}}\n',
    "number for an id": b'{"op": "hold", "ids": [26]}\n',
    "string for the ids": b'{"op": "delete", "ids": "1A"}\n',
    "bool for the limit": b'{"op": "list", "limit": true}\n',
    "list for a filter": b'{"op": "count", "domain": ["a.test"]}\n',
    "string for a flag": b'{"op": "show", "id": "1A", "body": "yes"}\n',
    "unknown op": b'{"op": "explode"}\n',
    "op not a string": b'{"op": ["list"]}\n',
    "unknown field": b'{"op": "list", "limti": 5}\n',
    "deep nesting": b"[" * 50_000 + b"\n",
    "70 KB line": b'{"op": "list", "sender": "' + b"x" * 70_000 + b'"}\n',
    "empty": b"",
}


@pytest.mark.parametrize("payload", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
async def test_a_bad_control_request_gets_one_error_line_and_the_relay_goes_on(tmp_path: Path,
                                                                              payload: bytes) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        config = write_config(tmp_path, await hop.start(nursery))
        relay = await start_relay(nursery, load(config))
        sock = relay.config.server.control_socket
        answer = one_answer(await trio.to_thread.run_sync(ask_raw, sock, payload))
        assert answer["ok"] is False
        assert len(answer["error"]) < 200  # the client's bytes are not echoed back whole
        await still_serving(relay, hop, config, "after")
        nursery.cancel_scope.cancel()


async def test_an_unexpected_exception_in_one_request_is_logged_once_and_answered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside one request (here: the queue walk raises) ends that request only."""

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("a bug in the walk")

    async with trio.open_nursery() as nursery:
        hop = NextHop()
        config = write_config(tmp_path, await hop.start(nursery))
        relay = await start_relay(nursery, load(config))
        sock = relay.config.server.control_socket
        with monkeypatch.context() as patch, caplog.at_level(logging.ERROR, logger="mta.control"):
            patch.setattr(admin, "count", broken)
            answer = one_answer(await trio.to_thread.run_sync(ask_raw, sock, b'{"op": "count"}\n'))
        assert answer == {"ok": False, "error": "internal error (RuntimeError); see the relay's log",
                          "code": "internal"}
        failures = [r for r in caplog.records if r.name == "mta.control"]
        assert len(failures) == 1 and failures[0].exc_info is not None
        assert "a bug in the walk" in str(failures[0].exc_info[1])
        assert one_answer(await trio.to_thread.run_sync(ask_raw, sock, b'{"op": "count"}\n')) == {
            "ok": True, "count": 0}
        await still_serving(relay, hop, config, "after-bug")
        nursery.cancel_scope.cancel()


async def test_a_request_at_the_size_limit_is_served_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        config = write_config(tmp_path, await hop.start(nursery))
        relay = await start_relay(nursery, load(config))
        sock = relay.config.server.control_socket
        head, tail = b'{"op": "count", "sender": "', b'"}'
        fits = head + b"x" * (MAX_REQUEST - len(head) - len(tail)) + tail
        assert len(fits) == MAX_REQUEST
        assert one_answer(await trio.to_thread.run_sync(ask_raw, sock, fits + b"\n")) == {"ok": True, "count": 0}
        over = one_answer(await trio.to_thread.run_sync(ask_raw, sock, fits + b" \n"))
        assert over == {"ok": False, "error": f"request too large (over {MAX_REQUEST} bytes)", "code": "bad_request"}
        await still_serving(relay, hop, config, "after")
        nursery.cancel_scope.cancel()


# -- fuzz: any JSON value, any bytes -------------------------------------------------


class ThreadedRelay:
    """A relay and a next hop in a trio loop on a thread, so that Hypothesis (synchronous) can drive it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start() or stop()
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        self.stop_event = trio.Event()
        async with trio.open_nursery() as nursery:
            self.hop = NextHop()
            self.config = write_config(self.tmp_path, await self.hop.start(nursery))
            self.relay = await start_relay(nursery, load(self.config))
            self.token = trio.lowlevel.current_trio_token()
            self.ready.set()
            await self.stop_event.wait()
            nursery.cancel_scope.cancel()

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(60) and self.error is None, self.error

    def stop(self) -> None:
        trio.from_thread.run_sync(self.stop_event.set, trio_token=self.token)
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None, self.error

    def still_serving(self, tag: str) -> None:
        trio.from_thread.run(still_serving, self.relay, self.hop, self.config, tag, trio_token=self.token)


@pytest.fixture
def threaded_relay(tmp_path: Path) -> Iterator[ThreadedRelay]:
    relay = ThreadedRelay(tmp_path)
    relay.start()
    try:
        yield relay
    finally:
        relay.stop()


FIELDS = ["op", "sender", "recipient", "domain", "min_age", "max_age", "held", "in_doubt", "limit", "cursor",
          "id", "body", "top", "ids"]
OPS = ["list", "count", "show", "shape", "hold", "release", "delete", "flush"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20) | st.sampled_from(OPS),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
requests = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5).flatmap(
    lambda fields: st.sampled_from(OPS).map(lambda op: {"op": op, **fields}) | st.just(fields))
raw_texts = st.sampled_from(["1e400", "-1e999", "NaN", "Infinity", "9" * 4400, '"\\ud800"', "[" * 3000, "{"])
payloads = (requests.map(lambda r: json.dumps(r).encode() + b"\n")
            | json_values.map(lambda v: json.dumps(v).encode() + b"\n")
            | st.builds(lambda op, raw: f'{{"op": "{op}", "limit": {raw}, "cursor": {raw}}}\n'.encode(),
                        st.sampled_from(OPS), raw_texts)
            | st.binary(max_size=300))


def test_any_json_value_or_bytes_on_the_control_socket_gets_one_answer(threaded_relay: ThreadedRelay) -> None:
    """Hypothesis throws requests with fields of any JSON type, raw numbers json cannot hold, and any bytes."""
    sock = threaded_relay.relay.config.server.control_socket

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(payloads)
    def one(payload: bytes) -> None:
        one_answer(ask_raw(sock, payload))

    one()
    threaded_relay.still_serving("after-fuzz")
