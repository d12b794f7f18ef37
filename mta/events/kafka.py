"""The Kafka shipper: the event stream produced to a topic, one Kafka message per event, keyed by queue id.

Runs in a process of its own (``mta events ship kafka``), through
``mta.events.shipping``: the cursor is stored only after the brokers
acknowledged every event of a batch, and a batch that failed is produced
again, whole. The producer is librdkafka's (confluent-kafka), idempotent
(``enable.idempotence``, so ``acks=all``): a retry inside librdkafka never
writes an event twice nor reorders a partition; a batch produced again
after a failure may, so receivers drop the ids they have (at least once).

A message: key = the queue id (so one message's events go to one
partition, in order, with the partitioner Java clients use,
``murmur2_random``); value = the event's JSON, as ``mta events --json``
prints it; header ``id`` = the event id. An event of no message (a damaged
stretch of the log) has no key.

Needs the ``kafka`` extra (``pip install 'logspool[kafka]'``); the relay
itself does not.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mta.config import Config, ConfigError
from mta.events.batching import Batch, Batcher
from mta.events.cursors import Cursors
from mta.events.shipping import Answer, Shipper
from mta.events.source import classes_of, open_stream

if TYPE_CHECKING:
    from confluent_kafka import KafkaError, Message, Producer

__all__ = ["KafkaSender", "ship_kafka"]

client_log = logging.getLogger("mta.events.kafka")  # librdkafka's own lines (connections, brokers down)

FLUSH_STEP = 1.0  # seconds per flush call while a batch is in flight (each returns when all are acknowledged)


class KafkaMissing(ConfigError):
    """The shipper's client library is not installed."""


def _kafka() -> Any:
    try:
        import confluent_kafka
    except ImportError:
        raise KafkaMissing("mta events ship kafka needs confluent-kafka: pip install 'logspool[kafka]'") from None
    return confluent_kafka


class KafkaSender:
    """Produces each batch to ``topic`` and waits until the brokers acknowledged all of it or it failed.

    Resource handling: one producer (its connections, its librdkafka threads)
    while batches succeed; after a batch failed, once none of its messages is
    in flight, the producer is dropped and the retry makes a new one.
    """

    def __init__(self, servers: Sequence[str], topic: str, timeout: float) -> None:
        self.servers = tuple(servers)
        self.topic = topic
        self.timeout = timeout
        self._module = _kafka()
        self._producer: Producer | None = None
        self._fatal: KafkaError | None = None

    def _settings(self) -> dict[str, Any]:
        return {
            "bootstrap.servers": ",".join(self.servers),
            "client.id": "logspool-events",
            "enable.idempotence": True,  # implies acks=all, retries without duplicates, order kept per partition
            "acks": "all",
            "message.timeout.ms": max(1, int(self.timeout * 1000)),
            "partitioner": "murmur2_random",  # Java's default: a key lands where Java producers put it
            "linger.ms": 5,
            "error_cb": self._error,
            "logger": client_log,
        }

    def _error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
        client_log.info("kafka: %s", err.str())

    def _get(self) -> Producer:
        if self._producer is None:
            self._fatal = None
            self._producer = self._module.Producer(self._settings())
        return self._producer

    def send(self, batch: Batch, shard: int) -> Answer:
        producer = self._get()
        failed: list[str] = []
        acked = 0

        def done(err: KafkaError | None, msg: Message) -> None:
            nonlocal acked
            if err is None:
                acked += 1
            else:
                failed.append(err.str())

        for event in batch.events:
            key = event["queue_id"].encode() if event["queue_id"] else None
            value = json.dumps(event, sort_keys=True).encode()
            while True:
                try:
                    producer.produce(self.topic, value, key, on_delivery=done, headers=[("id", event["id"].encode())])
                    break
                except BufferError:  # librdkafka's queue is full: serve acknowledgements, then try again
                    producer.poll(FLUSH_STEP)
                except self._module.KafkaException as e:
                    failed.append(str(e))
                    break
            if failed:
                break
        # Every message produced is acknowledged or failed within message.timeout.ms: this ends.
        while producer.flush(FLUSH_STEP) > 0:
            pass
        if self._fatal is not None:
            failed.append(f"fatal: {self._fatal.str()}")
        if not failed and acked == len(batch.events):
            return Answer(True, f"{acked} acknowledged")
        # Nothing of this producer is in flight any more (flush returned 0): the retry goes through a new
        # one, with a producer id of its own, rather than through librdkafka's epoch bump after a timeout,
        # which not every broker takes (a fenced producer would fail every batch from then on).
        self._producer = None
        why = failed[0] if failed else "no acknowledgement"
        return Answer(False, f"{len(batch.events) - acked} of {len(batch.events)} not acknowledged: {why}")


def ship_kafka(config: Config, shard: int = 0, *, sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> None:
    """Ship ``shard``'s events to ``[events] kafka_topic`` until the process ends. Raises ConfigError when
    the settings cannot work (no brokers, no client library), SpoolNotFound."""
    cfg = config.events
    if not cfg.kafka_bootstrap_servers:
        raise ConfigError("not set: no broker to ship to", config.source, "events.kafka_bootstrap_servers")
    servers = [str(s) for s in cfg.kafka_bootstrap_servers]
    sender = KafkaSender(servers, cfg.kafka_topic, cfg.kafka_timeout)
    where = f"kafka://{servers[0]}/{cfg.kafka_topic}"
    Shipper(open_stream(config, shard), Cursors(config), cfg.kafka_consumer, shard, sender,
            Batcher(cfg.kafka_batch_events, cfg.kafka_batch_bytes, cfg.kafka_batch_time),
            cfg.kafka_retry_max, where, sleep, clock, classes_of(config)).run()
