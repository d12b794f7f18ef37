"""The HTTP injection API against the real relay process (``mta serve``) over real TCP.

KumoMTA's documented request bodies are accepted and their messages land in
a Maildir with the content the request asked for; the token, the size limit
and the disk are checked before a body is read; an ``Idempotency-Key`` makes
a retry, also one after kill -9, return the same queue ids and create nothing.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from http_client import inject, request
from inject_support import TOKEN, ApiRelay, started, wait_delivered, write_config
from process_support import MTA

pytestmark = pytest.mark.slow  # each test starts the relay's process (a second or two)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[ApiRelay]:
    async with trio.open_nursery() as nursery:
        yield await started(nursery, write_config(tmp_path))
        nursery.cancel_scope.cancel()


# KumoMTA's documented examples (docs.kumomta.com, reference/http/api_inject_v1): the basic one, and the builder.
BASIC = {"envelope_sender": "noreply@example.com", "content": "Subject: hello\n\nHello there",
         "recipients": [{"email": "recipient@example.com"}]}
PIXEL = "R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7"
BUILDER = {
    "envelope_sender": "noreply@example.com",
    "content": {
        "text_body": "This is the plain text part for {{ name }}",
        "html_body": "<p>This is the <b>HTML</b> part for {{ name }}</p><img src=\"cid:my-image\">",
        "attachments": [
            {"data": PIXEL, "base64": True, "content_type": "image/gif", "content_id": "my-image",
             "file_name": "pixel.gif"},
            {"data": "an attached text", "content_type": "text/plain", "file_name": "notes.txt"},
        ],
        "headers": {"X-Campaign": "{{ campaign }}"},
        "from": {"email": "someone@example.com", "name": "Someone"},
        "subject": "Hello {{ name }}",
        "reply_to": {"email": "help@example.com", "name": "Help"},
    },
    "recipients": [{"email": "john@example.net", "name": "John Smith", "substitutions": {"campaign": "spring"}},
                   {"email": "jane@example.net", "name": "Jane Doe"}],
    "substitutions": {"campaign": "default"},
}


async def test_kumomta_examples_are_delivered_with_their_content(api: ApiRelay, tmp_path: Path) -> None:
    basic = await inject(api.http_port, BASIC)
    assert basic.status == 200, basic.body
    answer = basic.json()
    assert (answer["success_count"], answer["fail_count"], answer["failed_recipients"], answer["errors"]) == \
        (1, 0, [], [])
    built = await inject(api.http_port, BUILDER)
    assert built.status == 200, built.body
    ids = built.json()["ids"]
    assert [i["email"] for i in ids] == ["john@example.net", "jane@example.net"]
    assert len({i["queue_id"] for i in ids} | {answer["ids"][0]["queue_id"]}) == 3
    msgs = {m["Delivered-To"]: m for m in await wait_delivered(tmp_path, 3)}
    plain = msgs["recipient@example.com"]
    assert plain["Subject"] == "hello" and plain.get_content().strip() == "Hello there"
    john = msgs["john@example.net"]
    assert john["Subject"] == "Hello John Smith" and john["X-Campaign"] == "spring"
    assert john["To"] == "John Smith <john@example.net>" and john["From"] == "Someone <someone@example.com>"
    assert john["Reply-To"] == "Help <help@example.com>" and john["Message-ID"] and john["Date"]
    assert msgs["jane@example.net"]["X-Campaign"] == "default"
    body = john.get_body(("plain",))
    assert body is not None and body.get_content().strip() == "This is the plain text part for John Smith"
    html = john.get_body(("html",))
    assert html is not None and "for John Smith" in html.get_content()
    parts = {p.get_content_type(): p for p in john.walk()}
    assert parts["image/gif"]["Content-ID"] == "<my-image>"
    assert parts["image/gif"].get_content() == base64.b64decode(PIXEL)
    attached = [p for p in john.iter_attachments() if p.get_filename() == "notes.txt"]
    assert attached and attached[0].get_content() == "an attached text"
    assert all(line.isascii() for line in john.as_bytes().splitlines())  # 7-bit: no next hop needs 8BITMIME


async def test_requests_without_a_valid_token_are_refused(api: ApiRelay) -> None:
    for token in (None, "wrong-token", "secret-toke"):
        r = await inject(api.http_port, BASIC, token=token)
        assert r.status == 401 and r.headers["www-authenticate"] == "Bearer", (token, r)
    r = await request(api.http_port, "POST", "/api/inject/v1", json.dumps(BASIC).encode(),
                      headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status == 401
    assert (await inject(api.http_port, BASIC, token="other-token")).status == 200


async def test_bad_requests_get_400_with_the_field_named(api: ApiRelay) -> None:
    port = api.http_port
    cases: list[tuple[Any, str]] = [
        ({**BASIC, "recipients": []}, "recipients"),
        ({**BASIC, "colour": "blue"}, "colour"),
        ({**BASIC, "deferred_generation": True}, "deferred_generation"),
        ({**BASIC, "content": "Subject: {{ broken\n\nx"}, "template error"),
        ({"content": "Subject: x\n\ny", "recipients": [{"email": "a@example.com"}]}, "envelope_sender"),
    ]
    for payload, named in cases:
        r = await inject(port, payload)
        assert r.status == 400 and named in r.json()["error"], (payload, r)
    r = await request(port, "POST", "/api/inject/v1", b"{not json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 400 and "JSON" in r.json()["error"]
    assert (await request(port, "GET", "/api/inject/v1", headers={"Authorization": f"Bearer {TOKEN}"})).status == 405
    assert (await request(port, "GET", "/nowhere")).status == 404
    # One recipient that cannot be made is a failed recipient, the others are taken.
    r = await inject(port, {**BASIC, "recipients": [{"email": "not an address"}, {"email": "ok@example.com"}]})
    answer = r.json()
    assert r.status == 200 and answer["success_count"] == 1 and answer["failed_recipients"] == ["not an address"]
    assert answer["errors"] and answer["ids"][0]["email"] == "ok@example.com"


async def test_a_body_over_the_limit_gets_413_before_it_is_read(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        relay = await started(nursery, write_config(tmp_path, http_extra='max_request_size = "4 KiB"'))
        big = {**BASIC, "content": "Subject: big\n\n" + "x" * 5000}
        r = await inject(relay.http_port, big)
        assert r.status == 413, r
        assert (await inject(relay.http_port, BASIC)).status == 200  # the relay goes on
        nursery.cancel_scope.cancel()


async def test_503_with_retry_after_while_the_disk_is_short(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        # A floor above any disk's free space: the spool is short of room from the start (as for SMTP's 452).
        relay = await started(nursery, write_config(tmp_path, spool_extra='queue_minfree = "1000 TiB"'))
        r = await inject(relay.http_port, BASIC, key="k-disk")
        assert r.status == 503 and int(r.headers["retry-after"]) > 0, r
        assert not (tmp_path / "mail").exists()
        nursery.cancel_scope.cancel()


async def test_a_tokens_file_open_to_others_stops_the_start_in_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, mode=0o644)
    proc = await trio.run_process([MTA, "serve", "--config", str(config)], cwd=str(tmp_path), capture_stdout=True,
                                  capture_stderr=True, check=False)
    err = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1, proc.stderr
    assert "http.tokens_file" in err[0] and "chmod 600" in err[0]


async def test_a_retry_with_the_same_key_returns_the_same_ids_also_after_kill_9(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    async with trio.open_nursery() as nursery:
        relay = await started(nursery, config)
        first = await inject(relay.http_port, BUILDER, key="order-1")
        assert first.status == 200
        again = await inject(relay.http_port, BUILDER, key="order-1")
        assert again.status == 200 and again.json() == first.json()
        other = await inject(relay.http_port, {**BUILDER, "substitutions": {"campaign": "x"}}, key="order-1")
        assert other.status == 422, other
        await wait_delivered(tmp_path, 2)
        await relay.kill()
        await relay.start(nursery)
        after = await inject(relay.http_port, BUILDER, key="order-1")
        assert after.status == 200 and after.json()["ids"] == first.json()["ids"]
        fresh = await inject(relay.http_port, BUILDER, key="order-2")
        assert fresh.status == 200 and fresh.json()["ids"] != first.json()["ids"]
        msgs = await wait_delivered(tmp_path, 4)
        assert len(msgs) == 4
        nursery.cancel_scope.cancel()


async def test_concurrent_requests_with_one_key_make_one_set_of_messages(api: ApiRelay, tmp_path: Path) -> None:
    answers: list[Any] = []

    async def one() -> None:
        r = await inject(api.http_port, BUILDER, key="same")
        assert r.status == 200
        answers.append(r.json())

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(one)
    assert len(answers) == 5 and all(a == answers[0] for a in answers)
    assert len(await wait_delivered(tmp_path, 2)) == 2


async def test_the_envelope_keeps_the_key_the_place_and_the_metadata(api: ApiRelay, tmp_path: Path) -> None:
    payload = {**BASIC, "recipients": [{"email": "a@example.com", "metadata": {"campaign": 7, "tags": ["x"]}},
                                       {"email": "b@example.com"}]}
    r = await inject(api.http_port, payload, key="meta-1")
    assert r.status == 200
    ids = [i["queue_id"] for i in r.json()["ids"]]
    dump = await trio.run_process([os.path.join(os.path.dirname(sys.executable), "spoolctl"), "dump", "--json",
                                   str(tmp_path / "spool")], capture_stdout=True, capture_stderr=True)
    extras = {rec["payload"]["queue_id"]: rec["payload"]["extra"] for line in dump.stdout.decode().splitlines()
              if (rec := json.loads(line))["type"] == "ENVELOPE"}
    assert extras[ids[0]] == {"client": "127.0.0.1", "via": "http", "idempotency_key": "meta-1", "inject_index": 0,
                              "metadata": {"campaign": 7, "tags": ["x"]}}
    assert extras[ids[1]] == {"client": "127.0.0.1", "via": "http", "idempotency_key": "meta-1", "inject_index": 1}
