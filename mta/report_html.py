"""The report as one self-contained HTML page with inline SVG charts.

Why SVG written here rather than matplotlib: the charts are plain bar charts,
and a page with no dependency and no image files can be mailed or archived
as it is.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from mta.report import LATENCY_LABELS, PERCENTILES, QSHAPE_LABELS, STATUS_NAMES, Figures
from mta.report_text import fmt_delay, fmt_time

COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f")


def svg_bars(title: str, labels: Sequence[str], series: Sequence[tuple[str, Sequence[int]]],
             width: int = 720, height: int = 260) -> str:
    """A grouped bar chart: one group per label, one bar per series."""
    left, bottom, top, right = 50, 60, 30, 10
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max([1, *(v for _n, vals in series for v in vals)])
    group_w = plot_w / max(1, len(labels))
    bar_w = max(1.0, group_w * 0.8 / max(1, len(series)))
    e = html.escape
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{e(title)}" font-family="sans-serif" font-size="11">',
             f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{e(title)}</text>',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#333"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#333"/>',
             f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{peak}</text>',
             f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>']
    for g, label in enumerate(labels):
        x0 = left + g * group_w + group_w * 0.1
        for s, (name, vals) in enumerate(series):
            h = plot_h * vals[g] / peak
            x = x0 + s * bar_w
            parts.append(f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                         f'fill="{COLORS[s % len(COLORS)]}"><title>{e(name)} {e(label)}: {vals[g]}</title></rect>')
        if len(labels) <= 24 or g % max(1, len(labels) // 24) == 0:
            cx = left + g * group_w + group_w / 2
            parts.append(f'<text x="{cx:.1f}" y="{top + plot_h + 12}" text-anchor="end" '
                         f'transform="rotate(-40 {cx:.1f} {top + plot_h + 12})">{e(label)}</text>')
    for s, (name, _vals) in enumerate(series):
        x = left + s * 110
        parts.append(f'<rect x="{x}" y="{height - 12}" width="10" height="10" fill="{COLORS[s % len(COLORS)]}"/>'
                     f'<text x="{x + 14}" y="{height - 3}">{e(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    if not rows:
        body = f'<tr><td colspan="{len(header)}">none</td></tr>'
    return f"<h2>{e(title)}</h2>\n<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(f: Figures) -> str:
    t = f.totals
    hours = [fmt_time(h)[11:13] + "h" if i else fmt_time(h)[:13] + "h" for i, (h, _r, _d) in enumerate(f.per_hour)]
    volume = svg_bars("Volume per hour (UTC)", hours,
                      [("received", [r for _h, r, _d in f.per_hour]), ("delivered", [d for _h, _r, d in f.per_hour])])
    latency = svg_bars("Delivery latency", LATENCY_LABELS, [("recipients", f.latency_hist)])
    deferring = sorted(f.domains, key=lambda d: (-d.deferred, d.domain))[:15]
    deferrals = svg_bars("Deferrals by domain", [d.domain for d in deferring],
                         [("deferred", [d.deferred for d in deferring]), ("bounced", [d.bounced for d in deferring])])
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
        _table("Top sender domains", ["domain", "messages", "bytes"], f.top_sender_domains),
        _table("Top recipient domains", ["domain", "recipients"], f.top_recipient_domains),
        _table("Queue age by domain (minutes)", ["domain", "total", *QSHAPE_LABELS],
               [(q.domain, q.total, *q.buckets) for q in f.queue_shape]),
    ]
    if f.errors:
        sections.append(_table("Damaged segments", ["file", "offset", "what"], f.errors))
    style = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin-bottom:1em}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child{text-align:left}"
             ".charts svg{display:block;margin:1em 0}")
    period = f"{fmt_time(f.first_ms)} .. {fmt_time(f.last_ms)}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>logspool delivery report</title>'
            f"<style>{style}</style></head><body>\n<h1>logspool delivery report</h1>\n"
            f"<p>period: {html.escape(period)}</p>\n" + "\n".join(sections) + "\n</body></html>\n")
