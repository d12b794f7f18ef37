"""The log line formatter (mta/observe/logline.py): logfmt that reads back, JSON that parses, nothing raw."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from logfmt import parse_kv

from mta.observe.logline import JsonFormatter, LogEvent, TextFormatter, escape, event, install

CONTROL_CHARS = {chr(c) for c in (*range(0x20), 0x7F)}


def record(msg: object, args: tuple[object, ...] = ()) -> logging.LogRecord:
    return logging.LogRecord("mta.test", logging.INFO, __file__, 1, msg, args, None)


@given(st.text())
def test_any_value_reads_back_from_logfmt_and_json_and_nothing_raw_is_written(value: str) -> None:
    ev = LogEvent("reject", "1000001A4", {"arg": value, "n": 3})
    text = TextFormatter().format(record(ev))
    assert not CONTROL_CHARS & set(text) and "\n" not in text
    assert all(c.isprintable() for c in text)
    parsed = parse_kv(text.split(" INFO ", 1)[1])
    assert (parsed["event"], parsed["qid"], parsed["n"]) == ("reject", "1000001A4", "3")
    assert parsed["arg"] == escape(value)  # printable text as it was; the rest as escapes
    if value.isprintable():
        assert parsed["arg"] == value
    line = JsonFormatter().format(record(ev))
    assert line.isascii() and not CONTROL_CHARS & set(line)
    assert json.loads(line)["arg"] == value


def test_values_are_quoted_only_when_they_must_be() -> None:
    ev = LogEvent("x", None, {"a": "plain", "b": "two words", "c": "k=v", "d": 'say "hi"', "e": "", "f": "a\\b",
                              "g": 1.5, "h": True, "i": ["A", "B"], "from_": "<s@x>", "j": None})
    assert str(ev) == 'event=x a=plain b="two words" c="k=v" d="say \\"hi\\"" e="" f="a\\\\b" g=1.50 h=yes ' \
                      "i=A,B from=<s@x>"
    as_json = json.loads(JsonFormatter().format(record(ev)))
    assert {k: as_json[k] for k in ("g", "h", "i", "from")} == {"g": 1.5, "h": True, "i": ["A", "B"],
                                                                 "from": "<s@x>"}
    assert "j" not in as_json and "qid" not in as_json


def test_a_field_may_not_take_a_name_the_line_uses() -> None:
    with pytest.raises(ValueError, match="reserved"):
        LogEvent("x", None, {"pid": 1})


def test_plain_messages_are_escaped_and_a_traceback_follows_in_text_and_is_a_field_in_json() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        rec = logging.LogRecord("mta", logging.ERROR, __file__, 1, "from %s: %s", ("peer", "a\x1b[2Jb\r\nX"),
                                (type(exc), exc, exc.__traceback__))
    text = TextFormatter().format(rec)
    first, *rest = text.split("\n")
    assert first.endswith(f" mta[{rec.process}] ERROR from peer: a\\x1b[2Jb\\r\\nX")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "RuntimeError: boom"
    as_json = json.loads(JsonFormatter().format(rec))
    assert as_json["msg"] == "from peer: a\x1b[2Jb\r\nX" and "RuntimeError: boom" in as_json["exc"]
    assert (as_json["level"], as_json["logger"], as_json["pid"]) == ("error", "mta", rec.process)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_install_writes_one_format_once_even_when_called_again(fmt: str) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out = io.StringIO()
    try:
        install("info", fmt, io.StringIO())
        install("info", fmt, out)  # replaces, does not add: a line is written once
        event(logging.getLogger("mta.test"), "accepted", "1A", size=3)
        logging.getLogger("mta.test").debug("below the level")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    (line,) = out.getvalue().splitlines()
    if fmt == "json":
        assert {k: v for k, v in json.loads(line).items() if k in ("event", "qid", "size")} == \
            {"event": "accepted", "qid": "1A", "size": 3}
    else:
        assert line.endswith(f" mta.test[{os.getpid()}] INFO event=accepted qid=1A size=3")
    with pytest.raises(ValueError, match="text, json"):
        install("info", "xml")
