"""Charts as SVG text, drawn by matplotlib: the report page's and the benchmarks'.

Why matplotlib rather than SVG written by hand: the project had two SVG
writers (the report's and the relay benchmark's fallback), each with its own
axis scaling, label layout and escaping, and every new chart would have
needed a third. matplotlib does the layout (``constrained`` layout keeps
slanted or long labels inside the picture, ``MaxNLocator`` finds round
ticks), is maintained, and its SVG backend needs no display. This module is
the one place that knows how we use it; callers get a :class:`Chart` and ask
for its SVG text or write it to a file.

What the SVG text is, and why:

- the same text inline in the report page and as a file in docs/ (the docs
  show a page's charts as pictures), so it has no XML declaration or DOCTYPE
  and no metadata (matplotlib's names outside URLs, and a date that would
  change the file on every run);
- text stays text (``svg.fonttype = none``): labels are searchable and the
  file is small; the browser draws them in a sans-serif font;
- the ``<svg>`` element has the class ``logspool-chart`` and, when the
  chart has a title, an accessible name (``role="img"``, ``aria-label``);
- every ``id`` starts with the chart's own prefix, so three charts inline in
  one page never share an id, and references (``url(#...)``,
  ``xlink:href="#..."``) point only inside the chart: the page fetches
  nothing from anywhere; matplotlib's one style rule is scoped to the chart,
  so inline it styles nothing else on the page;
- ids are salted with a fixed string, so the same data gives the same bytes
  (a chart in docs/ changes only when what it shows changes);
- a bar can carry a tooltip (an SVG ``<title>``), in the manner of
  matplotlib's own "SVG tooltip" example: the bar gets a ``gid`` and the
  title is put in its group.

matplotlib is imported with this module: it is a dependency of the
``spark`` extra (the report) and of ``bench``, never of the relay.

Raises ImportError on import when matplotlib is not installed.
"""

from __future__ import annotations

import html
import io
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

CSS_CLASS = "logspool-chart"  # on every <svg> made here: the report page's style and the tests find them by it
COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f")
MAX_LABEL = 32  # longer labels (domains) are cut, with an ellipsis; the bar's tooltip has the whole
WIDTH_IN = 7.5  # 720 px in a browser (SVG sizes are in points: 72 per inch, 96 px per inch)
FONT_PT = 8.0
_CHAR_PT = 0.62 * FONT_PT  # a generous average advance of a sans-serif character, for layout decisions
_RC: dict[Any, Any] = {"svg.fonttype": "none", "svg.hashsalt": "logspool-chart", "font.size": FONT_PT}
_TAG = re.compile(r"<[^<>]+>")  # a tag, never text (matplotlib writes < in text as &lt;)
_ID_OR_REF = re.compile(r'(\sid="|url\(#|href="#)')


@attrs.frozen
class Series:
    """One bar per group: the values in the labels' order, and how the bars look."""

    name: str
    values: Sequence[float]
    color: str | None = None  # default: COLORS by position
    alpha: float = 1.0


@attrs.define
class Chart:
    """A matplotlib figure and the tooltips of its bars (gid -> text).

    Make one with :func:`bar_chart`, or with :meth:`new` and draw on
    ``chart.figure`` with matplotlib's own API (the benchmarks' line plots).
    """

    figure: Figure
    tooltips: dict[str, str] = attrs.Factory(dict)
    title: str = ""  # the picture's accessible name

    @classmethod
    def new(cls, width_in: float = WIDTH_IN, height_in: float = 3.0, title: str = "") -> Chart:
        with matplotlib.rc_context(_RC):
            return cls(Figure(figsize=(width_in, height_in), layout="constrained"), title=title)

    def svg(self, ids: str) -> str:
        """The chart as an ``<svg>`` element; every id in it starts with ``ids`` (a letter first)."""
        if not re.fullmatch(r"[A-Za-z][\w-]*", ids):
            raise ValueError(f"not an id prefix: {ids!r}")
        buf = io.StringIO()
        with matplotlib.rc_context(_RC):
            self.figure.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None,
                                                             "Type": None})
        text = buf.getvalue()
        text = text[text.index("<svg"):]
        label = f' aria-label="{html.escape(self.title)}"' if self.title else ""
        text = text.replace("<svg ", f'<svg class="{CSS_CLASS}" role="img"{label} ', 1)
        for gid, tip in self.tooltips.items():
            group = f'<g id="{gid}">'
            if group in text:
                text = text.replace(group, f"{group}\n<title>{html.escape(tip)}</title>", 1)
        text = text.replace("<style type=\"text/css\">*{", f'<style type="text/css">.{CSS_CLASS} *{{', 1)
        text = _TAG.sub(lambda tag: _ID_OR_REF.sub(lambda m: f"{m.group(1)}{ids}-", tag.group(0)), text)
        return text.rstrip() + "\n"

    def write(self, path: str) -> None:
        """The chart as an SVG file (ids prefixed with the file's name)."""
        stem = re.sub(r"[^A-Za-z0-9]+", "-", os.path.splitext(os.path.basename(path))[0]).strip("-") or "chart"
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.svg(stem if stem[0].isalpha() else f"c{stem}"))


def _fmt_value(v: float) -> str:
    """A bar's value as a label: integers without a decimal point."""
    return str(int(v)) if float(v).is_integer() else f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"


def _cut(label: str) -> str:
    return label if len(label) <= MAX_LABEL else label[:MAX_LABEL - 1] + "\u2026"


def _text_pt(text: str) -> float:
    return max((len(line) for line in text.split("\n")), default=0) * _CHAR_PT


