"""Every metric the relay declares moves when what it counts happens (docs/operations.md, "Metrics").

One relay life drives everything (``_scenario``): it starts on a spool left
with a message in doubt (recovery), takes and refuses mail, delivers, bounces,
times a client out, refuses a session over the limit, and holds a delivery
open against a next hop that never greets. The Prometheus endpoint is scraped
at the start, while that delivery hangs, and at the end; each metric then has
a case saying how it must have moved. ``test_every_declared_metric_has_a_case``
keeps the list whole: a metric added without a case fails it.
"""

from __future__ import annotations

import smtplib
import urllib.request
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from relay_support import DeliveryWatch, NextHop, RawClient, relay_config, start_relay

from mta.shards import spool_config
from mta.smtp.common import Reply
from spool.record import Status
from spool.spool import Spool


@attrs.frozen
class Scrape:
    samples: dict[str, float]  # 'name{label="v"}' -> value
    families: frozenset[str]  # the metric names the endpoint declared (# HELP lines)

    def __call__(self, key: str) -> float:
        return self.samples.get(key, 0.0)


@attrs.frozen
class Scrapes:
    start: Scrape
    stalled: Scrape  # while a delivery hangs on a next hop that never greets
    end: Scrape


def _scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return Scrape(samples, frozenset(families))


class SilentHop:
    """Accepts connections and says nothing until released."""

    def __init__(self) -> None:
        self.port = 0
        self.connected = trio.Event()
        self.release = trio.Event()

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(lambda task_status: trio.serve_tcp(
            self._handle, 0, host="127.0.0.1", task_status=task_status))
        self.port = int(listeners[0].socket.getsockname()[1])
        return self.port

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connected.set()
        await self.release.wait()
        await stream.aclose()


def _send(port: int, sender: str, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail(sender, [rcpt], b"Subject: metrics\r\n\r\nbody\r\n")


def _leave_a_message_in_doubt(cfg_dir: Path, cfg: object) -> None:
    """A START with no outcome, as a crash in mid-delivery leaves it: the next start reports it in doubt.

    Also two damaged messages for the damage metrics: one whose envelope's bytes are flipped (lost, named)
    and one whose body's bytes are (bounced when its turn comes).
    """
    sp = Spool.open(str(cfg_dir), spool_config(cfg))  # type: ignore[arg-type]
    try:
        sp.enqueue("s@localhost", ["doubt@localhost"], b"Subject: doubt\r\n\r\nbody\r\n")
        sp.commit()
        assert len(sp.poll_due()) == 1
        sp.commit()
        sp.enqueue("s@localhost", ["envelope-lost@localhost"], b"Subject: lost\r\n\r\nbody\r\n")
        sp.enqueue("s@localhost", ["body-damaged@localhost"], b"Subject: damaged\r\n\r\nDAMAGE-ME\r\n")
        sp.commit()
        sp.checkpoint()  # so the damage lies in the durable log, not in a tail recovery cannot prove
    finally:
        sp.close()
    for marker in (b"envelope-lost@localhost", b"DAMAGE-ME"):
        _flip_after(cfg_dir / "log", marker)


def _flip_after(log_dir: Path, marker: bytes) -> None:
    """Flip one byte inside the first record holding ``marker``: its checksum no longer matches."""
    for seg in sorted(log_dir.glob("*.seg")):
        data = bytearray(seg.read_bytes())
        at = data.find(marker)
        if at >= 0:
            data[at + 2] ^= 0x20
            seg.write_bytes(bytes(data))
            return
    raise AssertionError(f"{marker!r} is in no segment")


async def _scenario(tmp: Path) -> Scrapes:
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(550, "5.1.1", "no such user")
                      if stage == "rcpt" and str(value).startswith("bounce@") else None)
        hop_port = await hop.start(nursery)
        silent = SilentHop()
        silent_port = await silent.start(nursery)
        cfg = relay_config(str(tmp), {"localhost": "maildir:maildir", "far.example": f"smtp://127.0.0.1:{hop_port}",
                                      "stall.example": f"smtp://127.0.0.1:{silent_port}"},
                           extra='metrics_listen = "127.0.0.1:0"\nmax_sessions = 2\nreserved_sessions = 0\n'
                                 'command_timeout = "1s"\n', retry='["1h"]',
                           spool_extra='in_doubt = "redeliver"\n')  # the message left in doubt is delivered again
        await trio.to_thread.run_sync(_leave_a_message_in_doubt, Path(cfg.spool.dir), cfg)
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        mport = int(relay.metrics_listeners[0].socket.getsockname()[1])
        start = await trio.to_thread.run_sync(_scrape, mport)
        await watch.wait_for(Status.DELIVERED, 1, recipient="doubt@localhost")  # the in-doubt one, again
        await watch.wait_for(Status.BOUNCED, 1, recipient="body-damaged@localhost")  # its data cannot be read

        port = relay.ports[0]
        await trio.to_thread.run_sync(_send, port, "s@localhost", "ok@far.example")
        await trio.to_thread.run_sync(_send, port, "s@localhost", "bounce@far.example")
        await watch.wait_for(Status.DELIVERED, 1, recipient="ok@far.example")
        await watch.wait_for(Status.BOUNCED, 1, recipient="bounce@far.example")
        await watch.wait_for(Status.DELIVERED, 1, recipient="s@localhost")  # the DSN

        chatty = await RawClient.connect(port)
        await chatty.reply()
        assert (await chatty.command(b"FOO"))[0].startswith(b"500")  # a rejection
        other = await RawClient.connect(port)
        await other.reply()
        third = await RawClient.connect(port)  # both slots are taken: 421 4.7.0
        assert (await third.reply())[0].startswith(b"421 4.7.0")
        assert (await other.reply())[0].startswith(b"421 4.4.2")  # silent for command_timeout
        for c in (chatty, other, third):
            await c.aclose()

        await trio.to_thread.run_sync(_send, port, "s@localhost", "x@stall.example")
        await silent.connected.wait()
        stalled = await trio.to_thread.run_sync(_scrape, mport)
        silent.release.set()
        await watch.wait_for(Status.DEFERRED, 1, recipient="x@stall.example")
        end = await trio.to_thread.run_sync(_scrape, mport)
        nursery.cancel_scope.cancel()
    return Scrapes(start, stalled, end)


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Scrapes:
    return trio.run(_scenario, tmp_path_factory.mktemp("metrics"))


