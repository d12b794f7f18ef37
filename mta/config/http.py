"""``[http]``: the HTTP API listener (``POST /api/inject/v1``), its tokens and its bounds.

The listener is off unless ``listen`` is set; then ``tokens_file`` is
required (no API without authentication), and the relay refuses to start
when the file is missing, empty, or open to other users (mode other than
0600 or 0400). docs/operations.md, "HTTP injection".
"""

from __future__ import annotations

import attrs

from mta.config.values import Listen, ListenAddress
from spool import Duration, Integer, Optional, Path, Size, setting

__all__ = ["HttpSection"]

DAY = 86400.0


@attrs.frozen(kw_only=True)
class HttpSection:
    """``[http]``: where the API listens, who may use it, and how much one request may cost."""

    listen: ListenAddress | None = setting(
        Optional(Listen()), "the HTTP API (`POST /api/inject/v1`), `host:port`; not set, none", None)
    tokens_file: str | None = setting(
        Optional(Path()), "bearer tokens accepted by the API, one a line (`#` starts a comment); mode 0600 or 0400, "
        "or the relay refuses to start; required with `listen`", None)
    tls_cert: str | None = setting(
        Optional(Path()), "PEM certificate chain: with `tls_key`, the API speaks HTTPS only (TLS 1.2 or later); "
        "read again on reload; not set, plain HTTP", None)
    tls_key: str | None = setting(Optional(Path()), "PEM private key of `tls_cert`", None)
    max_connections: int = setting(
        Integer(1, 1024), "API requests served at once; more wait in the listen backlog", 16)
    timeout: float = setting(
        Duration(positive=True), "per API request: to send its head and body, have its messages made durable and "
        "read the answer; past it the connection is closed (the client retries with its `Idempotency-Key`)", 60.0)
    max_request_size: int = setting(
        Size(low=1024, high=1 << 30), "the largest request body; a larger one gets `413` before it is read", 32 << 20)
    max_recipients: int = setting(
        Integer(1, 100000), "recipients in one request; more get `400`", 10000)
    idempotency_window: float = setting(
        Duration(positive=True), "how long an `Idempotency-Key` is remembered: a request with a key seen within it "
        "gets the first answer's queue ids and creates nothing", DAY)
