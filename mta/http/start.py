"""The HTTP API as the relay starts it: its tokens read before the spool is opened, its keys after.

Only one relay process serves the API (shard 0 under ``mta serve`` with
``processes`` > 1): idempotency keys are kept beside one spool, so a retry
must reach the process that saw the first try.
"""

from __future__ import annotations

import logging

import trio

from mta.config import Config
from mta.http.idempotency import KeyStore
from mta.http.inject import Injector
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

    async def start(self, nursery: trio.Nursery, aspool: AsyncSpool, disk: DiskCheck) -> list[trio.SocketListener]:
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
                           max_request_size=http.max_request_size)
        try:
            listeners: list[trio.SocketListener] = await nursery.start(server.serve, http.listen)
        except OSError as exc:
            raise bind_error(http.listen, "http.listen", exc) from None
        where = ", ".join("{}:{}".format(*lst.socket.getsockname()[:2]) for lst in listeners)
        log.info("HTTP API listening on %s (POST /api/inject/v1)", where)
        return listeners
