"""The report as one self-contained HTML page with inline SVG charts.

Why SVG written here rather than matplotlib: the charts are plain bar charts,
and a page with no dependency and no image files can be mailed or archived
as it is.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from mta.report.figures import LATENCY_LABELS, PERCENTILES, QSHAPE_LABELS, STATUS_NAMES, Figures
from mta.report.text import fmt_delay, fmt_time

COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f")
CHAR_W = 7.0  # a generous average advance of an 11 px sans-serif character, for layout
MAX_LABEL = 32  # longer labels (domains) are cut, with an ellipsis; the bar's tooltip has the whole
DAY_MS = 86_400_000
HOUR_MS = 3_600_000


def _text_w(text: str) -> float:
    return len(text) * CHAR_W


def nice_step(peak: int, ticks: int = 5) -> int:
    """The smallest 1, 2 or 5 times a power of ten that covers ``peak`` in at most ``ticks`` steps."""
    magnitude = 1
    while True:
        for m in (1, 2, 5):
            if m * magnitude * ticks >= peak:
                return m * magnitude
        magnitude *= 10


def svg_bars(title: str, labels: Sequence[str], series: Sequence[tuple[str, Sequence[int]]], *,
             sublabels: dict[int, str] | None = None, width: int = 720, plot_h: int = 180) -> str:
    """A grouped bar chart: one group per label, one bar per series.

    The layout is computed from the labels rather than fixed, because the
    charts are meant to be read as pictures (in the docs, in a mail): labels
    are drawn level when they fit under their group, thinned out when short
    but crowded, and slanted only when long, with the margins grown so that
    nothing is clipped. ``sublabels`` (group index -> text) is a second row
    under the labels, e.g. the date where a day starts under hour labels.
    The legend sits on the title's row, away from the labels.
    """
    e = html.escape
    sublabels = sublabels or {}
    peak = max([0, *(v for _n, vals in series for v in vals)])
    step = nice_step(max(1, peak))
    y_max = step * max(1, -(-peak // step))
    left = max(40.0, _text_w(str(y_max)) + 12)
    right, top = 12.0, 34.0
    n = max(1, len(labels))
    plot_w = width - left - right
    group_w = plot_w / n
    shown = [lab if len(lab) <= MAX_LABEL else lab[:MAX_LABEL - 1] + "\u2026" for lab in labels]
    widest = max([0.0, *(_text_w(lab) for lab in shown)])
    slant = widest > 3 * group_w  # would need more than every third label dropped: slant instead
    if slant:
        every = max(1, -(-n // 24))
        cos, sin = 0.819, 0.574  # 35 degrees
        first_w = _text_w(shown[0]) if shown else 0.0
        left = max(left, first_w * cos - group_w / 2 + 8)
        plot_w = width - left - right
        group_w = plot_w / n
        label_band = widest * sin + 16
    else:
        every = max(1, -(-int(widest + 8) // max(1, int(group_w))))
        label_band = 18.0
    sub_band = 16.0 if sublabels else 0.0
    height = int(top + plot_h + label_band + sub_band + 6)
    base = top + plot_h
    bar_w = max(1.0, group_w * 0.8 / max(1, len(series)))
    show_values = n <= 12
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{e(title)}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="#fff"/>',
             f'<text x="10" y="16" font-size="13" font-weight="bold">{e(title)}</text>']
    if not any(v for _n, vals in series for v in vals):
        parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
                     f'fill="#888">no data</text>')
    for y_val in range(0, y_max + 1, step):
        y = base - plot_h * y_val / y_max
        if y_val:
            parts.append(f'<line x1="{left:.1f}" y1="{y:.1f}" x2="{left + plot_w:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{left - 5:.1f}" y="{y + 4:.1f}" text-anchor="end">{y_val}</text>')
    for g, label in enumerate(labels):
        x0 = left + g * group_w + group_w * 0.1
        cx = left + g * group_w + group_w / 2
        for s, (name, vals) in enumerate(series):
            h = plot_h * vals[g] / y_max
            x = x0 + s * bar_w
            parts.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                         f'fill="{COLORS[s % len(COLORS)]}"><title>{e(name)} {e(label)}: {vals[g]}</title></rect>')
            if show_values and vals[g]:
                parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{base - h - 3:.1f}" text-anchor="middle" '
                             f'font-size="10" fill="#444">{vals[g]}</text>')
        if g % every == 0:
            if slant:
                parts.append(f'<text x="{cx:.1f}" y="{base + 14}" text-anchor="end" '
                             f'transform="rotate(-35 {cx:.1f} {base + 14})">{e(shown[g])}</text>')
            else:
                parts.append(f'<text x="{cx:.1f}" y="{base + 14}" text-anchor="middle">{e(shown[g])}</text>')
        if g in sublabels and not _crowded(g, sublabels, group_w):
            gx = left + g * group_w
            parts.append(f'<line x1="{gx:.1f}" y1="{base}" x2="{gx:.1f}" y2="{base + label_band + 2:.1f}" '
                         f'stroke="#999"/>'
                         f'<text x="{min(gx + 3, width - right - _text_w(sublabels[g])):.1f}" '
                         f'y="{base + label_band + 12:.1f}">{e(sublabels[g])}</text>')
    parts.append(f'<line x1="{left:.1f}" y1="{base}" x2="{left + plot_w:.1f}" y2="{base}" stroke="#333"/>')
    x = width - right
    for s, (name, _vals) in reversed(list(enumerate(series))):
        x -= _text_w(name) + 26
        parts.append(f'<rect x="{x:.1f}" y="7" width="10" height="10" fill="{COLORS[s % len(COLORS)]}"/>'
                     f'<text x="{x + 14:.1f}" y="16">{e(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _crowded(g: int, sublabels: dict[int, str], group_w: float) -> bool:
    """Whether sublabel ``g`` would run into the next one (a first day with
    only an hour or two of mail): the later one, a whole day, is kept."""
    later = [h for h in sublabels if h > g]
    return bool(later) and (min(later) - g) * group_w < _text_w(sublabels[g]) + 6


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


def render_html(f: Figures) -> str:
    t = f.totals
    labels, days, received, delivered = hourly(f.per_hour)
    per_day = bool(f.per_hour) and f.per_hour[-1][0] - f.per_hour[0][0] > 14 * DAY_MS
    volume = svg_bars("Volume per day (UTC)" if per_day else "Volume per hour (UTC)", labels,
                      [("received", received), ("delivered", delivered)], sublabels=days)
    latency = svg_bars("Delivery latency (recipients)", LATENCY_LABELS, [("delivered", f.latency_hist)])
    # Domains where something went wrong, worst first; the fully delivered ones would be empty groups.
    troubled = [d for d in f.domains if d.deferred or d.bounced or d.expired]
    deferring = sorted(troubled, key=lambda d: (-d.deferred, -d.bounced - d.expired, d.domain))[:15]
    deferrals = svg_bars("Deferrals by domain (recipient attempts)", [d.domain for d in deferring],
                         [("deferred", [d.deferred for d in deferring]), ("bounced", [d.bounced for d in deferring]),
                          ("expired", [d.expired for d in deferring])])
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