def grew(key: str) -> Callable[[Scrapes], bool]:
    return lambda s: s.end(key) > s.start(key)


# Each declared metric: how the scenario must have moved it.
CASES: dict[str, Callable[[Scrapes], bool]] = {
    "logspool_accepted_messages": grew("logspool_accepted_messages_total"),
    "logspool_rejected_commands": grew('logspool_rejected_commands_total{reason="unknown_command"}'),
    "logspool_recipient_outcomes": lambda s: all(
        grew(f'logspool_recipient_outcomes_total{{status="{st}"}}')(s) for st in ("delivered", "bounced", "deferred")),
    "logspool_dsn_sent": grew("logspool_dsn_sent_total"),
    "logspool_delivery_latency_seconds": grew("logspool_delivery_latency_seconds_count"),
    "logspool_commit_batch_messages": lambda s: grew("logspool_commit_batch_messages_count")(s)
    and s.end("logspool_commit_batch_messages_sum") == 3,  # the three messages taken over SMTP (not the DSN)
    "logspool_smtp_sessions": grew("logspool_smtp_sessions_total"),
    "logspool_smtp_sessions_refused": grew('logspool_smtp_sessions_refused_total{limit="total"}'),
    "logspool_smtp_timeouts": grew('logspool_smtp_timeouts_total{phase="command"}'),
    "logspool_fsyncs": grew("logspool_fsyncs"),
    "logspool_commits": grew("logspool_commits"),
    "logspool_records_appended": grew("logspool_records_appended"),
    "logspool_bytes_appended": grew("logspool_bytes_appended"),
    "logspool_active_messages": lambda s: s.stalled('logspool_active_messages{class="0"}') >= 1
    and s.end('logspool_active_messages{class="0"}') == 0,
    "logspool_runner_position": grew('logspool_runner_position{class="0"}'),
    "logspool_recovery_bytes_read": lambda s: s.start("logspool_recovery_bytes_read") > 0,
    "logspool_recovery_in_doubt": lambda s: s.start("logspool_recovery_in_doubt") == 1,
    "logspool_damage_found": lambda s: s.start('logspool_damage_found{kind="damaged_record"}') >= 1,
    "logspool_damage_lost_messages": lambda s: s.start("logspool_damage_lost_messages") >= 1,
    "logspool_damaged_bodies": grew("logspool_damaged_bodies"),
    "logspool_quarantine_entries": lambda s: s.start("logspool_quarantine_entries") >= 1,
    "logspool_quarantine_bytes": lambda s: s.start("logspool_quarantine_bytes") > 0,
    "logspool_quarantine_lost_messages": lambda s: s.start("logspool_quarantine_lost_messages") >= 1,
}


@pytest.mark.parametrize("metric", sorted(CASES))
def test_metric_moves(scrapes: Scrapes, metric: str) -> None:
    assert metric in scrapes.end.families
    relevant = {k: v for k, v in scrapes.end.samples.items() if k.startswith(metric)}
    assert CASES[metric](scrapes), (metric, relevant)


def test_every_declared_metric_has_a_case(scrapes: Scrapes) -> None:
    # prometheus_client's text format adds a NAME_created family per counter and histogram: not declared by us.
    declared = {f for f in scrapes.end.families if f.startswith("logspool_") and not f.endswith("_created")}
    assert declared == set(CASES), declared ^ set(CASES)
