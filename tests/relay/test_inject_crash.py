"""kill -9 of the relay during 1,000 batch injection requests, each retried by its client until ``200``.

Eight clients send 1,000 requests of three recipients each, every request
with its own ``Idempotency-Key``; the relay process is killed with SIGKILL
four times while requests are in flight (at set points of the progress, so
that kills land mid-request) and started again. A client retries a request
that got no answer (a reset, a refused connection, a 5xx) with the same key
until it gets ``200``. At the end every (key, recipient) has exactly one
message: one Message-ID among the delivered mail (a crash may deliver one
message twice into the Maildir, with the same Message-ID, as ``in_doubt =
"redeliver"`` allows; an injection made twice would have two), the queue is empty, and the last answer of each key
names three distinct queue ids.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
from http_client import inject
from inject_support import ApiRelay, delivered, write_config
from process_support import mta_json

pytestmark = pytest.mark.slow

REQUESTS = 1000
RECIPIENTS = 3
CLIENTS = 8
KILLS_AT = (120, 350, 600, 850)  # answered requests at which the relay is killed


def payload(i: int) -> dict[str, Any]:
    return {"envelope_sender": "bulk@example.org",
            "content": "Subject: batch {{ key }}\nX-Key: {{ key }}\n\nfor {{ email }}\n",
            "substitutions": {"key": f"req-{i}"},
            "recipients": [{"email": f"r{j}@example.net"} for j in range(RECIPIENTS)]}


async def test_kill_9_during_batch_requests_leaves_one_message_per_key_and_recipient(tmp_path: Path) -> None:
    # A maildir delivery cut by the kill is in doubt; delivered again (same Message-ID), not held for an operator.
    config = write_config(tmp_path, spool_extra='in_doubt = "redeliver"')
    relay = ApiRelay(config)
    answers: dict[int, Any] = {}
    retries = 0
    up = trio.Event()
    todo = iter(range(REQUESTS))

    async def client() -> None:
        nonlocal retries
        for i in todo:
            while True:
                await up.wait()
                try:
                    r = await inject(relay.http_port, payload(i), key=f"req-{i}", timeout=30)
                except (OSError, trio.BrokenResourceError, h11.ProtocolError):
                    r = None
                if r is not None and r.status == 200:
                    answers[i] = r.json()
                    break
                retries += 1
                if r is not None and r.status not in (0, 500, 503):
                    raise AssertionError(f"request {i}: {r}")

    async with trio.open_nursery() as nursery:
        await relay.start(nursery)
        up.set()
        async with trio.open_nursery() as clients:
            for _ in range(CLIENTS):
                clients.start_soon(client)
            for mark in KILLS_AT:
                with trio.fail_after(300):
                    while len(answers) < mark:
                        await trio.sleep(0.01)  # polled: the clients' progress is the trigger, not a time
                up = trio.Event()
                await relay.kill()
                await relay.start(nursery)
                up.set()
        assert len(answers) == REQUESTS and retries > 0
        for i, answer in answers.items():
            assert answer["success_count"] == RECIPIENTS and answer["fail_count"] == 0, (i, answer)
        ids = [q["queue_id"] for a in answers.values() for q in a["ids"]]
        assert len(set(ids)) == REQUESTS * RECIPIENTS
        queued = -1
        with trio.move_on_after(120):
            while len(per_pair(tmp_path)) < REQUESTS * RECIPIENTS or queued != 0:
                queued = (await mta_json(config, "queue", "count"))["count"]
                await trio.sleep(0.2)  # polled: the Maildir and the queue are the relay's output
        assert queued == 0, f"{queued} still queued, {len(per_pair(tmp_path))} (key, recipient) delivered"
        pairs = per_pair(tmp_path)
        assert len(pairs) == REQUESTS * RECIPIENTS
        made_twice = {pair: ids for pair, ids in pairs.items() if len(ids) != 1}
        assert not made_twice, f"{len(made_twice)} (key, recipient) with more than one message: " \
                               f"{list(made_twice.items())[:3]}"
        nursery.cancel_scope.cancel()


def per_pair(tmp: Path) -> dict[tuple[str, str], set[str]]:
    """(X-Key, recipient) -> the Message-IDs delivered for it."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for msg in delivered(tmp):
        out[str(msg["X-Key"]), str(msg["Delivered-To"])].add(str(msg["Message-ID"]))
    return out


