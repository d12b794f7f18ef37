"""A page loaded in headless Chromium, as people see it: its console, its requests, a screenshot.

Debian's ``chromium`` is driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: JSON messages ending in NUL on descriptors 3
and 4), so nothing but the standard library is needed and no port is
opened. ``load_page`` records what a tester in the browser's developer
tools would look at: every console message and uncaught exception, every
log entry (a refused load, a blocked script), every request the page makes
and a full-page PNG, plus the boxes of the elements a CSS selector names.

Nothing leaves the machine even if a page tried: host names resolve only
for 127.0.0.1 (``--host-resolver-rules``), and the browser's own background
traffic (updates, safe browsing, sync) is switched off, so a recorded
request is the page's. Chromium runs in its own process group, which is
killed afterwards (crash-only, as everything here).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from typing import Any

import attrs

CHROMIUM_FLAGS = (
    "--headless",
    "--remote-debugging-pipe",
    "--no-sandbox",  # the tests run as root, where Chromium's sandbox will not start
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
    "--safebrowsing-disable-auto-update",
    "--metrics-recording-only",
    "--mute-audio",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
)


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@attrs.define
class PageLoad:
    """What one page load showed."""

    console: list[dict[str, Any]]  # Runtime.consoleAPICalled params (type, args)
    exceptions: list[dict[str, Any]]  # Runtime.exceptionThrown params
    log: list[dict[str, Any]]  # Log.entryAdded entries (level, source, text, url)
    requests: list[str]  # every URL the page requested, in order
    boxes: list[dict[str, float]]  # x, y, width, height of each element the selector named (CSS px, page coords)
    png: bytes  # the whole page

    def errors(self) -> list[str]:
        """Console errors and warnings, exceptions and error log entries, one line each."""
        lines = [f"console.{c['type']}: " + " ".join(str(a.get("value", a.get("description", ""))) for a in c["args"])
                 for c in self.console if c["type"] in ("error", "warning", "assert")]
        lines += [f"exception: {e['exceptionDetails'].get('text')} "
                  f"{e['exceptionDetails'].get('exception', {}).get('description', '')}" for e in self.exceptions]
        lines += [f"log {e['level']} ({e['source']}): {e['text']} {e.get('url', '')}"
                  for e in self.log if e["level"] in ("error", "warning")]
        return lines


class Browser:
    """One headless Chromium, spoken to over the DevTools pipe."""

    def __init__(self, binary: str, profile: str, timeout: float = 120.0) -> None:
        self.timeout = timeout
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Above 9, so that the shell's 3<& and 4>& never overwrite one of them with the other (bash, since
        # dash takes single-digit descriptors only).
        for fd in (to_child_r, from_child_w):
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            os.close(fd)
            if fd == to_child_r:
                to_child_r = high
            else:
                from_child_w = high
        # The child's descriptors 3 and 4, as --remote-debugging-pipe wants them; through the shell so no
        # Python runs between fork and exec.
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", f'exec "$0" "$@" 3<&{to_child_r} 4>&{from_child_w}', binary, *CHROMIUM_FLAGS,
             f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._next_id = 0
        self._lock = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self._closed = False
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr.append(raw.decode("utf-8", "replace"))

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                break
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self._lock:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                self._lock.notify_all()
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """One command; its result. RuntimeError on a protocol error, AssertionError if no reply comes."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
        msg: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            self.proc.wait(timeout=self.timeout)
            raise AssertionError(f"Chromium exited ({self.proc.returncode}) before {method}: "
                                 + "".join(self.stderr[-20:])) from None
        with self._lock:
            if not self._lock.wait_for(lambda: ident in self._replies or self._closed, self.timeout):
                raise AssertionError(f"no reply to {method} in {self.timeout:.0f} s")
            if ident not in self._replies:
                raise AssertionError(f"Chromium ended during {method}: {''.join(self.stderr[-20:])}")
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})  # type: ignore[no-any-return]

    def wait_event(self, method: str, session: str) -> dict[str, Any]:
        """The first event ``method`` of ``session`` (it may have come already)."""
        def find() -> dict[str, Any] | None:
            return next((e for e in self.events if e["method"] == method and e.get("sessionId") == session), None)

        with self._lock:
            if not self._lock.wait_for(lambda: find() is not None or self._closed, self.timeout):
                raise AssertionError(f"no {method} in {self.timeout:.0f} s")
            event = find()
        if event is None:
            raise AssertionError(f"Chromium ended before {method}: {''.join(self.stderr[-20:])}")
        return event

    def load(self, url: str, selector: str = "svg", width: int = 1200) -> PageLoad:
        """Open ``url`` in a new tab, wait for its load event, and record what :class:`PageLoad` holds."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session)
        with self._lock:
            start = len(self.events)
        self.send("Page.navigate", {"url": url}, session)
        self.wait_event("Page.loadEventFired", session)
        measure = (f"JSON.stringify({{h: document.documentElement.scrollHeight, boxes: "
                   f"[...document.querySelectorAll({json.dumps(selector)})].map(e => {{"
                   f"const r = e.getBoundingClientRect(); return {{x: r.left + scrollX, y: r.top + scrollY, "
                   f"width: r.width, height: r.height}}; }})}})")
        found = json.loads(self.send("Runtime.evaluate", {"expression": measure, "returnByValue": True},
                                     session)["result"]["value"])
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": int(found["h"]), "deviceScaleFactor": 1, "mobile": False}, session)
        png = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"}, session)["data"])
        with self._lock:
            events = [e for e in self.events[start:] if e.get("sessionId") == session]
        # Messages logged before the navigation (about:blank) are not the page's.
        return PageLoad(
            console=[e["params"] for e in events if e["method"] == "Runtime.consoleAPICalled"],
            exceptions=[e["params"] for e in events if e["method"] == "Runtime.exceptionThrown"],
            log=[e["params"]["entry"] for e in events if e["method"] == "Log.entryAdded"],
            requests=[e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"],
            boxes=found["boxes"],
            png=png,
        )

    def kill(self) -> None:
        """SIGKILL to Chromium's process group (its renderers and helpers), then reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        os.close(self._to_child)


def screenshot(url: str, png_path: str, width: int = 1200) -> PageLoad:
    """Load ``url`` once and write its full-page screenshot to ``png_path`` (tools/example_report.py)."""
    binary = chromium_binary()
    if binary is None:
        raise SystemExit("chromium not found (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        browser = Browser(binary, profile)
        try:
            page = browser.load(url, width=width)
        finally:
            browser.kill()
    with open(png_path, "wb") as f:
        f.write(page.png)
    return page
