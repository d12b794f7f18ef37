"""The Kafka shipper against a real Kafka-protocol broker (Tansu, in memory, on 127.0.0.1): every event
arrives at least once, keyed by its queue id, one message's events in order on one partition; a broker that
hangs or is down costs the relay nothing and the cursor does not move past what the broker acknowledged; a
shipper killed with SIGKILL resumes from its cursor with no gap.

The relay runs in the test; the shipper is its own process (``mta events
ship kafka``), as in production. What the topic holds is read back with
confluent-kafka's consumer and compared with the stream itself
(``spool.EventStream``, the events ``mta events`` shows).
"""

from __future__ import annotations

import os
import signal
import smtplib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from kafka_support import Tansu, TopicReader
from process_support import MTA
from relay_support import NextHop, start_relay, write_relay_config

from mta.config import Config, load_config
from mta.smtp.common import Reply
from spool import EventStream, OsFileIO, format_pos, load_cursor, parse_pos

pytestmark = pytest.mark.slow

PARTITIONS = 3


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tansu]:
    tansu = Tansu(tmp_path_factory.mktemp("tansu")).start()
    try:
        yield tansu
    finally:
        tansu.stop()


def policy(stage: str, value: Any) -> Reply | None:
    if stage == "rcpt" and str(value).startswith("later"):
        return Reply(451, "4.3.0", "try again later")
    return None


def send(port: int, first: int, n: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for i in range(first, first + n):
            rcpts = [f"ok{i}@far.example"] + ([f"later{i}@far.example"] if i % 4 == 0 else [])
            s.sendmail("a@src.example", rcpts, f"Subject: k {i}\r\n\r\nbody {i}\r\n")


def kafka_config(address: str, topic: str) -> str:
    return f"""
[events]
kafka_bootstrap_servers = ["{address}"]
kafka_topic = "{topic}"
kafka_batch_events = 7
kafka_batch_time = "0.2s"
kafka_timeout = "2s"
kafka_retry_max = "1s"
"""


class ShipperLog:
    """The shipper's stderr, line by line, with an event for each new chunk."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.more = trio.Event()

    async def read(self, proc: trio.Process) -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.receive_some(65536):
            self.lines.extend(chunk.decode(errors="replace").splitlines())
            self.more.set()
            self.more = trio.Event()

    def failures(self) -> int:
        return sum(" failed: " in line for line in self.lines)

    def first_failed(self) -> str:
        """The first event id of the first batch that failed."""
        line = next(line for line in self.lines if " failed: " in line)
        return line.split(" events (", 1)[1].split("..", 1)[0]

    async def wait_failures(self, n: int) -> None:
        while self.failures() < n:
            await self.more.wait()


async def start_shipper(nursery: trio.Nursery, path: Path, said: ShipperLog) -> trio.Process:
    proc = await trio.lowlevel.open_process([MTA, "events", "ship", "kafka", "--config", str(path)],
                                            cwd=str(path.parent), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    nursery.start_soon(said.read, proc)
    return proc


def stored(config: Config) -> int | None:
    return load_cursor(OsFileIO(), config.spool.dir, "kafka")


async def until_shipped(stream: EventStream, reader: TopicReader, config: Config, hop: NextHop, oks: set[str],
                        seconds: float) -> set[str]:
    """Wait until the topic holds every event of the stream, the next hop every ``ok`` recipient and the
    shipper's cursor the last event's record; returns the stream's ids."""
    with trio.fail_after(seconds):
        while True:
            want = {e.id for e in (await trio.to_thread.run_sync(stream.read)).events}
            await trio.to_thread.run_sync(reader.poll, 0.3)
            cursor = stored(config)
            if oks <= {r for m in hop.messages for r in m.recipients} and want <= reader.ids() and \
                    cursor is not None and cursor >= max(parse_pos(i.split("/")[0]) for i in want):
                return want
            await trio.sleep(0.1)  # polling the relay's, the hop's and the topic's state, with a deadline


def check_keyed_and_ordered(reader: TopicReader, want: set[str]) -> None:
    got = reader.messages
    assert want <= reader.ids()
    partition_of: dict[str, int] = {}
    first_seen: dict[str, list[tuple[int, int]]] = {}
    shown: set[str] = set()
    for partition, _offset, key, event, headers in sorted(got, key=lambda m: (m[0], m[1])):
        assert headers["id"] == event["id"].encode()
        assert key == (event["queue_id"].encode() if event["queue_id"] else None)
        if event["queue_id"]:
            assert partition_of.setdefault(event["queue_id"], partition) == partition  # one message, one partition
        if event["id"] in shown:
            continue
        shown.add(event["id"])
        pos, _, index = event["id"].partition("/")
        first_seen.setdefault(event["queue_id"], []).append((parse_pos(pos), int(index or -1)))
    assert all(ids == sorted(ids) for ids in first_seen.values())  # in order per key
    assert {"received", "delivered", "deferred", "retry_scheduled"} <= {e["kind"] for _, _, _, e, _ in got}


async def test_every_event_reaches_the_topic_keyed_in_order_across_a_hung_broker_and_a_killed_shipper(
        tmp_path: Path, broker: Tansu) -> None:
    topic = f"events-{uuid.uuid4().hex[:8]}"
    await trio.to_thread.run_sync(broker.create_topic, topic, PARTITIONS)
    reader = TopicReader(broker.address, topic)
    said = ShipperLog()
    with trio.fail_after(200):
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            await hop.start(nursery)
            path = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                      extra=kafka_config(broker.address, topic))
            config = load_config(path)
            relay = await start_relay(nursery, config)
            smtp = relay.listeners[0].socket.getsockname()[1]
            stream = EventStream(config.spool.dir)
            await trio.to_thread.run_sync(send, smtp, 0, 12)
            proc = await start_shipper(nursery, path, said)
            try:
                want = await until_shipped(stream, reader, config, hop, {f"ok{i}@far.example" for i in range(12)},
                                           60)
                # Nothing failed yet: each event once.
                assert said.failures() == 0
                assert sorted(e["id"] for _, _, _, e, _ in reader.messages) == sorted(reader.ids())

                broker.pause()  # the broker hangs: batches time out (kafka_timeout), the shipper retries
                try:
                    await trio.to_thread.run_sync(send, smtp, 12, 12)  # the relay still takes mail...
                    with trio.fail_after(60):
                        await said.wait_failures(2)
                    # ...and the cursor stays before the batch the broker did not acknowledge
                    failing = parse_pos(said.first_failed().split("/")[0])
                    cursor = stored(config)
                    assert cursor is not None and cursor < failing
                    with trio.fail_after(60):  # ...and delivers it
                        while not {f"ok{i}@far.example" for i in range(12, 24)} <= \
                                {r for m in hop.messages for r in m.recipients}:
                            await trio.sleep(0.1)  # polling the hop's state, with a deadline
                finally:
                    broker.resume()
                want = await until_shipped(stream, reader, config, hop, {f"ok{i}@far.example" for i in range(24)},
                                           60)

                proc.send_signal(signal.SIGKILL)  # a crash of the shipper
                await proc.wait()
                at_kill = stored(config)
                await trio.to_thread.run_sync(send, smtp, 24, 12)
                proc = await start_shipper(nursery, path, said)
                want = await until_shipped(stream, reader, config, hop, {f"ok{i}@far.example" for i in range(36)},
                                           60)
                assert at_kill is not None and any(f"as consumer kafka, from {format_pos(at_kill)}" in line
                                                   for line in said.lines)  # resumed from its cursor
            finally:
                proc.kill()
                print("\n".join(said.lines))  # the shipper's log, shown if the test fails
            check_keyed_and_ordered(reader, want)
            assert reader.ids() <= want | {e.id for e in stream.read().events}  # nothing the stream does not hold
            nursery.cancel_scope.cancel()
    reader.close()


