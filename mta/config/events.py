"""``[events]``: the delivery event stream's HTTP endpoint on the relay, consumers' cursors, and the shippers.

The stream itself needs no setting: it is the spool's log (``spool.EventStream``).
What is set here is how it is served (``listen`` and its bounds), where the
consumers' cursors live, and where the shippers (``mta events ship``) send.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import attrs

from mta.config.values import Listen, ListenAddress
from spool import (
    ConfigError,
    CursorError,
    Duration,
    Integer,
    ListOf,
    Optional,
    Path,
    Size,
    Text,
    check_cursor_name,
    setting,
)

__all__ = ["EventsSection"]

_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")  # Kafka's rule for a topic's name


@attrs.frozen
class WebhookUrl(Text):
    """An ``http://`` or ``https://`` URL with a host."""

    def what(self) -> str:
        return "http(s) URL"

    def check(self, value: str) -> None:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{value!r} is not an http:// or https:// URL with a host")


@attrs.frozen
class TopicName(Text):
    """A Kafka topic: 1–249 of letters, digits, ``.``, ``_`` and ``-`` (not ``.`` nor ``..``)."""

    def what(self) -> str:
        return "Kafka topic name"

    def check(self, value: str) -> None:
        if not _TOPIC.fullmatch(value) or value in (".", ".."):
            raise ConfigError(f"{value!r} is not a Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)")


@attrs.frozen
class ConsumerName(Text):
    def what(self) -> str:
        return "consumer name"

    def check(self, value: str) -> None:
        try:
            check_cursor_name(value)
        except CursorError as e:
            raise ConfigError(str(e)) from None


@attrs.frozen(kw_only=True)
class EventsSection:
    """``[events]``."""

    listen: ListenAddress | None = setting(
        Optional(Listen()), "the HTTP endpoint `GET /events` (see \"Consuming events\"); not set, none", None)
    max_connections: int = setting(
        Integer(1, 256), "event requests served at once; more wait in the listen backlog", 8)
    max_wait: float = setting(
        Duration(at_most=3600.0), "the longest a request with `wait=` is held open for new events", 30.0)
    page_records: int = setting(
        Integer(1, 100_000), "records read for one answer at most (their events are sent whole)", 1000)
    sse_heartbeat: float = setting(
        Duration(positive=True, at_most=3600.0), "with `Accept: text/event-stream`: a comment line is sent after "
        "this long with no event, so proxies keep the stream open", 15.0)
    sse_max_time: float = setting(
        Duration(positive=True), "with `Accept: text/event-stream`: how long one stream is served before the "
        "relay ends it (the client reconnects with `Last-Event-ID`); it holds one of `max_connections` meanwhile",
        3600.0)
    rejections_max: int = setting(
        Size(), "bytes of SMTP rejections kept in `<spool.dir>/rejections/` for `mta events --rejections` and "
        "`GET /events?stream=rejections` (the oldest half goes when it is full); 0: none kept", 64 * 1024 * 1024)
    webhook_url: str | None = setting(
        Optional(WebhookUrl()), "where `mta events ship webhook` POSTs batches of events; not set, it refuses to run",
        None)
    webhook_secret_file: str | None = setting(
        Optional(Path()), "the HMAC-SHA256 key that signs each batch (`X-Logspool-Signature`), the file's bytes "
        "with surrounding white space removed; mode 0600 or 0400; not set, batches go unsigned", None)
    webhook_consumer: str = setting(
        ConsumerName(), "the webhook shipper's consumer name: its cursor, lag gauge and pinned segments", "webhook")
    webhook_batch_events: int = setting(
        Integer(1, 100_000), "events in one batch at most (a record's events are never split)", 500)
    webhook_batch_bytes: int = setting(Size(positive=True), "a batch's JSON at most, about", 1024 * 1024)
    webhook_batch_time: float = setting(
        Duration(at_most=3600.0), "how long a batch that is not full waits for more events before it is sent", 1.0)
    webhook_timeout: float = setting(
        Duration(positive=True), "per POST, to connect, send and read the answer; then it is retried", 10.0)
    webhook_retry_max: float = setting(
        Duration(positive=True), "the longest wait between retries of a batch (the wait doubles from 0.5 s)", 60.0)
    kafka_bootstrap_servers: tuple[ListenAddress, ...] = setting(
        ListOf(Listen(default_port=9092)), "the Kafka brokers `mta events ship kafka` first asks for the cluster's "
        "metadata (plaintext Kafka protocol); none, it refuses to run", ())
    kafka_topic: str = setting(TopicName(), "the topic the Kafka shipper produces to (created by the operator)",
                               "logspool-events")
    kafka_consumer: str = setting(
        ConsumerName(), "the Kafka shipper's consumer name: its cursor, lag gauge and pinned segments", "kafka")
    kafka_batch_events: int = setting(
        Integer(1, 100_000), "events produced before the shipper waits for the brokers' acknowledgement of them "
        "all and stores its cursor (a record's events are never split)", 500)
    kafka_batch_bytes: int = setting(Size(positive=True), "a batch's JSON at most, about", 1024 * 1024)
    kafka_batch_time: float = setting(
        Duration(at_most=3600.0), "how long a batch that is not full waits for more events before it is produced",
        1.0)
    kafka_timeout: float = setting(
        Duration(positive=True), "per batch, for every event to be acknowledged by all in-sync replicas "
        "(`message.timeout.ms`); then the batch is produced again", 30.0)
    kafka_retry_max: float = setting(
        Duration(positive=True), "the longest wait between retries of a batch (the wait doubles from 0.5 s)", 60.0)
