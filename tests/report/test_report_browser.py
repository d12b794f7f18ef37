"""The HTML report as people see it: loaded in headless Chromium (Debian's package) from a
loopback HTTP server, it logs no error, requests nothing but itself, and its charts are drawn.

The page is the one ``mta report`` writes (``render_html``) for the test fleet's figures, computed
without Spark (test_report.py shows the Spark job computes the same). A first test loads a page
that does everything the report must not (a console error, an exception, an image from outside)
and checks that the harness sees each: the report's test could fail.
"""

from __future__ import annotations

import functools
import http.server
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import report_reference as ref
from headless_chromium import Browser, PageLoad, chromium_binary
from PIL import Image

from mta.report.charts import COLORS
from mta.report.html_page import render_html

pytestmark = pytest.mark.slow

WIDTH = 1200


class Site:
    """A loopback HTTP server over one directory that records every path asked of it."""

    def __init__(self, directory: str) -> None:
        self.paths: list[str] = []
        site = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                site.paths.append(self.path)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(Handler, directory=directory))
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(name="site")
def site_fixture(tmp_path: Any) -> Iterator[Site]:
    site = Site(str(tmp_path))
    yield site
    site.server.shutdown()
    site.server.server_close()


@pytest.fixture(name="browser", scope="module")
def browser_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    binary = chromium_binary()
    assert binary, "chromium is not installed: make sysdeps (Debian's chromium package)"
    browser = Browser(binary, str(tmp_path_factory.mktemp("chromium-profile")))
    yield browser
    browser.kill()


def coloured(png: bytes, box: dict[str, float], color: str, tolerance: int = 24) -> int:
    """Pixels within ``tolerance`` (per channel) of ``color`` inside ``box`` of the screenshot."""
    want = tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))
    image = Image.open(io.BytesIO(png)).convert("RGB")
    left, top = int(box["x"]), int(box["y"])
    region = image.crop((left, top, left + int(box["width"]), top + int(box["height"])))
    total = 0
    for n, px in region.getcolors(maxcolors=1 << 20) or []:
        assert isinstance(px, tuple)
        if all(abs(a - b) <= tolerance for a, b in zip(px, want)):
            total += n
    return total


def test_the_harness_sees_what_a_bad_page_does(browser: Browser, site: Site, tmp_path: Any) -> None:
    (tmp_path / "bad.html").write_text(
        '<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body>'
        '<script>console.error("drawn wrong"); null.x;</script><img src="http://cdn.example/logo.png">'
        f'<svg width="200" height="100"><rect width="200" height="100" fill="{COLORS[0]}"/></svg>'
        "</body></html>")
    page = browser.load(f"{site.url}/bad.html")
    errors = page.errors()
    assert "console.error: drawn wrong" in errors
    assert any(e.startswith("exception: Uncaught") and "null" in e for e in errors), errors
    assert "http://cdn.example/logo.png" in page.requests  # asked for, and not resolved: nothing left the machine
    assert any("ERR_NAME_NOT_RESOLVED" in e for e in errors), errors
    assert site.paths == ["/bad.html"]
    assert coloured(page.png, page.boxes[0], COLORS[0]) == 200 * 100


def test_the_report_page_loads_clean_and_its_charts_are_visible(browser: Browser, site: Site, tmp_path: Any,
                                                                fleet: dict[str, str]) -> None:
    figures = ref.figures(ref.plain_records(fleet))
    (tmp_path / "report.html").write_text(render_html(figures), encoding="utf-8")
    url = f"{site.url}/report.html"
    page: PageLoad = browser.load(url, width=WIDTH)
    with open(os.path.join(tmp_path, "screenshot.png"), "wb") as f:  # for whoever looks at a failure
        f.write(page.png)
    assert page.errors() == []
    assert page.requests == [url] and site.paths == ["/report.html"]  # no favicon, font, script or image
    image = Image.open(io.BytesIO(page.png))
    assert image.width == WIDTH and image.height >= max(b["y"] + b["height"] for b in page.boxes)
    volume, latency, deferrals = page.boxes
    for box in page.boxes:  # each chart laid out at a readable size, inside the page's width
        assert 600 <= box["width"] <= WIDTH and box["height"] >= 200, box
    # Each chart's bars are on screen, in their series' colours: received and delivered per hour,
    # delivered by latency, deferred, bounced and expired by domain.
    for box, series in ((volume, COLORS[:2]), (latency, COLORS[:1]), (deferrals, COLORS[:3])):
        for color in series:
            assert coloured(page.png, box, color) >= 100, (box, color)
    assert figures.totals["bounced"] and figures.totals["expired"]  # so the deferrals chart has those bars