async def test_a_broker_that_is_down_holds_the_cursor_and_the_shipper_delivers_once_it_is_up(tmp_path: Path) -> None:
    down = Tansu(tmp_path / "tansu")  # its port, with nothing listening yet
    topic = "events-late"
    reader: TopicReader | None = None
    said = ShipperLog()
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            await hop.start(nursery)
            path = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                      extra=kafka_config(down.address, topic))
            config = load_config(path)
            relay = await start_relay(nursery, config)
            smtp = relay.listeners[0].socket.getsockname()[1]
            proc = await start_shipper(nursery, path, said)
            try:
                await trio.to_thread.run_sync(send, smtp, 0, 8)
                with trio.fail_after(60):
                    await said.wait_failures(2)  # connection refused, batch after batch
                assert stored(config) is None
                with trio.fail_after(60):  # the relay delivers meanwhile
                    while not {f"ok{i}@far.example" for i in range(8)} <= \
                            {r for m in hop.messages for r in m.recipients}:
                        await trio.sleep(0.1)  # polling the hop's state, with a deadline
                # The shipper waits (SIGSTOP) while the broker starts and the topic is made: its next try
                # would otherwise have the broker make the topic itself, with the broker's own partitions.
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    try:
                        await trio.to_thread.run_sync(down.start)
                        await trio.to_thread.run_sync(down.create_topic, topic, PARTITIONS)
                    finally:
                        os.kill(proc.pid, signal.SIGCONT)
                    reader = TopicReader(down.address, topic)
                    want = await until_shipped(EventStream(config.spool.dir), reader, config, hop,
                                               {f"ok{i}@far.example" for i in range(8)}, 60)
                    check_keyed_and_ordered(reader, want)
                finally:
                    if reader is not None:
                        reader.close()
                    down.stop()
            finally:
                proc.kill()
            nursery.cancel_scope.cancel()


def test_the_kafka_shipper_refuses_to_run_without_brokers(tmp_path: Path) -> None:
    path = write_relay_config(tmp_path, {})
    (tmp_path / "spool" / "log").mkdir(parents=True)
    out = subprocess.run([MTA, "events", "ship", "kafka", "--config", str(path)], capture_output=True, text=True,
                         timeout=60, cwd=str(tmp_path))
    assert out.returncode == 2 and "events.kafka_bootstrap_servers: not set" in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1
    path.write_text(path.read_text() + '\n[events]\nkafka_bootstrap_servers = ["127.0.0.1:9"]\nkafka_topic = "a b"\n')
    out = subprocess.run([MTA, "events", "ship", "kafka", "--config", str(path)], capture_output=True, text=True,
                         timeout=60, cwd=str(tmp_path))
    assert out.returncode == 2 and "is not a Kafka topic name" in out.stderr, out.stderr