def bar_chart(title: str, labels: Sequence[str], series: Sequence[Series], *,
              sublabels: Mapping[int, str] | None = None, ylabel: str | None = None,
              values: bool | None = None, width_in: float = WIDTH_IN, height_in: float = 2.6,
              title_pt: float = 10.0) -> Chart:
    """A grouped bar chart: one group per label, one bar per series, a tooltip on every bar.

    Labels are read as pictures (in the docs, in a mail), so their layout
    follows their lengths: level when they fit under their group, thinned
    out when short but crowded, slanted only when long (then the picture
    grows to hold them). ``sublabels`` (group index -> text) is a second row
    under the labels, e.g. the date where a day starts under hour labels,
    drawn from a line at the group's left edge. The legend sits on the
    title's row. ``values`` writes each non-zero value on its bar (default:
    when there are at most 12 groups). The y axis is topped at a round tick.
    """
    sublabels = dict(sublabels or {})
    n = len(labels)
    shown = [_cut(lab) for lab in labels]
    widest = max([0.0, *(_text_pt(lab) for lab in shown)])
    group_pt = 0.85 * width_in * 72 / max(1, n)
    slant = widest > 3 * group_pt  # would need more than every third label dropped: slant instead
    if slant:
        every = max(1, -(-n // 24))
        height_in += widest * math.sin(math.radians(35)) / 72
    else:
        every = max(1, math.ceil((widest + 6) / group_pt)) if n else 1
    if sublabels:
        height_in += 0.2
    chart = Chart.new(width_in, height_in, title)
    with matplotlib.rc_context(_RC):
        _draw_bars(chart, title, shown, labels, series, values if values is not None else n <= 12)
        ax = chart.figure.axes[0]
        ax.set_xticks(range(0, n, every), shown[::every], rotation=35 if slant else 0,
                      ha="right" if slant else "center", rotation_mode="anchor" if slant else "default")
        ax.tick_params(axis="x", which="major", length=0)
        kept = [g for g in sorted(sublabels) if not _crowded(g, sublabels, group_pt)]
        if kept:
            ax.set_xticks([g - 0.5 for g in kept], [sublabels[g] for g in kept], minor=True, ha="left")
            ax.tick_params(axis="x", which="minor", length=2.2 * FONT_PT, color="#999", pad=1)
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.set_title(title, loc="left", fontsize=title_pt, fontweight="bold")
        if series:  # handles of their own: a series with no bars still has its colour in the legend
            handles = [Patch(color=ser.color or COLORS[s % len(COLORS)], alpha=ser.alpha, label=ser.name)
                       for s, ser in enumerate(series)]
            _legend(ax, handles, len(title) * 0.62 * title_pt, 0.9 * width_in * 72)
    return chart


def _draw_bars(chart: Chart, title: str, shown: Sequence[str], labels: Sequence[str], series: Sequence[Series],
               values: bool) -> None:
    ax = chart.figure.add_subplot()
    n = len(labels)
    bar_w = 0.8 / max(1, len(series))
    for s, ser in enumerate(series):
        xs = [g - 0.4 + bar_w * (s + 0.5) for g in range(n)]
        bars = ax.bar(xs, list(ser.values), bar_w, color=ser.color or COLORS[s % len(COLORS)], alpha=ser.alpha)
        for g, bar in enumerate(bars):
            gid = f"bar-{s}-{g}"
            bar.set_gid(gid)
            chart.tooltips[gid] = f"{ser.name} {labels[g]}: {_fmt_value(ser.values[g])}"
        if values and n:
            ax.bar_label(bars, [_fmt_value(v) if v else "" for v in ser.values], padding=2, fontsize=FONT_PT - 1,
                         color="#444")
    peak = max([0.0, *(float(v) for ser in series for v in ser.values)])
    ticks = MaxNLocator(nbins=5, steps=[1, 2, 5, 10], integer=True).tick_values(0, max(1.0, peak))
    ax.set_yticks(ticks)
    ax.set_ylim(0, ticks[-1] * (1.1 if values else 1.0))  # room for the value over the highest bar
    ax.set_xlim(-0.5, max(1, n) - 0.5)
    ax.yaxis.grid(True, color="#e4e4e4")
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    if not any(v for ser in series for v in ser.values):
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#888")


def _legend(ax: Axes, handles: Sequence[Patch], title_w: float, room: float) -> None:
    """The legend on the title's row, right-aligned, in one line or two; where
    the title leaves no room for it, under the plot (never over the bars)."""
    names = [str(h.get_label()) for h in handles]
    for ncols in sorted({len(names), -(-len(names) // 2)}, reverse=True):
        per = -(-len(names) // ncols)  # matplotlib fills the legend column by column
        width = sum(max(_text_pt(n) for n in names[c * per:(c + 1) * per]) + 3 * FONT_PT for c in range(ncols))
        if title_w + width < room:
            ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=ncols, frameon=False,
                      borderaxespad=0.3, handlelength=1.0, columnspacing=1.0)
            return
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=len(names), frameon=False,
              handlelength=1.0, columnspacing=1.0)


def _crowded(g: int, sublabels: Mapping[int, str], group_pt: float) -> bool:
    """Whether sublabel ``g`` would run into the next one (a first day with
    only an hour or two of mail): the later one, a whole day, is kept."""
    later = [h for h in sublabels if h > g]
    return bool(later) and (min(later) - g) * group_pt < _text_pt(sublabels[g]) + 6


def svg_elements(page: str) -> Iterator[str]:
    """The ``<svg>`` elements of a page, in order (charts hold no nested ``<svg>``)."""
    yield from re.findall(r"<svg\b.*?</svg>", page, flags=re.DOTALL)
