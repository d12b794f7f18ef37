"""What the report shows: the :class:`Figures` value and the tables that label it.

The job (``mta.report.job``) computes a ``Figures`` with Spark, the tests
compute one with plain Python (tests/support/report_reference.py), and the renderers
(``mta.report.text``, ``mta.report.html_page``) only format one. Keeping the
value and its labels here, apart from all three, is what lets every arrow
point one way: renderers → figures ← job, and job → renderers.
"""

from __future__ import annotations

from typing import Final

import attrs

STATUS_NAMES: Final = ("delivered", "deferred", "bounced", "expired", "deleted")
"""Delivery outcomes by ``spool.format.record.Status`` value (the index is the status)."""
LATENCY_EDGES_S: Final = (1, 10, 60, 300, 1800, 3600, 4 * 3600, 86400)
LATENCY_LABELS: Final = ("<1s", "1-10s", "10s-1m", "1-5m", "5-30m", "30m-1h", "1-4h", "4h-1d", ">1d")
QSHAPE_EDGES_MIN: Final = (5, 10, 20, 40, 80, 160, 320, 640, 1280)
QSHAPE_LABELS: Final = ("0-5", "5-10", "10-20", "20-40", "40-80", "80-160", "160-320", "320-640", "640-1280", "1280+")
TOP_N: Final = 10
CLASSED_NAMES: Final = ("deferred", "bounced", "expired")
"""The outcomes that get a bounce class (``mta.bounce_class``)."""
PERCENTILES: Final = (0.5, 0.9, 0.99)


@attrs.frozen
class DomainRow:
    domain: str
    delivered: int
    deferred: int
    bounced: int
    expired: int
    avg_delay_s: float | None  # over delivered recipients
    max_delay_s: float | None


@attrs.frozen
class QueueShapeRow:
    domain: str
    total: int
    buckets: tuple[int, ...]  # recipients per QSHAPE_LABELS age bucket (minutes)


@attrs.frozen
class Figures:
    """Everything the report shows. Lists are in display order."""

    first_ms: int | None
    last_ms: int | None
    totals: dict[str, int]
    states: dict[str, int]  # messages per final state
    domains: tuple[DomainRow, ...]
    latency: tuple[float | None, ...]  # PERCENTILES of delivery delay, seconds
    latency_hist: tuple[int, ...]  # per LATENCY_LABELS
    retries: tuple[tuple[int, int], ...]  # (attempts, messages)
    top_deferrals: tuple[tuple[str, int], ...]
    top_bounces: tuple[tuple[str, int], ...]
    top_sender_domains: tuple[tuple[str, int, int], ...]  # (domain, messages, bytes)
    top_recipient_domains: tuple[tuple[str, int], ...]
    per_hour: tuple[tuple[int, int, int], ...]  # (hour start ms, received, delivered)
    queue_shape: tuple[QueueShapeRow, ...]
    errors: tuple[tuple[str, int, str], ...]  # (file, offset, what)
    bounce_classes: tuple[tuple[str, int], ...] = ()  # (class, attempts) over the outcomes that did not deliver
