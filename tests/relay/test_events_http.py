"""``GET /events`` on a running relay: pages, long-polling, named consumers' cursors, and clear refusals.

The relay runs in the test (its sockets are enough); mail goes in over SMTP
and out to a discarding route, so the stream has received and delivered
events. Requests are plain HTTP/1.1 from urllib.
"""

from __future__ import annotations

import json
import smtplib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families
from relay_support import relay_config, start_relay

from mta.process.relay import Relay
from spool import load_cursor, parse_pos

EXTRA = """
[events]
listen = "127.0.0.1:0"
max_wait = "10s"
page_records = 50
"""


def get(port: int, query: str, method: str = "GET") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{query}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def send(port: int, n: int, tag: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for i in range(n):
            s.sendmail("a@src.example", [f"{tag}{i}@sink.test"], f"Subject: {tag} {i}\r\n\r\nbody\r\n")


async def events_port(relay: Relay) -> int:
    return int(relay.events_listeners[0].socket.getsockname()[1])


async def test_pages_follow_the_cursor_and_a_long_poll_returns_when_mail_arrives(tmp_path: Path) -> None:
    config = relay_config(str(tmp_path), {"sink.test": "discard"}, extra=EXTRA)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        port, smtp = await events_port(relay), relay.listeners[0].socket.getsockname()[1]
        await trio.to_thread.run_sync(send, smtp, 3, "first")
        seen: list[dict[str, Any]] = []
        after = ""
        with trio.fail_after(30):
            while len([e for e in seen if e["kind"] == "delivered"]) < 3:
                status, page = await trio.to_thread.run_sync(get, port, f"/events?wait=5{after}")
                assert status == 200, page
                seen += page["events"]
                after = f"&after={page['next']}" if page["next"] else ""
        assert [e["kind"] for e in seen].count("received") == 3
        assert len({e["id"] for e in seen}) == len(seen)
        assert all(parse_pos(e["id"].split("/")[0]) < parse_pos(page["horizon"]) for e in seen)
        # nothing new: without wait the answer is at once and empty, the cursor where it was
        status, empty = await trio.to_thread.run_sync(get, port, f"/events?{after[1:]}")
        assert status == 200 and empty["events"] == [] and empty["next"] == page["next"]

        # a long poll that is waiting when mail comes in returns with it
        got: list[dict[str, Any]] = []

        async def poll() -> None:
            got.append((await trio.to_thread.run_sync(get, port, f"/events?wait=10{after}"))[1])

        async with trio.open_nursery() as inner:
            inner.start_soon(poll)
            await trio.to_thread.run_sync(send, smtp, 1, "late")
        assert got and got[0]["events"] and got[0]["events"][0]["kind"] == "received"
        assert got[0]["events"][0]["recipients"] == ["late0@sink.test"]
        nursery.cancel_scope.cancel()


async def test_a_named_consumer_resumes_from_its_fsynced_cursor(tmp_path: Path) -> None:
    config = relay_config(str(tmp_path), {"sink.test": "discard"}, extra=EXTRA)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        port, smtp = await events_port(relay), relay.listeners[0].socket.getsockname()[1]
        await trio.to_thread.run_sync(send, smtp, 2, "c")
        status, first = await trio.to_thread.run_sync(get, port, "/events?consumer=crm&limit=1")
        assert status == 200 and len(first["events"]) == 1
        # not acknowledged yet: the same page again
        status, again = await trio.to_thread.run_sync(get, port, "/events?consumer=crm&limit=1")
        assert again["events"] == first["events"]
        # acknowledged by passing it back as after: stored, and the next read without after goes on from it
        status, second = await trio.to_thread.run_sync(get, port, f"/events?consumer=crm&limit=1&after={first['next']}")
        assert status == 200 and second["events"][0]["id"] != first["events"][0]["id"]
        assert load_cursor(relay.aspool.core.io, config.spool.dir, "crm") == parse_pos(first["next"])
        status, resumed = await trio.to_thread.run_sync(get, port, "/events?consumer=crm&limit=1")
        assert resumed["events"] == second["events"]
        nursery.cancel_scope.cancel()


async def test_bad_requests_get_a_status_and_a_reason(tmp_path: Path) -> None:
    config = relay_config(str(tmp_path), {"sink.test": "discard"}, extra=EXTRA)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        port = await events_port(relay)
        cases = [
            ("/events?limit=abc", "GET", 400, "limit: not an integer"),
            ("/events?limit=51", "GET", 400, "limit: 51 is not in 1..50"),
            ("/events?wait=11", "GET", 400, "wait: 11 is not in 0..10"),
            ("/events?after=nonsense", "GET", 400, "after: not an event id"),
            ("/events?after=1:7", "GET", 400, "no record starts at position 1:7"),
            ("/events?consumer=../etc", "GET", 400, "no consumer name"),
            ("/events?bogus=1", "GET", 400, "unknown parameter 'bogus'"),
            ("/events?shard=1", "GET", 400, "shard: 1 is not in 0..0"),
            ("/other", "GET", 404, "no /other here"),
            ("/events", "POST", 405, "GET /events only"),
        ]
        for query, method, want, text in cases:
            status, body = await trio.to_thread.run_sync(get, port, query, method)
            assert (status, text in body["error"]) == (want, True), (query, status, body)
        nursery.cancel_scope.cancel()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {f"{s.name}{{consumer=\"{s.labels['consumer']}\"}}": s.value
            for family in text_string_to_metric_families(text) if family.name.startswith("logspool_events_")
            for s in family.samples}


async def test_each_named_consumer_has_a_lag_gauge_that_falls_to_zero_as_it_catches_up(tmp_path: Path) -> None:
    extra = 'metrics_listen = "127.0.0.1:0"\n' + EXTRA
    config = relay_config(str(tmp_path), {"sink.test": "discard"}, extra=extra)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        port, smtp = await events_port(relay), relay.listeners[0].socket.getsockname()[1]
        metrics = relay.metrics_listeners[0].socket.getsockname()[1]
        assert await trio.to_thread.run_sync(scrape, metrics) == {}  # no consumer, no series
        await trio.to_thread.run_sync(send, smtp, 3, "lag")
        _, page = await trio.to_thread.run_sync(get, port, "/events?consumer=crm&limit=1")
        await trio.to_thread.run_sync(get, port, f"/events?consumer=crm&limit=1&after={page['next']}")
        behind = await trio.to_thread.run_sync(scrape, metrics)
        assert behind['logspool_events_consumer_lag_bytes{consumer="crm"}'] > 0
        assert behind['logspool_events_consumer_lagging{consumer="crm"}'] == 0
        after = page["next"]
        while True:  # read on to the horizon, acknowledging each page
            _, page = await trio.to_thread.run_sync(get, port, f"/events?consumer=crm&after={after}")
            if page["next"] == after:
                break
            after = page["next"]
        caught_up = await trio.to_thread.run_sync(scrape, metrics)
        last_record = parse_pos(after)
        horizon = parse_pos(page["horizon"])
        # what is left is the last record itself (the cursor names the record taken, not its end) and any
        # records the stream does not show (a FINISH)
        assert 0 <= caught_up['logspool_events_consumer_lag_bytes{consumer="crm"}'] <= horizon - last_record
        assert caught_up['logspool_events_consumer_lag_bytes{consumer="crm"}'] < behind[
            'logspool_events_consumer_lag_bytes{consumer="crm"}']
        nursery.cancel_scope.cancel()
