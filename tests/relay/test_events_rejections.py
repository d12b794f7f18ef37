"""SMTP rejections in the stream: the real relay refuses RCPTs, and ``mta events --rejections`` and
``GET /events?stream=rejections`` show each once, with ids ``r:SEQ`` that go on across a restart; the byte
cap keeps the directory bounded and a reader left behind is told the gap.
"""

from __future__ import annotations

import json
import os
import smtplib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
from process_support import run_mta
from relay_support import start_relay, write_relay_config

from mta.config import load_config

pytestmark = pytest.mark.slow


def refuse(port: int, n: int, tag: str) -> list[int]:
    """``n`` RCPTs the relay refuses (a domain it does not route); their reply codes."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.example")
        s.mail("a@src.example")
        codes = [s.rcpt(f"{tag}{i}@nowhere.example")[0] for i in range(n)]
        s.rset()
    return codes


def get(port: int, query: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/events{query}", timeout=30) as answer:
        body: dict[str, Any] = json.loads(answer.read())
        return body


def cli(path: Path, *args: str) -> list[dict[str, Any]]:
    out = run_mta("events", "--rejections", "--json", "--config", str(path), *args, cwd=path.parent)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


async def wait_rejections(port: int, n: int) -> list[dict[str, Any]]:
    with trio.fail_after(30):
        while True:
            page = await trio.to_thread.run_sync(get, port, f"?stream=rejections&wait=5&limit={n + 10}")
            if len(page["events"]) >= n:
                return page["events"]  # type: ignore[no-any-return]
            await trio.sleep(0.05)  # the next long poll; bounded by the deadline


EXTRA = """
[events]
listen = "127.0.0.1:0"
rejections_max = "{cap}"
"""


async def test_refused_recipients_are_in_the_rejections_stream_with_ids_that_go_on_after_a_restart(
        tmp_path: Path) -> None:
    path = write_relay_config(tmp_path, {"sink.test": "discard"}, extra=EXTRA.format(cap="1MiB"))
    config = load_config(path)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        port, smtp = relay.events_listeners[0].socket.getsockname()[1], relay.listeners[0].socket.getsockname()[1]
        codes = await trio.to_thread.run_sync(refuse, smtp, 3, "first")
        assert all(500 <= c < 600 for c in codes)
        got = await wait_rejections(port, 3)
        assert [e["id"] for e in got] == ["r:1", "r:2", "r:3"]
        assert all(e["kind"] == "rejected" and e["command"] == "RCPT" and e["client"] == "127.0.0.1" and
                   e["reply"].startswith(str(codes[0])) and e["sender"] == "<a@src.example>" for e in got)
        assert got[1]["arg"].startswith("TO:<first1@nowhere.example>")
        page = await trio.to_thread.run_sync(get, port, "?stream=rejections&after=r:2")
        assert [e["id"] for e in page["events"]] == ["r:3"] and page["next"] == "r:3"
        assert await trio.to_thread.run_sync(cli, path) == got  # the CLI reads the same files
        assert [e["id"] for e in await trio.to_thread.run_sync(cli, path, "--from", "r:2")] == ["r:2", "r:3"]
        # the message stream is untouched: rejections are not records
        page = await trio.to_thread.run_sync(get, port, "")
        assert not [e for e in page["events"] if e["kind"] == "rejected"]
        nursery.cancel_scope.cancel()
    relay.aspool.core.close()  # lets go of the spool's lock, as the process's end would
    async with trio.open_nursery() as nursery:  # a restart (the same spool): ids go on, none reused
        relay = await start_relay(nursery, config)
        port, smtp = relay.events_listeners[0].socket.getsockname()[1], relay.listeners[0].socket.getsockname()[1]
        await trio.to_thread.run_sync(refuse, smtp, 2, "second")
        got = await wait_rejections(port, 5)
        assert [e["id"] for e in got] == ["r:1", "r:2", "r:3", "r:4", "r:5"]
        assert got[3]["arg"].startswith("TO:<second0@nowhere.example>")
        with pytest.raises(urllib.error.HTTPError) as refused:
            await trio.to_thread.run_sync(get, port, "?stream=rejections&after=nonsense")
        assert refused.value.code == 400 and "not a rejection id" in json.loads(refused.value.read())["error"]
        nursery.cancel_scope.cancel()


async def test_the_byte_cap_bounds_the_directory_and_a_reader_left_behind_is_told_the_gap(tmp_path: Path) -> None:
    path = write_relay_config(tmp_path, {"sink.test": "discard"}, extra=EXTRA.format(cap="8KiB"))
    config = load_config(path)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        port, smtp = relay.events_listeners[0].socket.getsockname()[1], relay.listeners[0].socket.getsockname()[1]
        for round_ in range(6):  # sessions of 20 refusals: an attacker's stream of bad RCPTs
            await trio.to_thread.run_sync(refuse, smtp, 20, f"x{round_}-")
        with trio.fail_after(30):
            while True:
                page = await trio.to_thread.run_sync(get, port, "?stream=rejections&after=r:1&limit=1000")
                if page["horizon"] == "r:120":
                    break
                await trio.sleep(0.05)  # polling the durable horizon, with a deadline
        directory = Path(config.spool.dir) / "rejections"
        files = [f for f in os.listdir(directory) if f.endswith(".jsonl")]
        assert len(files) == 2
        assert sum((directory / f).stat().st_size for f in files) <= 8 * 1024 + 2048  # the cap and a line or two
        assert page["lagged"] is True and page["gap"][0] == "r:2"
        kept = [int(e["id"][2:]) for e in page["events"]]
        assert kept == list(range(kept[0], 121))  # what is kept is whole, in order, to the last one
        assert page["gap"][1] == f"r:{kept[0] - 1}"
        nursery.cancel_scope.cancel()
