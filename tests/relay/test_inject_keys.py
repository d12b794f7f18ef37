"""Idempotency keys rebuilt at start: from their file, and from the log for requests a crash cut short.

The spool is a real one (files, fsync); the states are those a crash leaves:
an intent fsynced and the request's messages durable but no ``done`` line; an
intent whose messages never became durable; a torn last line; keys past the
window. The last test runs the relay process on such a state and retries the
request: the message the crash left is answered, the missing one is made.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import trio
from http_client import inject
from inject_support import ApiRelay, wait_delivered, write_config

from mta.http.idempotency import EXTRA_INDEX, EXTRA_KEY, KEY_FILE, KeyStore, fingerprint
from spool import Spool

DAY = 86400.0


def spool_with(path: Path, messages: list[tuple[str, int]]) -> tuple[Spool, list[str], int]:
    """A spool holding one durable message per (key, index); its queue ids and the head before them."""
    core = Spool.open(str(path))
    head = core.head
    ids = [core.queue_id(core.enqueue("s@example.org", [f"r{i}@example.net"], b"Subject: x\r\n\r\nx\r\n",
                                      extra={EXTRA_KEY: key, EXTRA_INDEX: i})) for key, i in messages]
    core.commit()
    return core, ids, head


def write_lines(spool_dir: Path, *lines: dict[str, object], torn: bytes = b"") -> None:
    (spool_dir / KEY_FILE).write_bytes(b"".join(json.dumps(obj).encode() + b"\n" for obj in lines) + torn)


def test_an_intent_without_done_is_answered_from_the_messages_in_the_log(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    core, ids, head = spool_with(spool_dir, [("k1", 0), ("k1", 1), ("other", 0)])
    now = time.time()
    write_lines(spool_dir, {"t": "intent", "key": "k1", "fp": "f1", "head": head, "at": now},
                {"t": "intent", "key": "lost", "fp": "f2", "head": head, "at": now},
                torn=b'{"t":"intent","key":"torn","fp":"f3","he')
    store = KeyStore.open(str(spool_dir), core, DAY)
    known = store.lookup("k1", "f1")
    assert known is not None and known.ids == {0: ids[0], 1: ids[1]}
    assert store.lookup("lost", "f2") is None  # its messages never became durable: the retry makes them
    assert store.lookup("torn", "f3") is None
    # The file was rewritten with what is known, so the next start needs no walk of the log.
    lines = [json.loads(line) for line in (spool_dir / KEY_FILE).read_bytes().splitlines()]
    assert lines == [{"t": "done", "key": "k1", "fp": "f1", "at": now, "ids": [[0, ids[0]], [1, ids[1]]]}]
    assert os.stat(spool_dir / KEY_FILE).st_mode & 0o777 == 0o600
    core.close()


def test_keys_past_the_window_are_forgotten_and_done_keys_survive_their_messages(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    core = Spool.open(str(spool_dir))  # an empty log: the messages were delivered and their segments reclaimed
    now = time.time()
    write_lines(spool_dir, {"t": "done", "key": "old", "fp": "f", "at": now - DAY - 1, "ids": [[0, "10000001"]]},
                {"t": "done", "key": "young", "fp": "f", "at": now - DAY + 60, "ids": [[0, "10000002"]]})
    store = KeyStore.open(str(spool_dir), core, DAY, now=now)
    assert store.lookup("old", "f", now=now) is None
    young = store.lookup("young", "f", now=now)
    assert young is not None and young.ids == {0: "10000002"}
    core.close()


async def test_a_retry_after_a_crash_mid_request_makes_only_the_missing_messages(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    payload = {"envelope_sender": "s@example.org", "content": "Subject: half\n\nhalf\n",
               "recipients": [{"email": "r0@example.net"}, {"email": "r1@example.net"}]}
    body = json.dumps(payload).encode()
    # What a kill -9 in the middle of the request leaves: its intent, and the first recipient's message only.
    core, ids, head = spool_with(tmp_path / "spool", [("half", 0)])
    core.close()
    write_lines(tmp_path / "spool", {"t": "intent", "key": "half", "fp": fingerprint(body), "head": head,
                                     "at": time.time()})
    async with trio.open_nursery() as nursery:
        relay = ApiRelay(config)
        await relay.start(nursery)
        r = await inject(relay.http_port, payload, key="half")
        assert r.status == 200, r
        answer = r.json()
        assert answer["success_count"] == 2 and answer["ids"][0] == {"email": "r0@example.net", "queue_id": ids[0]}
        assert answer["ids"][1]["queue_id"] != ids[0]
        msgs = await wait_delivered(tmp_path, 2)
        assert sorted(str(m["Delivered-To"]) for m in msgs) == ["r0@example.net", "r1@example.net"]
        nursery.cancel_scope.cancel()
