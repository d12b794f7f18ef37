"""The relay process: open (= recover) the spool, then serve SMTP, deliver, and answer the admin socket.

Crash-only: there is no shutdown code. SIGTERM, SIGINT and kill -9 all end the
process where it stands (``mta serve`` leaves both signals at the kernel's
default action); the next start recovers from the log.

What can stop a start is checked first, before the spool is touched
(``mta.process.startup.check_start``), and comes out as one exception, not a group.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence

import attrs
import trio

from mta.admin.control import ControlServer
from mta.config import DEFAULTS_SOURCE, Config, ListenAddress, LmtpRoute, MaildirRoute
from mta.config.sections import delivery_workers
from mta.delivery import worker_fork
from mta.delivery.local import DiscardTransport, MaildirTransport
from mta.delivery.scheduler import Scheduler
from mta.delivery.transport import Transport
from mta.delivery.worker_fork import Forked
from mta.delivery.workers import DeliveryWorkers
from mta.dkim import signer_for
from mta.dkim.accept import AcceptSigner
from mta.events.http import EventsServer
from mta.events.rejections import RejectionLog
from mta.http.start import HttpApi
from mta.inbound.listen import bind_error
from mta.inbound.pickup import Pickup
from mta.inbound.server import SmtpServer
from mta.inbound.session import Port
from mta.observe.events_lag import ConsumerLag
from mta.observe.metrics import Metrics
from mta.observe.queue_gauges import keep_gauges, refresh_oldest
from mta.process.lifecycle import Lifecycle, notify
from mta.process.presence import Presence, SharedSlots, presence_path
from mta.process.security import check_spool_dir
from mta.process.server_tls import ssl_context
from mta.process.startup import check_start, unwrapped
from mta.process.supervisor import follow_parent, watch_parent
from mta.shards import shard_config, spool_config
from spool import INLINE_SYNC_FAST, AsyncSpool, FileIO

log = logging.getLogger("mta")


def transports(config: Config, io: FileIO | None = None, forked: Sequence[Forked] = ()) -> Mapping[str, Transport]:
    """The transports by kind; ``io``: the file layer for local delivery (None: the real files).

    With ``[delivery] processes`` > 0, SMTP deliveries go to worker processes (``mta.delivery.workers``),
    the first of them ``forked`` before the loop started (``mta.delivery.worker_fork``).
    """
    from mta.delivery.lmtp_transport import LmtpTransport
    from mta.delivery.smtp_transport import SmtpTransport

    smtp: Transport = DeliveryWorkers(config, config.delivery.processes, forked) \
        if config.delivery.processes > 0 else SmtpTransport(config)  # 0, or "auto" not resolved by mta serve
    return {"maildir": MaildirTransport(config.server.hostname, io), "discard": DiscardTransport(),
            "smtp": smtp, "mx": smtp, "lmtp": LmtpTransport(config)}


def where_mail_goes(config: Config) -> str:
    """The start line that says which config runs and where local mail lands (the rest goes by its routes).

    ``make run`` relies on it to show where the maildir is, with the spool line above it.
    """
    source = "built-in defaults (no config file)" if config.source == DEFAULTS_SOURCE else \
        os.path.abspath(config.source)
    local = [f"{'any other domain' if domain == '*' else '@' + domain} into {route.path}/<localpart>/new/"
             if isinstance(route, MaildirRoute) else
             f"{'any other domain' if domain == '*' else '@' + domain} over LMTP to {route.target}"
             for domain, route in config.routes.items() if isinstance(route, MaildirRoute | LmtpRoute)]
    return f"config {source}; " + (f"local delivery: {', '.join(local)}" if local else "no local delivery")


class Relay:
    """Everything one relay runs, started in order inside one nursery.

    ``shard``: which spool shard this process owns (``config`` is already that
    shard's, see ``mta.shards.shard_config``); ``reuse_port``: listen with
    SO_REUSEPORT beside the other shards' processes; ``supervisor``: the
    parent's pid, whose death ends this process; ``poll_parent``: whether
    this process must poll for that death (the kernel was not asked to
    deliver it, see ``mta.process.supervisor.follow_parent``); ``io``: the
    file layer under the spool and the Maildirs (a test's or a harness's
    recording; None: the real files); ``forked``: delivery workers forked
    before the loop started (``mta.delivery.worker_fork``; none: each is a
    new interpreter); ``shards``: how many the relay runs; ``signals``: this relay is the process's, and owns
    SIGTERM (a drain) and SIGHUP (a reload), see ``mta.process.lifecycle``.
    """

    def __init__(self, config: Config, *, shard: int = 0, reuse_port: bool = False,
                 supervisor: int | None = None, poll_parent: bool = True, io: FileIO | None = None,
                 forked: Sequence[Forked] = (), signals: bool = False, shards: int = 1) -> None:
        self.config = config
        self.shards = shards
        self.signals = signals  # own SIGTERM (drain) and SIGHUP (reload): the process's relay, not a test's
        self.forked = forked
        self.io = io
        self.shard = shard
        self.reuse_port = reuse_port
        self.supervisor = supervisor
        self.poll_parent = poll_parent
        self.metrics = Metrics()
        self.aspool: AsyncSpool
        self.listeners: list[trio.SocketListener] = []
        self.server: SmtpServer | None = None
        self.metrics_listeners: list[trio.SocketListener] = []
        self.api_listeners: list[trio.SocketListener] = []  # [http] listen, shard 0's only
        self.http_api: HttpApi | None = None  # its tokens are read again on SIGHUP
        self.events_listeners: list[trio.SocketListener] = []
        self.scheduler: Scheduler
        self.workers: DeliveryWorkers | None = None  # with [delivery] processes > 0

    async def _serve_events(self, nursery: trio.Nursery, where: ListenAddress) -> None:
        """``GET /events`` (``mta.events.http``): reads in worker threads, bounded, never the loop's work."""
        try:
            self.events_listeners = await nursery.start(EventsServer(self.config).serve, where)
        except OSError as exc:  # taken since check_start tried it
            raise bind_error(where, "events.listen", exc) from None

    async def run(self, *, task_status: trio.TaskStatus[Relay] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        signer = signer_for(cfg)  # a key that cannot sign stops the start before the spool is touched
        api = HttpApi(cfg) if cfg.http.listen is not None and self.shard == 0 else None  # a bad tokens file: too
        self.http_api = api
        os.makedirs(cfg.spool.dir, mode=0o700, exist_ok=True)
        check_spool_dir(cfg.spool.dir)
        self.aspool = await AsyncSpool.open(cfg.spool.dir, spool_config(cfg, self.shard), self.io)
        await keep_gauges(self.aspool)
        self.metrics.watch_spool(self.aspool)
        self.metrics.registry.register(ConsumerLag(cfg.spool.dir, cfg.spool.archive_dir))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refresh_oldest, self.aspool)
            if self.supervisor is not None and self.poll_parent:
                nursery.start_soon(watch_parent, self.supervisor)
            await nursery.start(self.aspool.run)
            rejections = None
            if cfg.events.rejections_max > 0:
                rejections = RejectionLog(cfg.spool.dir, cfg.events.rejections_max, self.io)
                await trio.to_thread.run_sync(rejections.open)
                await nursery.start(rejections.run)
            server = SmtpServer(cfg, self.aspool, self.metrics, ssl_context(cfg),
                                dkim=AcceptSigner(signer) if signer else None,
                                keep_reject=None if rejections is None else rejections.add)
            server.reuse_port = self.reuse_port
            if self.shards > 1:  # outcomes ride a commit while a client is connected to any shard (presence)
                presence = Presence(presence_path(cfg.spool.dir, self.shard), self.shard, self.shards)
                server.slots = SharedSlots(cfg, presence)
                self.aspool.connected_clients = presence.total
            self.server = server
            self.listeners = await nursery.start(server.serve)
            if self.shard == 0:  # one shard takes the drop directory in, so no file is taken twice
                await nursery.start(Pickup(self.aspool, cfg).run)
            control = ControlServer(self.aspool, cfg, shard=self.shard)
            await nursery.start(control.serve)
            from mta.delivery.lmtp_transport import LmtpTransport
            from mta.delivery.smtp_transport import SmtpTransport

            outgoing = transports(cfg, self.io, self.forked)
            smtp = outgoing["smtp"]  # the same transport serves "mx"
            if isinstance(smtp, SmtpTransport):
                smtp.policies.observers.append(self.metrics.tls_policy_outcome)
                await nursery.start(smtp.run)  # its connection cache
            elif isinstance(smtp, DeliveryWorkers):
                smtp.observers.append(self.metrics.tls_policy_outcome)
                self.workers = smtp
                self.aspool.durable_observers.append(smtp.durable)  # a worker marks its own points of no return
                smtp.mark_observers.append(self.metrics.points.labels(by="worker").inc)
                smtp.sync_observers.append(self.metrics.worker_fsyncs.inc)
                # The deliveries' CPU is in the workers: a lone client's fdatasync may run in the loop's thread
                # (spool.aio.group_commit, "inline"; +6 % for a lone client: docs/benchmarks.md, "Inline commit ...").
                self.aspool.inline_sync(INLINE_SYNC_FAST)
                await nursery.start(smtp.run)  # the worker processes, each ready
            lmtp = outgoing["lmtp"]
            if isinstance(lmtp, LmtpTransport):
                await nursery.start(lmtp.run)  # its connection cache
            from mta.shaping.setup import make_shaper

            self.scheduler = Scheduler(self.aspool, cfg, outgoing, self.metrics, shaper=await make_shaper(cfg))
            await nursery.start(self.scheduler.run)
            if cfg.server.metrics_listen is not None:
                where = cfg.server.metrics_listen
                try:
                    self.metrics_listeners = await nursery.start(functools.partial(
                        self.metrics.serve, where, max_connections=cfg.server.metrics_max_connections,
                        timeout=cfg.server.metrics_timeout, ready=lambda: not server.draining))
                except OSError as exc:  # taken since check_start tried it
                    raise bind_error(where, "server.metrics_listen", exc) from None
            if api is not None:
                self.api_listeners = await api.start(nursery, self.aspool, server.disk, self.metrics.registry)
            if cfg.events.listen is not None and self.shard == 0:  # shard 0 serves every shard's stream
                await self._serve_events(nursery, cfg.events.listen)
            if cfg.relay.allow_open_relay and cfg.relay.open_to_all():
                log.warning("open relay: mynetworks covers every address and allow_open_relay = true; anyone "
                            "can send mail anywhere through this relay")
            if self.shard == 0 and "." not in cfg.server.hostname.strip("."):
                log.warning("the relay calls itself %r (banner, EHLO, Received, DSN), which is no fully qualified "
                            "domain name (this host's name does not resolve to one): set [server] hostname",
                            cfg.server.hostname)
            addrs = ", ".join(f"{lst.socket.getsockname()[0]}:{lst.socket.getsockname()[1]}"
                              for lst in self.listeners)
            shard = f", shard {self.shard} (pid {os.getpid()})" if self.supervisor is not None else ""
            for port in (Port.SUBMISSION, Port.SUBMISSIONS):
                if server.listeners[port]:
                    addrs += f"; {port.value} on " + ", ".join(
                        "{}:{}".format(*lst.socket.getsockname()[:2]) for lst in server.listeners[port])
            if server.proxy_listeners:
                addrs += "; behind a balancer (PROXY) on " + ", ".join(
                    "{}:{}".format(*lst.socket.getsockname()[:2]) for lst in server.proxy_listeners)
            if self.signals:
                await nursery.start(Lifecycle(self, cfg.server.drain_timeout).run)
            log.info("logspool relay %s listening on %s, spool %s%s", cfg.server.hostname, addrs, cfg.spool.dir,
                     shard)
            if self.shard == 0:
                log.info("%s", where_mail_goes(cfg))
            if self.signals and (self.supervisor is None or self.shard == 0):  # shard 0 speaks for the relay
                notify(f"READY=1\nMAINPID={self.supervisor or os.getpid()}")
            task_status.started(self)

    @property
    def ports(self) -> list[int]:
        return [int(lst.socket.getsockname()[1]) for lst in self.listeners]

    def ports_of(self, port: Port) -> list[int]:
        """The ports the listeners of one kind were given (submission's, say, when the OS picked them)."""
        listeners = self.server.listeners.get(port, []) if self.server is not None else []
        return [int(lst.socket.getsockname()[1]) for lst in listeners]


def serve(config: Config) -> None:
    """The single-process relay.

    Raises:
        ConfigError, StartError, SpoolError, OSError: it cannot start (one exception, never a group).
    """
    check_start(config)
    config, forked = _with_workers(config, 1)
    with unwrapped():
        trio.run(Relay(config, forked=forked, signals=True).run)


def serve_shard(config: Config, shard: int, shards: int, supervisor: int) -> None:
    """One shard's process under ``mta serve``'s supervisor (``config`` is the whole relay's).

    The supervisor ran ``check_start`` for every shard before it started any.
    """
    armed = follow_parent(supervisor)
    config, forked = _with_workers(config, shards)
    with unwrapped():
        trio.run(Relay(shard_config(config, shard, shards), shard=shard, reuse_port=True, supervisor=supervisor,
                       poll_parent=not armed, forked=forked, signals=True, shards=shards).run)


def _with_workers(config: Config, relay_processes: int) -> tuple[Config, list[Forked]]:
    """``[delivery] processes`` resolved for one of ``relay_processes`` relay processes ("auto": the CPUs
    they leave), and the first lives of those workers forked; before trio's loop and threads start."""
    config = attrs.evolve(config, delivery=attrs.evolve(
        config.delivery, processes=delivery_workers(config.delivery.processes, relay_processes)))
    return config, worker_fork.prefork(config.delivery.processes)
