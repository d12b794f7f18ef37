"""The queue gauges on a real relay's metrics endpoint, kept as the relay goes (``spool.engine.gauges``).

Messages deferred by a next hop that answers 451, a hold, a delete; and a restart on a spool that
holds a message in doubt from an earlier crash: ``logspool_recovery_in_doubt`` counts it (it read 0).
"""

from __future__ import annotations

import smtplib
import time
import urllib.request
from pathlib import Path

import trio
from prometheus_client.parser import text_string_to_metric_families
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.shards import spool_config
from mta.smtp.common import Reply
from spool.engine.spool import Spool
from spool.format.record import Status

QUEUE = ("logspool_queue_messages", "logspool_queue_deferred", "logspool_queue_held", "logspool_queue_in_doubt")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("sender@example.org", [rcpt], b"Subject: gauges\r\n\r\nbody\r\n")


def queue(m: dict[str, float]) -> tuple[float, ...]:
    return tuple(m[name] for name in QUEUE)


async def test_queue_gauges_follow_deferrals_holds_and_deletes(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(451, "4.3.0", "come back later") if stage == "rcpt" else None)
        hop_port = await hop.start(nursery)
        config = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"}, retry='["1h"]',
                              extra='metrics_listen = "127.0.0.1:0"\n')
        relay = await start_relay(nursery, config)
        mport = int(relay.metrics_listeners[0].socket.getsockname()[1])
        assert queue(await trio.to_thread.run_sync(scrape, mport)) == (0, 0, 0, 0)
        watch = DeliveryWatch(relay)
        sent = time.time()
        for rcpt in ("a@far.example", "b@far.example", "c@far.example"):
            await trio.to_thread.run_sync(send, relay.ports[0], rcpt)
        await watch.wait_for(Status.DEFERRED, 3)
        m = await trio.to_thread.run_sync(scrape, mport)
        assert queue(m) == (3, 3, 0, 0)
        assert 0 <= m["logspool_queue_oldest_age_seconds"] <= time.time() - sent + 1
        core = relay.aspool.core
        await relay.aspool.commit()  # the replacements written by the deferrals, readable by a listing
        first, second = list(await trio.to_thread.run_sync(_live, core))[:2]
        await relay.aspool.hold(first)
        assert queue(await trio.to_thread.run_sync(scrape, mport)) == (3, 2, 1, 0)
        await relay.aspool.delete(second)
        assert queue(await trio.to_thread.run_sync(scrape, mport)) == (2, 1, 1, 0)
        nursery.cancel_scope.cancel()


def _live(core: object) -> list[int]:
    from spool.read import listing

    return [m.message_id for m in listing.iter_live(core)]  # type: ignore[arg-type]


async def test_a_message_held_in_doubt_by_an_earlier_recovery_counts_at_the_next_start(tmp_path: Path) -> None:
    config = relay_config(str(tmp_path), {"*": "discard"}, extra='metrics_listen = "127.0.0.1:0"\n')
    sp = Spool.open(config.spool.dir, spool_config(config))
    try:
        sp.enqueue("s@example.org", ["doubt@far.example", "also@far.example"], b"Subject: d\r\n\r\nbody\r\n")
        sp.commit()
        (attempt,) = sp.poll_due()  # claimed, past its final dot, no outcome: in doubt at the next open
        sp.record_sending(attempt, attempt.remaining)
        sp.commit()
    finally:
        sp.close()
    Spool.open(config.spool.dir, spool_config(config)).close()  # the first recovery holds it; the relay's finds none
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        assert relay.aspool.core.recovery_stats.in_doubt == 0
        mport = int(relay.metrics_listeners[0].socket.getsockname()[1])
        m = await trio.to_thread.run_sync(scrape, mport)
        assert m["logspool_recovery_in_doubt"] == 2
        assert queue(m) == (1, 0, 1, 1)
        nursery.cancel_scope.cancel()
