"""The report as one self-contained HTML page with inline SVG charts.

The charts are drawn by ``mta.report.charts`` (matplotlib) and put in the
page as ``<svg>`` elements, not image files or links: a page with no files
beside it and no external reference can be mailed or archived as it is, and
opens with no network: in a browser it makes no request but its own
(tests/report/test_report_browser.py loads it in headless Chromium).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from mta.report.charts import CSS_CLASS, Series, bar_chart
from mta.report.figures import LATENCY_LABELS, PERCENTILES, QSHAPE_LABELS, STATUS_NAMES, Figures
from mta.report.text import fmt_delay, fmt_time

DAY_MS = 86_400_000
HOUR_MS = 3_600_000


def hourly(per_hour: Sequence[tuple[int, int, int]]) -> tuple[list[str], dict[int, str], list[int], list[int]]:
    """The volume chart's x axis: every hour from the first to the last, the
    quiet ones as zeros (an axis that skipped them would misstate the time),
    or every day when the period is over two weeks long (hourly bars would be
    under a pixel wide). Returns labels, date sublabels, received, delivered."""
    if not per_hour:
        return [], {}, [], []
    slot = DAY_MS if per_hour[-1][0] - per_hour[0][0] > 14 * DAY_MS else HOUR_MS
    counts: dict[int, list[int]] = {}
    for h, rx, dx in per_hour:
        c = counts.setdefault(h - h % slot, [0, 0])
        c[0] += rx
        c[1] += dx
    first, last = min(counts), max(counts)
    slots = range(first, last + slot, slot)
    labels, days = [], {}
    for i, t in enumerate(slots):
        stamp = fmt_time(t)
        if slot == HOUR_MS:
            labels.append(stamp[11:13])
            if i == 0 or t % DAY_MS == 0:
                days[i] = stamp[:10]
        else:
            labels.append(stamp[8:10])
            if i == 0 or stamp[8:10] == "01":
                days[i] = stamp[:7]
    return (labels, days, [counts.get(t, [0, 0])[0] for t in slots], [counts.get(t, [0, 0])[1] for t in slots])


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    if not rows:
        body = f'<tr><td colspan="{len(header)}">none</td></tr>'
    return f"<h2>{e(title)}</h2>\n<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


NO_FAVICON = '<link rel="icon" href="data:,">'
"""An empty icon in the page itself: without it a browser asks the page's server for
``/favicon.ico`` (a request, and a 404 in the console, where the page is served over HTTP)."""


def render_html(f: Figures) -> str:
    t = f.totals
    labels, days, received, delivered = hourly(f.per_hour)
    per_day = bool(f.per_hour) and f.per_hour[-1][0] - f.per_hour[0][0] > 14 * DAY_MS
    volume = bar_chart("Volume per day (UTC)" if per_day else "Volume per hour (UTC)", labels,
                       [Series("received", received), Series("delivered", delivered)], sublabels=days).svg("volume")
    latency = bar_chart("Delivery latency (recipients)", LATENCY_LABELS,
                        [Series("delivered", f.latency_hist)]).svg("latency")
    # Domains where something went wrong, worst first; the fully delivered ones would be empty groups.
    troubled = [d for d in f.domains if d.deferred or d.bounced or d.expired]
    deferring = sorted(troubled, key=lambda d: (-d.deferred, -d.bounced - d.expired, d.domain))[:15]
    deferrals = bar_chart("Deferrals by domain (recipient attempts)", [d.domain for d in deferring],
                          [Series("deferred", [d.deferred for d in deferring]),
                           Series("bounced", [d.bounced for d in deferring]),
                           Series("expired", [d.expired for d in deferring])]).svg("deferrals")
    totals = [("received (messages)", t["received"]), ("recipients", t["recipients"]), ("bytes", t["bytes"]),
              *((s, t[s]) for s in STATUS_NAMES), ("messages deferred", t["deferred_messages"]),
              ("still queued", t["queued"]), ("held", t["held"])]
    sections = [
        _table("Grand totals", ["", "count"], totals),
        f'<div class="charts">{volume}{latency}{deferrals}</div>',
        _table("Per-domain delivery", ["domain", *STATUS_NAMES[:4], "avg delay", "max delay"],
               [(d.domain, d.delivered, d.deferred, d.bounced, d.expired, fmt_delay(d.avg_delay_s),
                 fmt_delay(d.max_delay_s)) for d in f.domains]),
        _table("Delivery latency", ["percentile", "delay"],
               [(f"p{round(p * 100)}", fmt_delay(v)) for p, v in zip(PERCENTILES, f.latency)]),
        _table("Messages by final state", ["state", "messages"], sorted(f.states.items())),
        _table("Attempts per message", ["attempts", "messages"], f.retries),
        _table("Top deferral reasons", ["reason", "count"], f.top_deferrals),
        _table("Top bounce reasons", ["reason", "count"], f.top_bounces),
        _table("Bounce classes", ["class", "count"], f.bounce_classes),
        _table("Top sender domains", ["domain", "messages", "bytes"], f.top_sender_domains),
        _table("Top recipient domains", ["domain", "recipients"], f.top_recipient_domains),
        _table("Queue age by domain (minutes)", ["domain", "total", *QSHAPE_LABELS],
               [(q.domain, q.total, *q.buckets) for q in f.queue_shape]),
    ]
    if f.errors:
        sections.append(_table("Damaged segments", ["file", "offset", "what"], f.errors))
    style = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin-bottom:1em}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child{text-align:left}"
             f"svg.{CSS_CLASS}{{display:block;margin:1em 0;max-width:100%;height:auto}}")
    period = f"{fmt_time(f.first_ms)} .. {fmt_time(f.last_ms)}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>logspool delivery report</title>'
            f'{NO_FAVICON}'
            f"<style>{style}</style></head><body>\n<h1>logspool delivery report</h1>\n"
            f"<p>period: {html.escape(period)}</p>\n" + "\n".join(sections) + "\n</body></html>\n")
