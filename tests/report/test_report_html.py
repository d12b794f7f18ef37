"""The report page without Spark: the volume chart's axis, and the charts as the page holds them."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import report_reference as ref

from mta.report.charts import CSS_CLASS, Series, bar_chart, svg_elements
from mta.report.figures import LATENCY_LABELS, Figures
from mta.report.html_page import DAY_MS, HOUR_MS, NO_FAVICON, hourly, render_html

T = 1_700_000_000_000 - 1_700_000_000_000 % DAY_MS  # a midnight, UTC
NS = "{http://www.w3.org/2000/svg}"


def texts(svg: str) -> list[str]:
    return [t.text or "" for t in ET.fromstring(svg).iter(f"{NS}text")]


def test_every_hour_is_on_the_axis_quiet_ones_as_zero() -> None:
    labels, days, received, delivered = hourly(((T - HOUR_MS, 3, 1), (T + 2 * HOUR_MS, 4, 6)))
    assert labels == ["23", "00", "01", "02"]
    assert received == [3, 0, 0, 4] and delivered == [1, 0, 0, 6]
    assert days == {0: "2023-11-13", 1: "2023-11-14"}


def test_a_long_period_is_drawn_per_day() -> None:
    rows = tuple((T + h * HOUR_MS, 1, 2) for h in range(0, 20 * 24, 5))
    labels, days, received, delivered = hourly(rows)
    assert len(labels) == 20 and labels[0] == "14"
    assert sum(received) == len(rows) and sum(delivered) == 2 * len(rows)
    assert days[0] == "2023-11" and days[17] == "2023-12"


@pytest.fixture(scope="module")
def figures(fleet: dict[str, str]) -> Figures:
    """The fleet's figures by the plain computation (the Spark job's equal, tested in test_report.py)."""
    return ref.figures(ref.plain_records(fleet))


def test_the_pages_charts_are_the_chart_modules_inline_svg_and_fetch_nothing(figures: Figures) -> None:
    page = render_html(figures)
    charts = list(svg_elements(page))
    assert len(charts) == 3 and all(f'class="{CSS_CLASS}"' in c.split(">", 1)[0] for c in charts)
    assert all(f'<style type="text/css">.{CSS_CLASS} *{{' in c for c in charts)  # matplotlib's rule, scoped
    # Made by mta.report.charts, byte for byte (the same data gives the same SVG).
    latency = bar_chart("Delivery latency (recipients)", LATENCY_LABELS, [Series("delivered", figures.latency_hist)])
    assert latency.svg("latency").rstrip() in charts
    deferrals = charts[2]
    down = next(d for d in figures.domains if d.domain == "down.example")
    assert f"<title>deferred down.example: {down.deferred}</title>" in deferrals  # a bar's tooltip
    # Inline and self-contained: no XML prolog in the page, every reference a fragment of the same chart,
    # no element that loads anything, and no URL but the two SVG namespace names.
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids)) > 100  # three charts in one page share no id
    for chart in charts:
        root = ET.fromstring(chart)
        own = {e.get("id") for e in root.iter()}
        refs = re.findall(r'(?:href="|url\()([^")]*)', chart)
        assert refs and all(r.startswith("#") and r[1:] in own for r in refs)
    # The one <link> is the empty icon, a data: URL that keeps browsers from asking for /favicon.ico.
    assert page.count("<link") == 1 and NO_FAVICON in page
    assert not re.search(r"<(?:image|script|iframe|object|embed|foreignObject)\b|@import|\bsrc=",
                         page.replace(NO_FAVICON, ""))
    urls = set(re.findall(r"[a-z][a-z0-9+.-]*://[^\s\"'<>)]*", page, flags=re.IGNORECASE))
    assert urls == {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
    assert all(f'xmlns="{u}"' in page or f'xmlns:xlink="{u}"' in page for u in urls)  # names, not fetched
