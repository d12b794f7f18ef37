"""The chart module (mta/report/charts.py, matplotlib) and every chart drawn through it:
the report page's bar charts and the benchmarks' charts."""

from __future__ import annotations

import json
import pathlib
import re
import sys
import xml.etree.ElementTree as ET
from typing import Any

from matplotlib.patches import Rectangle

from mta.report.charts import CSS_CLASS, MAX_LABEL, Series, bar_chart

NS = "{http://www.w3.org/2000/svg}"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def texts(svg: str) -> list[str]:
    return [t.text or "" for t in ET.fromstring(svg).iter(f"{NS}text")]


def test_bars_are_the_values_on_an_axis_topped_at_a_round_tick() -> None:
    chart = bar_chart("Deferrals", ["a.example", "b.example"], [Series("deferred", [395, 12]),
                                                                Series("bounced", [0, 92])])
    ax = chart.figure.axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert [b.get_height() for b in bars] == [395, 12, 0, 92] and len(bars) == len(ax.patches)
    assert list(ax.get_yticks()) == [0, 100, 200, 300, 400]  # y axis to 400 in steps of 100
    svg = chart.svg("d")
    assert ET.fromstring(svg).tag == f"{NS}svg"  # parses: the page and the docs' pictures are the same XML
    shown = texts(svg)
    assert {"400", "395", "92", "a.example", "Deferrals", "bounced"} <= set(shown)  # values on the bars
    assert "0" not in shown[shown.index("395"):]  # a zero bar gets no value written on it


def test_long_labels_are_cut_and_kept_whole_in_the_tooltip() -> None:
    name = "mail.a-very-long-subdomain-of-the-recipient.example.co.uk"
    chart = bar_chart("Deferrals", [name] * 10, [Series("deferred", list(range(1, 11)))])
    svg = chart.svg("d")
    shown = [t for t in texts(svg) if t.startswith("mail.")]
    assert shown and all(len(t) <= MAX_LABEL and t.endswith("\u2026") for t in shown)
    assert f"<title>deferred {name}: 1</title>" in svg
    width = chart.figure.bbox.width
    for label in chart.figure.axes[0].get_xticklabels():  # slanted, and still inside the picture
        box = label.get_window_extent()
        assert label.get_rotation() == 35 and box.x0 >= 0 and box.x1 <= width and box.y0 >= 0


def test_an_empty_chart_says_so() -> None:
    svg = bar_chart("Volume per hour (UTC)", [], [Series("received", []), Series("delivered", [])]).svg("v")
    assert "no data" in texts(svg) and "received" in texts(svg)


def test_no_svg_is_written_by_hand_outside_the_chart_module() -> None:
    """One SVG writer: the report page, the docs' pictures and the benchmarks' charts all go
    through mta/report/charts.py (matplotlib), so no other source builds SVG markup."""
    sources = [p for d in ("mta", "spool", "tools", "fault_injection") for p in (ROOT / d).rglob("*.py")]
    assert len(sources) > 50 and (ROOT / "mta" / "report" / "charts.py") in sources
    markup = re.compile(r"<(?:svg|rect|path|polyline|text|line|g)\s+[\w:-]+=")  # an SVG element with attributes
    writers = [str(p.relative_to(ROOT)) for p in sources
               if p.name != "charts.py" and markup.search(p.read_text(encoding="utf-8"))]
    assert writers == []


def _bench(name: str) -> Any:
    """A benchmark script of tools/bench/ as a module (they import their neighbours by name)."""
    bench = str(ROOT / "tools" / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return __import__(name)


def test_the_relay_benchmarks_chart_is_redrawn_from_a_recorded_run(tmp_path: Any) -> None:
    recorded = ROOT / "docs" / "bench_relay_p2.json"
    out = tmp_path / "relay.svg"
    assert _bench("relay_vs_postfix").main(["--chart-from", str(recorded), "--svg", str(out)]) == 0
    svg = out.read_text(encoding="utf-8")
    assert f'class="{CSS_CLASS}"' in svg.split(">", 1)[0]
    cell = json.loads(recorded.read_text(encoding="utf-8"))["cells"][0]
    shown = texts(svg)
    assert {"postfix accepted", "postfix end-to-end", "logspool accepted", "logspool end-to-end",
            "messages/s (median)"} <= set(shown)
    assert any(t.startswith("logspool vs Postfix 3.7.11, 2026-11-22") for t in shown)
    e2e = cell["logspool"]["median"]["e2e_per_s"]
    assert f"<title>logspool end-to-end 4 KB\n20 sess: {e2e:.3g}</title>" in svg


def test_the_backlog_benchmarks_charts_are_drawn_through_the_chart_module(tmp_path: Any) -> None:
    rec = {str(n): {"open_s": 0.01 * i + 0.01, "cpu_s": 0.005, "sync_s": 0.002, "vmhwm_mb": 40.0 + i,
                    "rss_base_mb": 38.0} for i, n in enumerate((1000, 10000))}
    rounds = {k: [{"accepted_mps": v + r} for r in range(2)] for k, v in (("empty", 900.0), ("backlog", 880.0))}
    result = {"recovery": rec, "backlog": 10000, "enqueuers": 4,
              "fairness": {"rounds": rounds, "share": 0.5, "ratio_per_round": [0.98, 0.97]}}
    written = _bench("backlog_bench").charts(result, str(tmp_path), "_t")
    assert [pathlib.Path(p).name for p in written] == ["bench_backlog_recovery_t.svg", "bench_backlog_fairness_t.svg"]
    for path in written:
        svg = pathlib.Path(path).read_text(encoding="utf-8")
        assert f'class="{CSS_CLASS}"' in svg.split(">", 1)[0] and not re.search(r"https?://(?!www\.w3\.org/)", svg)
    assert "Recovery time (median)" in texts(pathlib.Path(written[0]).read_text(encoding="utf-8"))
