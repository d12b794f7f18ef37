"""The HTTP API as the relay starts it: its tokens read before the spool is opened, its keys after.

Only one relay process serves the API (shard 0 under ``mta serve`` with
``processes`` > 1): idempotency keys are kept beside one spool, so a retry
must reach the process that saw the first try.
"""

from __future__ import annotations

import logging
import ssl

import trio
from prometheus_client import CollectorRegistry

from mta.config import Config
from mta.errors import StartError
from mta.http.idempotency import KeyStore
from mta.http.inject import Injector
from mta.http.metrics import ApiMetrics
from mta.http.server import ApiServer
from mta.http.tokens import read_tokens
from mta.inbound.disk import DiskCheck
from mta.inbound.listen import bind_error
from spool import AsyncSpool

__all__ = ["HttpApi"]

log = logging.getLogger("mta.http")


class HttpApi:
    """``[http]``; construct before the spool is opened (raises StartError for a tokens file that cannot serve)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.tokens = read_tokens(config.http.tokens_file, config.source)
        self.tls = api_tls_context(config)
        self.server: ApiServer | None = None

    async def start(self, nursery: trio.Nursery, aspool: AsyncSpool, disk: DiskCheck,
                    registry: CollectorRegistry | None = None) -> list[trio.SocketListener]:
        """Rebuild the keys (the log after in-flight requests is read), then listen. Returns the listeners.

        Raises StartError: the address cannot be bound; OSError: the keys file cannot be read or written.
        """
        cfg = self.config
        http = cfg.http
        assert http.listen is not None
        keys = await trio.to_thread.run_sync(KeyStore.open, cfg.spool.dir, aspool.core, http.idempotency_window)
        injector = Injector(aspool, keys, hostname=cfg.server.hostname, max_recipients=http.max_recipients,
                            max_message_size=cfg.server.max_message_size)
        server = ApiServer(injector, self.tokens, disk, max_connections=http.max_connections, timeout=http.timeout,
                           max_request_size=http.max_request_size, metrics=ApiMetrics(registry),
                           ssl_context=self.tls)
        self.server = server
        try:
            listeners: list[trio.SocketListener] = await nursery.start(server.serve, http.listen)
        except OSError as exc:
            raise bind_error(http.listen, "http.listen", exc) from None
        where = ", ".join("{}:{}".format(*lst.socket.getsockname()[:2]) for lst in listeners)
        log.info("HTTP API listening on %s (POST /api/inject/v1%s)", where, ", HTTPS" if self.tls else "")
        return listeners


def api_tls_context(config: Config) -> ssl.SSLContext | None:
    """``[http] tls_cert`` and ``tls_key`` as a server context (None: plain HTTP). Raises StartError naming the
    setting: one of the two without the other, or files that do not load."""
    http = config.http
    if http.tls_cert is None and http.tls_key is None:
        return None
    if http.tls_cert is None or http.tls_key is None:
        missing = "http.tls_cert" if http.tls_cert is None else "http.tls_key"
        raise StartError("needs http.tls_cert and http.tls_key together", config.source, missing)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # a handshake per request from the client: a cheap DoS, nothing gained
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        ctx.load_cert_chain(http.tls_cert, http.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise StartError(f"{http.tls_cert}, {http.tls_key}: {' '.join(str(exc).split())}", config.source,
                         "http.tls_cert") from None
    return ctx
