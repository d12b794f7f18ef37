"""The report's read against the plain reader, per core, and the whole report's time: a PNG chart.

    .venv/bin/python tools/bench/report_chart.py base=/tmp/base.json new=/tmp/new.json --png docs/bench_report.png

Each ``LABEL=FILE`` is the JSON line that ``report_bench.py --stage decode``
prints last (a file holding its output: the last line that starts with ``{``
is read). Left: for each Spark configuration, the median over the run's
pairs of (Spark's records/s ÷ the plain reader's in the same pair) ÷ the
configuration's cores, beside the same ratio per CPU-second (records per
CPU-second of every Spark process ÷ the plain reader's; a pair whose
Spark CPU came out not positive is left out of it), with the issue's
target of 0.9 as a line. Right: the whole report's wall time, each Spark
configuration's beside plain Python's (``python`` in ``--configs``). Every
label is drawn side by side, so a chart compares code trees measured on the
same fleet. The printed table is what docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

TARGET_PER_CORE = 0.9
CORES = {"local[1]": 1, "local[2]": 2, "cluster": 2}  # the cluster of report_bench.py: one worker, 2 cores


def load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"report_chart: no JSON line in {path} (report_bench.py prints one last)")
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


def figures(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per configuration of a report_bench.py run."""
    rows = []
    for r in doc["results"]:
        if r["config"] == "python":
            rows.append({"config": "python", "report_s": r["report_s"]})
            continue
        cores = CORES.get(r["config"], 2)
        pairs = r["pairs"]
        wall = [p["spark_rps"] / p["plain_rps"] / cores for p in pairs]
        # A pair whose Spark CPU is not positive lost a process's time (one reaped by a parent outside the
        # tree report_bench.py sums): no figure, rather than a wrong one.
        cpu = [p["plain_cpu_s"] / p["spark_cpu_s"] for p in pairs if p["spark_cpu_s"] > 0] or [0.0]
        rows.append({"config": r["config"], "cores": cores, "per_core_wall": statistics.median(wall),
                     "per_core_wall_pairs": wall, "per_cpu_second": statistics.median(cpu),
                     "per_cpu_second_pairs": cpu, "report_s": r.get("report_s"),
                     "load": statistics.median(p["load_avg_1m"] for p in pairs)})
    return rows


def chart(runs: dict[str, list[dict[str, Any]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(runs)
    configs = [c for c in ("local[2]", "cluster") if any(r["config"] == c for rows in runs.values() for r in rows)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    width = 0.8 / max(1, 2 * len(labels))
    for i, label in enumerate(labels):
        by = {r["config"]: r for r in runs[label]}
        for j, (key, hatch) in enumerate((("per_core_wall", ""), ("per_cpu_second", "//"))):
            xs = [k + (2 * i + j) * width for k in range(len(configs))]
            ys = [by[c][key] if c in by else 0.0 for c in configs]
            bars = left.bar(xs, ys, width, hatch=hatch, color=f"C{i}", edgecolor="white",
                            label=f"{label}: {'wall, per core' if j == 0 else 'per CPU-second'}")
            left.bar_label(bars, fmt="%.2f", fontsize=7)
    left.axhline(TARGET_PER_CORE, color="#333", linestyle="--", linewidth=1)
    left.set_xticks([k + width * (len(labels) - 0.5) for k in range(len(configs))], configs)
    left.set_ylabel("Spark ÷ plain reader")
    left.set_title(f"decode stage (target ≥ {TARGET_PER_CORE})", fontsize=9)
    left.legend(fontsize=6, loc="lower right")
    names = ["python", *configs]
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        by = {r["config"]: r for r in runs[label]}
        xs = [k + i * width for k in range(len(names))]
        got = [by[c]["report_s"] if c in by else None for c in names]
        bars = right.bar(xs, [v or 0.0 for v in got], width, color=f"C{i}", label=label)
        right.bar_label(bars, labels=["not run" if v is None else f"{v:.0f}" for v in got], fontsize=7)
    right.set_xticks([k + width * (len(labels) - 1) / 2 for k in range(len(names))], names)
    right.set_ylabel("whole report, s")
    right.set_title("10-relay fleet, whole report (wall)", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9, fontweight="bold")
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=report_bench.py output (a label given twice: both runs)")
    ap.add_argument("--png", default="", help="write the chart here")
    ap.add_argument("--title", default="The report on a fleet: Spark against the plain reader")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    for spec in args.runs:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"report_chart: {spec!r} is not LABEL=FILE")
        runs.setdefault(label, []).extend(figures(load(path)))  # a label may name several runs
    print("| run | config | per core, wall (pairs) | per CPU-second (pairs) | whole report, s |")
    print("| --- | --- | --- | --- | ---: |")
    for label, rows in runs.items():
        for r in rows:
            if r["config"] == "python":
                print(f"| {label} | python | – | – | {r['report_s']:.1f} |")
                continue
            wall = ", ".join(f"{v:.2f}" for v in r["per_core_wall_pairs"])
            cpu = ", ".join(f"{v:.2f}" for v in r["per_cpu_second_pairs"])
            rep = f"{r['report_s']:.1f}" if r["report_s"] else "–"
            print(f"| {label} | {r['config']} | **{r['per_core_wall']:.2f}** ({wall}) | "
                  f"**{r['per_cpu_second']:.2f}** ({cpu}) | {rep} |")
    if args.png:
        chart(runs, args.png, args.title)
        print(f"chart written: {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
