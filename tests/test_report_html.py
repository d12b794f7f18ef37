"""The report page's charts, without Spark: their axes and what they leave out."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from mta.report.html_page import DAY_MS, HOUR_MS, hourly, nice_step, svg_bars

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


def test_chart_is_well_formed_and_scaled_to_a_round_top() -> None:
    svg = svg_bars("Deferrals", ["a.example", "b.example"], [("deferred", [395, 12]), ("bounced", [0, 92])])
    root = ET.fromstring(svg)  # parses: the page and the docs' pictures are the same XML
    bars = [r for r in root.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]
    assert len(bars) == 4
    heights = {r.find(f"{NS}title").text: float(r.get("height", "0")) for r in bars}  # type: ignore[union-attr]
    # The default 180 px plot, topped at 400: heights in proportion to the values.
    assert abs(heights["deferred a.example: 395"] - 180 * 395 / 400) <= 0.051
    assert abs(heights["bounced b.example: 92"] - 180 * 92 / 400) <= 0.051 and heights["bounced a.example: 0"] == 0
    assert "400" in texts(svg) and "395" in texts(svg)  # y axis to 400 in steps of 100, values on the bars
    assert nice_step(395) == 100 and nice_step(7) == 2 and nice_step(0) == 1


def test_long_labels_are_cut_and_kept_whole_in_the_tooltip() -> None:
    name = "mail.a-very-long-subdomain-of-the-recipient.example.co.uk"
    svg = svg_bars("Deferrals", [name] * 10, [("deferred", list(range(1, 11)))])
    shown = [t for t in texts(svg) if t.startswith("mail.")]
    assert shown and all(len(t) <= 32 and t.endswith("\u2026") for t in shown)
    assert f"deferred {name}: 1" in svg
    assert all(float(x) >= 0 for x in re.findall(r' x="(-?[\d.]+)"', svg))  # nothing starts left of the picture


def test_an_empty_chart_says_so() -> None:
    svg = svg_bars("Volume per hour (UTC)", [], [("received", []), ("delivered", [])])
    assert "no data" in texts(svg)
