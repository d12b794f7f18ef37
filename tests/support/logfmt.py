"""Reading the relay's log lines back, for tests: logfmt (``key=value``) and JSON lines (mta.observe.logline)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

# key=value, the value bare or double-quoted with \\ and \" escaped (and other escapes left as written).
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)=("(?:[^"\\]|\\.)*"|[^\s"]*)')


def parse_kv(text: str) -> dict[str, str]:
    """The pairs of one event's message, values unquoted (``\\"`` and ``\\\\`` undone, other escapes kept)."""
    out: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _PAIR.match(text, pos)
        assert m, f"not logfmt at {pos}: {text!r}"
        key, value = m.group(1), m.group(2)
        if value.startswith('"'):
            value = re.sub(r'\\(["\\])', r"\1", value[1:-1])
        out[key] = value
        pos = m.end()
        while pos < len(text) and text[pos] == " ":
            pos += 1
    return out


def events(records: list[logging.LogRecord], name: str | None = None) -> list[dict[str, str]]:
    """The events among captured records (caplog.records), parsed; only those called ``name`` if given."""
    parsed = [parse_kv(r.getMessage()) for r in records if r.getMessage().startswith("event=")]
    return [p for p in parsed if name is None or p["event"] == name]


def text_events(lines: list[str], name: str | None = None) -> list[dict[str, str]]:
    """The events among lines of ``mta serve``'s stderr in the text format (``TIME LOGGER[PID] LEVEL event=...``)."""
    out = []
    for line in lines:
        _, sep, message = line.partition(" event=")
        if sep:
            p = parse_kv("event=" + message)
            if name is None or p["event"] == name:
                out.append(p)
    return out


def json_events(lines: list[str], name: str | None = None) -> list[dict[str, Any]]:
    """The events among JSON lines (every line must be one JSON object)."""
    parsed = [json.loads(line) for line in lines if line.strip()]
    return [p for p in parsed if "event" in p and (name is None or p["event"] == name)]
