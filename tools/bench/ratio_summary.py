"""The ratios against Postfix and the bare loop, each the median over recorded runs: a Markdown table and a chart.

    .venv/bin/python tools/bench/ratio_summary.py --relay run1.json run2.json run3.json \\
        --spool spool1.json spool2.json spool3.json [--svg docs/bench_ratios.svg]

``--relay``: JSON documents written by ``relay_vs_postfix.py --json`` (each run
holds cells of message size x sessions, every cell with its own A B pairs);
``--spool``: the last line of ``spool_bench.py --only append`` (one JSON
object). For every target figure the table gives the median over the
runs, each run's value, the target and whether the median meets it; the
chart draws the same medians as bars with each target as a tick. Nothing is
run here: the figures belong to the runs (their machine lines are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

Figure = tuple[str, Callable[[dict[str, Any]], float | None], float, bool]  # label, value of a run, target, higher?


def _cell(doc: dict[str, Any], size: int, sessions: int) -> dict[str, Any] | None:
    return next((c for c in doc.get("cells", []) if c["size"] == size and c["sessions"] == sessions), None)


def _ratio(size: int, sessions: int, key: str) -> Callable[[dict[str, Any]], float | None]:
    def get(doc: dict[str, Any]) -> float | None:
        cell = _cell(doc, size, sessions)
        return None if cell is None else cell["ratio"].get(key)
    return get


def _logspool(size: int, sessions: int, key: str) -> Callable[[dict[str, Any]], float | None]:
    def get(doc: dict[str, Any]) -> float | None:
        cell = _cell(doc, size, sessions)
        return None if cell is None else cell["logspool"]["median"].get(key)
    return get


RELAY: list[Figure] = [
    ("20 sessions, 4 KB: end-to-end msg/s, logspool/Postfix", _ratio(4096, 20, "e2e_per_s"), 2.5, True),
    ("100 sessions, 4 KB: end-to-end, logspool/Postfix", _ratio(4096, 100, "e2e_per_s"), 3.0, True),
    ("20 sessions, 100 KB: end-to-end, logspool/Postfix", _ratio(102400, 20, "e2e_per_s"), 1.5, True),
    ("1 session, 4 KB: end-to-end, logspool/Postfix", _ratio(4096, 1, "e2e_per_s"), 1.0, True),
    ("CPU per message, 20 sessions 4 KB, logspool/Postfix (Postfix = 1)", _ratio(4096, 20, "cpu_ms_per_msg"), 1.0,
     False),
    ("CPU per message, 1 session 4 KB, logspool/Postfix (Postfix = 1)", _ratio(4096, 1, "cpu_ms_per_msg"), 1.0, False),
    ("fsyncs per message, 20 sessions 4 KB (logspool)", _logspool(4096, 20, "fsync_per_msg"), 0.05, False),
]
SPOOL: list[Figure] = [
    ("batched durable appends / bare loop (wall)", lambda d: d.get("append_ratio"), 0.9, True),
    ("batched durable appends / bare loop (per CPU-second)", lambda d: d.get("append_ratio_cpu"), 0.9, True),
]


def summarize(figures: list[Figure], docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label, get, target, higher in figures:
        values = [v for v in (get(d) for d in docs) if v is not None]
        if not values:
            continue
        med = statistics.median(values)
        rows.append({"figure": label, "median": round(med, 3), "runs": [round(v, 3) for v in values],
                     "target": target, "higher_is_better": higher,
                     "met": med >= target if higher else med <= target})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| figure | median | runs | target | met? |", "| --- | ---: | --- | --- | --- |"]
    for r in rows:
        sign = ">=" if r["higher_is_better"] else "<="
        runs = ", ".join(f"{v:g}" for v in r["runs"])
        lines.append(f"| {r['figure']} | **{r['median']:g}** | {runs} | {sign} {r['target']:g} | "
                     f"{'yes' if r['met'] else '**no**'} |")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: str, title: str) -> str:
    """Each figure's median as a bar over its target (the tick), as an SVG file (matplotlib)."""
    try:
        import matplotlib

        from mta.report.charts import _RC, Chart
    except ImportError:
        return "not written: matplotlib is not installed (pip install -e '.[bench]')"
    drawn = Chart.new(9.0, 0.45 * len(rows) + 1.2, title)
    with matplotlib.rc_context(_RC):
        ax = drawn.figure.add_subplot()
        ys = list(range(len(rows)))[::-1]
        ratios = [r["median"] / r["target"] if r["higher_is_better"] else r["target"] / r["median"]
                  if r["median"] else 0.0 for r in rows]
        colors = ["#55a868" if r["met"] else "#c44e52" for r in rows]
        ax.barh(ys, ratios, color=colors, height=0.6)
        ax.axvline(1.0, color="#333", linewidth=1, linestyle="--")
        for y, r, q in zip(ys, rows, ratios, strict=True):
            ax.text(q + 0.02, y, f"{r['median']:g} (target {'≥' if r['higher_is_better'] else '≤'} "
                    f"{r['target']:g})", va="center", fontsize=7)
        ax.set_yticks(ys, [r["figure"] for r in rows])
        ax.set_xlabel("median / target (lower-is-better figures: target / median); 1 = met")
        ax.set_xlim(0, max([1.3, *ratios]) * 1.45)
        drawn.figure.suptitle(title, fontsize=9, fontweight="bold")
    drawn.write(path)
    return "written"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--relay", nargs="*", default=[], help="relay_vs_postfix.py --json documents")
    ap.add_argument("--spool", nargs="*", default=[], help="spool_bench.py JSON lines (the last line of a run)")
    ap.add_argument("--svg", default="", help="write the chart here")
    ap.add_argument("--title", default="logspool against its targets (medians of the runs)")
    args = ap.parse_args()
    relay_docs, spool_docs = [], []
    for path in args.relay:
        with open(path, encoding="utf-8") as f:
            relay_docs.append(json.load(f))
    for path in args.spool:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
            spool_docs.append(json.loads(lines[-1]))
    for d in relay_docs:
        print(f"relay run {d.get('date')}: {json.dumps(d.get('machine'))}")
    for d in spool_docs:
        print(f"spool run: {json.dumps(d.get('machine'))}")
    rows = summarize(RELAY, relay_docs) + summarize(SPOOL, spool_docs)
    print(markdown(rows))
    if args.svg and rows:
        print(f"chart {chart(rows, args.svg, args.title)}: {args.svg}", file=sys.stderr)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
