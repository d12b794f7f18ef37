"""docs/benchmarks.md holds the current figures and how to reproduce them; detail lives in docs/bench_*.md."""

from __future__ import annotations

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

MAX_LINES = 600


def test_benchmarks_md_is_at_most_600_lines() -> None:
    lines = (DOCS / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, \
        f"docs/benchmarks.md has {len(lines)} lines; move detail into a docs/bench_*.md companion"


def test_benchmark_docs_relative_links_resolve() -> None:
    for page in [DOCS / "benchmarks.md", *sorted(DOCS.glob("bench_*.md"))]:
        for target in re.findall(r"\]\(([^)]+)\)", page.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):
                continue
            assert (page.parent / path).exists(), f"{page.name} links to missing {target}"
