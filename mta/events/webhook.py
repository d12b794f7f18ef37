"""The webhook shipper: the event stream POSTed to a URL in signed JSON batches, at least once, in order.

Runs in a process of its own (``mta events ship webhook``), reading the
spool's files like ``mta events``: a receiver that is down or slow costs
the relay nothing but the disk its cursor pins (``[spool] cursor_pin_max``).

Delivery (``mta.events.shipping``): batches go one at a time, in log order;
a batch is retried (0.5 s, doubling to ``webhook_retry_max``) until the
receiver answers 2xx, and only then is the cursor stored (fsynced) and the
next batch sent. After a crash of the shipper, what followed the stored
cursor is sent again, with the same ids (``id``: the record's position and
the recipient's index), for the receiver to drop what it has.

The request::

    POST <webhook_url>
    Content-Type: application/json
    X-Logspool-Timestamp: <unix seconds>
    X-Logspool-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>." + body, keyed with the secret file>
    X-Logspool-Batch: <first event id>..<last event id>

    {"events": [...], "next": "<cursor>", "shard": 0}
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import os
import stat
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from mta.config import Config, ConfigError
from mta.events.batching import Batch, Batcher
from mta.events.cursors import Cursors
from mta.events.shipping import Answer, Shipper
from mta.events.source import classes_of, open_stream
from spool import format_pos


class UnsafeSecret(ConfigError):
    """The secret file is open to other users."""


def read_secret(path: str | None) -> bytes | None:
    """The HMAC key in ``path`` (None: unsigned). Raises UnsafeSecret, ConfigError for an unreadable or empty file."""
    if path is None:
        return None
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise ConfigError(f"events.webhook_secret_file {path}: {e.strerror or e}") from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeSecret(f"events.webhook_secret_file {path} is open to other users (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it and consider the key exposed")
    if not key:
        raise ConfigError(f"events.webhook_secret_file {path} is empty")
    return key


def signature(secret: bytes, timestamp: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class WebhookSender:
    """One POST per batch to ``url``; connection errors, timeouts and non-2xx answers are failures."""

    def __init__(self, url: str, secret: bytes | None, timeout: float) -> None:
        self.url = url
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.secret = secret
        self.timeout = timeout

    def body(self, batch: Batch, shard: int) -> bytes:
        return json.dumps({"events": list(batch.events), "next": format_pos(batch.cursor), "shard": shard},
                          sort_keys=True).encode()

    def send(self, batch: Batch, shard: int) -> Answer:
        body = self.body(batch, shard)
        stamp = str(int(time.time()))
        headers = {"Content-Type": "application/json", "User-Agent": "logspool-events",
                   "X-Logspool-Timestamp": stamp,
                   "X-Logspool-Batch": f"{batch.events[0]['id']}..{batch.events[-1]['id']}"}
        if self.secret is not None:
            headers["X-Logspool-Signature"] = signature(self.secret, stamp, body)
        conn_class = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_class(self._host, self._port, timeout=self.timeout)
        try:
            conn.request("POST", self._path, body=body, headers=headers)
            answer = conn.getresponse()
            answer.read()
            if 200 <= answer.status < 300:
                return Answer(True, str(answer.status))
            return Answer(False, f"{answer.status} {answer.reason}")
        except (OSError, http.client.HTTPException) as e:
            return Answer(False, " ".join(str(e).split()) or type(e).__name__)
        finally:
            conn.close()


def ship_webhook(config: Config, shard: int = 0, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
    """Ship ``shard``'s events to ``[events] webhook_url`` until the process ends. Raises ConfigError
    when the settings cannot work (no URL, an unsafe secret), SpoolNotFound."""
    cfg = config.events
    if cfg.webhook_url is None:
        raise ConfigError("not set: nowhere to ship to", config.source, "events.webhook_url")
    sender = WebhookSender(cfg.webhook_url, read_secret(cfg.webhook_secret_file), cfg.webhook_timeout)
    Shipper(open_stream(config, shard), Cursors(config), cfg.webhook_consumer, shard, sender,
            Batcher(cfg.webhook_batch_events, cfg.webhook_batch_bytes, cfg.webhook_batch_time),
            cfg.webhook_retry_max, cfg.webhook_url, sleep, clock, classes_of(config)).run()
