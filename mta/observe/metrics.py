"""Prometheus metrics for the relay, on a registry of its own (tests run many relays in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from mta.config import ListenAddress
from mta.observe.metrics_http import MetricsServer
from spool import NEVER, QueueGauges, Status

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400, float("inf"))


class _SpoolCollector:
    """Read the engine's own counters at scrape time instead of mirroring them."""

    def __init__(self, spool: Any) -> None:
        self.spool = spool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        core = self.spool.core
        w = core.writer
        yield GaugeMetricFamily("logspool_fsyncs", "fsync/fdatasync calls since start", value=w.fsyncs)
        yield GaugeMetricFamily("logspool_commits", "group commits since start", value=w.commits)
        yield GaugeMetricFamily("logspool_records_appended", "records appended since start", value=w.records)
        yield GaugeMetricFamily("logspool_bytes_appended", "bytes appended since start", value=w.appended_bytes)
        active = GaugeMetricFamily("logspool_active_messages", "messages being delivered, by runner class",
                                   labels=["class"])
        by_class: dict[int, int] = {}
        for a in list(core.attempts.values()):
            by_class[a.klass] = by_class.get(a.klass, 0) + 1
        for k, n in sorted(by_class.items()):
            active.add_metric([str(k)], n)
        yield active
        lag = GaugeMetricFamily("logspool_runner_position", "each runner's log position", labels=["class"])
        for r in core.runners:
            lag.add_metric([str(r.klass)], r.pos)
        yield lag
        stats = core.recovery_stats
        yield GaugeMetricFamily("logspool_recovery_bytes_read", "bytes read by the last recovery",
                                value=stats.bytes_read)
        gauges = core.gauges
        # In doubt after the last recovery: those it found, and those held by an earlier one and still queued.
        yield GaugeMetricFamily("logspool_recovery_in_doubt", "recipients in doubt in the queue after the last "
                                "recovery", value=gauges.in_doubt_recipients_seeded if gauges else stats.in_doubt)
        if gauges is not None:
            yield from _queue_gauges(gauges, len(core.by_envelope), core.config.clock())
        # Damage (spool.damage.policy; docs/operations.md, "When the disk lies").
        damage = core.damage
        found = GaugeMetricFamily("logspool_damage_found", "damage met since start, each piece once, by kind "
                                  "(damaged_record, missing_segment, size_mismatch, ends_early, bad_header, cut, "
                                  "checkpoint)", labels=["kind"])
        for kind, n in sorted(damage.found.items()):
            found.add_metric([kind], n)
        yield found
        yield GaugeMetricFamily("logspool_damage_lost_messages", "messages named lost to damage since start",
                                value=damage.lost_named)
        yield GaugeMetricFamily("logspool_damaged_bodies", "message bodies found damaged since start (those messages "
                                "are bounced or held)", value=damage.damaged_bodies)
        entries, kept, lost = damage.quarantine.totals()
        yield GaugeMetricFamily("logspool_quarantine_entries", "pieces of damage kept in the quarantine directory",
                                value=entries)
        yield GaugeMetricFamily("logspool_quarantine_bytes", "bytes kept in the quarantine directory", value=kept)
        yield GaugeMetricFamily("logspool_quarantine_lost_messages", "messages the quarantine directory's notes name "
                                "lost (every start's)", value=lost)


