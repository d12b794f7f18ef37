"""``mta serve`` writes its log in the configured format, every kind of line in one shape (docs/operations.md).

A subprocess relay (tests/support/log_scenario.py) makes each kind of line once; its
stderr is read as written: every line parses (key=value after the prefix, or
one JSON object), names its logger and process, holds no control character,
and every line about a message carries the message's queue id.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from log_scenario import KINDS, scenario

CONTROL_CHARS = {chr(c) for c in (*range(0x20), 0x7F)}
ABOUT_A_MESSAGE = {"accepted", "delivery", "bounce"}


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_every_kind_of_line_in_each_format(tmp_path: Path, fmt: str) -> None:
    serve = await scenario(tmp_path, fmt)
    for event, key, value in KINDS:
        assert any(p.get("event") == event and (not key or p.get(key) == value) for p in serve.parsed), \
            (event, key, value, serve.lines)
    for line, parsed in zip(serve.lines, serve.parsed, strict=True):
        assert not CONTROL_CHARS & set(line), line
        assert parsed["logger"].startswith(("mta", "spool")) and parsed["pid"] > 0 and parsed["ts"].endswith("Z")
        if parsed.get("event") in ABOUT_A_MESSAGE:
            assert parsed.get("qid"), line
    hostile = next(p for p in serve.parsed if p.get("reason") == "control_character")
    # Escaped in text (logfmt keeps the escape as written); in JSON the value is the real string again.
    assert hostile["arg"] == ("\\x1b[31mred" if fmt == "text" else "\x1b[31mred")
    # The scenario asks again while the message is being delivered (its retry runs every second): one line per
    # request (a refused one names the id as failed), and exactly one of them went through.
    (hold,) = [p for p in serve.parsed if p.get("event") == "admin" and p.get("command") == "hold"
               and not p.get("failed")]
    assert int(hold["uid"]) == __import__("os").getuid() and int(hold["peer_pid"]) > 0
    if fmt == "json":
        assert all(isinstance(p["pid"], int) and p["level"] in ("debug", "info", "warning", "error")
                   for p in serve.parsed)
