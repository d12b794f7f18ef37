"""Build the example input of docs/operations.md's "Delivery reports" section.

Why a script: the example report in the docs should come from segments the
real spool engine wrote, not from hand-made numbers, and anyone should be
able to make it again. It runs ``tests/support/spark_fixture.run_relay`` (the spool
engine over simulated time, with the tests' next hop answering per domain:
delivered, greylisted, slow, unknown user, down) for two relays, ``mx1`` and
``mx2``, with ``archive_dir`` so most of the history is in ``archive/``.

    .venv/bin/python tools/example_report.py DIR [--messages 300] [--hours 24]
    .venv/bin/mta report --input DIR/mx1 --input DIR/mx2 --out DIR/report --master 'local[2]'

It prints the ``mta report`` command to run and, with ``--svg DOCS``, instead
extracts the three charts of an existing ``report.html`` into
``DOCS/report_volume.svg``, ``report_latency.svg`` and ``report_deferrals.svg``;
with ``--screenshot PNG``, it loads the report's ``report.html`` in headless
Chromium (``tests/support/headless_chromium.py``, as the browser test does)
and saves the whole page as PNG (docs/report_screenshot.png).
"""

from __future__ import annotations

import argparse
import os
import sys

# The tests' shared helpers are top-level modules in tests/support/ (pyproject's pytest pythonpath).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))

from headless_chromium import screenshot
from spark_fixture import run_relay

from mta.report.charts import svg_elements

RELAYS = ("mx1", "mx2")
CHART_FILES = ("report_volume.svg", "report_latency.svg", "report_deferrals.svg")


def build(directory: str, messages: int, hours: float) -> list[str]:
    """Two relays' spools under ``directory``; returns their paths."""
    if os.path.exists(directory) and os.listdir(directory):
        raise SystemExit(f"example_report: {directory} is not empty (the spools would mix with old ones)")
    paths = []
    for seed, relay in enumerate(RELAYS, start=1):
        path = os.path.join(directory, relay)
        run_relay(path, seed, messages=messages, hours=hours)
        paths.append(path)
    return paths


def extract_charts(report_html: str, docs: str) -> list[str]:
    """Write each inline ``<svg>`` of the report page as its own file (the
    docs show them as images; GitHub renders an SVG file, not inline SVG)."""
    with open(report_html, encoding="utf-8") as f:
        page = f.read()
    charts = list(svg_elements(page))
    if len(charts) != len(CHART_FILES):
        raise SystemExit(f"example_report: {report_html} holds {len(charts)} charts, expected {len(CHART_FILES)}")
    written = []
    for name, svg in zip(CHART_FILES, charts):
        path = os.path.join(docs, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg.rstrip() + "\n")
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="empty directory for the spools (or, with --svg, the report's --out)")
    ap.add_argument("--messages", type=int, default=300, help="messages per relay")
    ap.add_argument("--hours", type=float, default=24.0, help="simulated hours of arrivals")
    ap.add_argument("--svg", metavar="DOCS", help="extract DIR/report.html's charts into DOCS instead")
    ap.add_argument("--screenshot", metavar="PNG", help="save DIR/report.html as headless Chromium shows it instead")
    args = ap.parse_args()
    if args.screenshot:
        page = screenshot("file://" + os.path.abspath(os.path.join(args.dir, "report.html")), args.screenshot,
                          width=860)
        if page.errors():
            raise SystemExit("example_report: the page logged: " + "; ".join(page.errors()))
        from PIL import Image  # matplotlib's dependency: 256 colours make the PNG a third of the size

        Image.open(args.screenshot).convert("RGB").quantize(256).save(args.screenshot, optimize=True)
        print(args.screenshot)
        return
    if args.svg:
        for path in extract_charts(os.path.join(args.dir, "report.html"), args.svg):
            print(path)
        return
    paths = build(args.dir, args.messages, args.hours)
    inputs = " ".join(f"--input {p}" for p in paths)
    print(f".venv/bin/mta report {inputs} --out {os.path.join(args.dir, 'report')} --master 'local[2]'")


if __name__ == "__main__":
    main()