def _queue_gauges(g: QueueGauges, active: int, now: float) -> Iterator[GaugeMetricFamily]:
    """The queue as the spool keeps it (``spool.engine.gauges``): no walk of the log here."""
    yield GaugeMetricFamily("logspool_queue_messages", "messages in the queue, every state (being delivered, due, "
                            "deferred, held)", value=g.new + g.deferred + g.held + active)
    yield GaugeMetricFamily("logspool_queue_deferred", "messages waiting for a retry", value=g.deferred)
    yield GaugeMetricFamily("logspool_queue_held", "messages held (in doubt or by the administrator)",
                            value=g.held)
    yield GaugeMetricFamily("logspool_queue_in_doubt", "messages not being delivered with recipients perhaps "
                            "delivered before a crash", value=g.in_doubt)
    age = max(0.0, now - g.oldest_ms / 1000) if g.oldest_ms != NEVER else 0.0
    yield GaugeMetricFamily("logspool_queue_oldest_age_seconds", "age of the oldest message in the queue (0: "
                            "empty)", value=round(age, 3))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.accepted = Counter("logspool_accepted_messages", "messages accepted (250 after DATA)", registry=r)
        self.rejected = Counter("logspool_rejected_commands", "SMTP commands refused", ["reason"], registry=r)
        self.outcomes = Counter("logspool_recipient_outcomes", "per-recipient delivery outcomes", ["status"],
                                registry=r)
        # Labels are bounded: the classes are a fixed set (mta.bounce_class.CLASSES).
        self.outcome_classes = Counter("logspool_outcome_classes", "per-recipient outcomes that did not deliver "
                                       "(deferred, bounced, expired), by status and bounce class", ["status", "class"],
                                       registry=r)
        self.bounced_dsn = Counter("logspool_dsn_sent", "delivery status notifications generated", registry=r)
        self.points = Counter("logspool_points_of_no_return", "final dots made safe to send, by who made their "
                              "record durable (relay: a sending record in the log; worker: a delivery worker's mark)",
                              ["by"], registry=r)
        # The log's are logspool_fsyncs; these are the other half of what the disk is asked to sync.
        self.worker_fsyncs = Counter("logspool_worker_fsyncs", "fdatasyncs of the delivery workers' marks files "
                                     "(their points of no return)", registry=r)
        self.latency = Histogram("logspool_delivery_latency_seconds", "arrival to final delivery",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("logspool_commit_batch_messages", "messages covered by one acceptance commit",
                               buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.sessions = Counter("logspool_smtp_sessions", "SMTP sessions opened", registry=r)
        self.sessions_refused = Counter("logspool_smtp_sessions_refused",
                                        "SMTP connections refused (421 4.7.0) by a session limit", ["limit"],
                                        registry=r)
        self.timeouts = Counter("logspool_smtp_timeouts", "SMTP sessions ended by a deadline (421 4.4.2)",
                                ["phase"], registry=r)
        # Labels are bounded: results are fixed sets, DKIM domains come from the config's [[dkim.key]] tables.
        self.auth = Counter("logspool_auth", "SMTP AUTH exchanges decided on the submission ports, by result "
                            "(success, failure, rate_limit, unavailable)", ["result"], registry=r)
        self.dkim_signed = Counter("logspool_dkim_signed", "DKIM signatures made as mail was accepted, by signing "
                                   "domain", ["domain"], registry=r)
        self.dkim_unsigned = Counter("logspool_dkim_unsigned", "trusted clients' messages left unsigned, by reason "
                                     "(no_key, no_from, several_from, mixed_from, error)", ["reason"], registry=r)
        self.tls_policy = Counter("logspool_tls_policy", "outcomes under a receiving domain's published TLS policy "
                                  "(what TLS-RPT counts), by policy (mta-sts, dane) and result (success or "
                                  "RFC 8460's result type)", ["policy", "result"], registry=r)
        self.server: MetricsServer | None = None

    def watch_spool(self, aspool: Any) -> None:
        """Read the engine's counters at each scrape, and observe each acceptance commit's size as it happens."""
        self.registry.register(_SpoolCollector(aspool))
        aspool.commit_observers.append(self.batch.observe)

    def outcome(self, status: Status, delay: float, bounce_class: str | None = None) -> None:
        self.outcomes.labels(status.name.lower()).inc()
        if status is Status.DELIVERED:
            self.latency.observe(delay)
        if bounce_class is not None:
            self.outcome_classes.labels(status.name.lower(), bounce_class).inc()

    def tls_policy_outcome(self, policy: str, result: str) -> None:
        """A ``Planner`` observer (``mta.delivery.tlspolicy.plan``): one session or lookup under a policy."""
        self.tls_policy.labels(policy, result).inc()

    async def serve(self, address: ListenAddress, *, max_connections: int, timeout: float,
                    ready: Callable[[], bool] = lambda: True,
                    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
        """Expose the registry over HTTP in this event loop (``metrics_http``); ``started`` gives the listeners.

        ``ready``: what ``GET /ready`` answers (``mta.observe.readiness``)."""
        self.server = MetricsServer(self.registry, max_connections=max_connections, timeout=timeout, ready=ready)
        await self.server.serve(address, task_status=task_status)
