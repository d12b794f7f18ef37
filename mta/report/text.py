"""The report as plain text, in the manner of pflogsumm (and qshape for the queue)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from mta.report.figures import LATENCY_LABELS, PERCENTILES, QSHAPE_LABELS, STATUS_NAMES, Figures


def fmt_time(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_delay(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    out = ["", title, "-" * len(title)]
    if not rows:
        return [*out, "  none"]
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        first = r[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(r[1:], widths[1:]))
        out.append(f"  {first}  {rest}".rstrip())
    return out


def render_text(f: Figures) -> str:
    t = f.totals
    lines = [
        "logspool delivery report",
        "========================",
        f"period: {fmt_time(f.first_ms)} .. {fmt_time(f.last_ms)}",
        "",
        "Grand totals",
        "------------",
        f"  {t['received']:>8}  received (messages)",
        f"  {t['recipients']:>8}  recipients",
        f"  {t['bytes']:>8}  bytes received",
        f"  {t['delivered']:>8}  delivered",
        f"  {t['deferred']:>8}  deferred ({t['deferred_messages']} messages)",
        f"  {t['bounced']:>8}  bounced",
        f"  {t['expired']:>8}  expired",
        f"  {t['deleted']:>8}  deleted",
        f"  {t['queued']:>8}  still queued ({t['held']} held)",
    ]
    lines += _table("Messages by final state", ["state", "messages"], sorted(f.states.items()))
    lines += _table("Per-domain delivery", ["domain", *STATUS_NAMES[:4], "avg delay", "max delay"],
                    [(d.domain, d.delivered, d.deferred, d.bounced, d.expired, fmt_delay(d.avg_delay_s),
                      fmt_delay(d.max_delay_s)) for d in f.domains])
    lines += _table("Delivery latency", ["percentile", "delay"],
                    [(f"p{round(p * 100)}", fmt_delay(v)) for p, v in zip(PERCENTILES, f.latency)])
    lines += _table("Latency distribution", ["delay", "recipients"], list(zip(LATENCY_LABELS, f.latency_hist)))
    lines += _table("Attempts per message", ["attempts", "messages"], f.retries)
    lines += _table("Top deferral reasons", ["reason", "count"], f.top_deferrals)
    lines += _table("Top bounce reasons", ["reason", "count"], f.top_bounces)
    lines += _table("Bounce classes", ["class", "count"], f.bounce_classes)
    lines += _table("Top sender domains", ["domain", "messages", "bytes"], f.top_sender_domains)
    lines += _table("Top recipient domains", ["domain", "recipients"], f.top_recipient_domains)
    lines += _table("Volume per hour", ["hour", "received", "delivered"],
                    [(fmt_time(h)[:13] + "h", rx, dx) for h, rx, dx in f.per_hour])
    lines += _table("Queue age by domain (minutes, like qshape)", ["domain", "total", *QSHAPE_LABELS],
                    [(q.domain, q.total, *q.buckets) for q in f.queue_shape])
    if f.errors:
        lines += _table("Damaged segments (records there were not read)", ["file", "offset", "what"], f.errors)
    return "\n".join(lines) + "\n"
