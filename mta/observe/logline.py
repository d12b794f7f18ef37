"""The relay's log lines: one line per event, key=value by default, JSON lines as an option.

Theory of operation
-------------------
Code that reports an event calls ``event(log, "reject", qid, client=..., reply=...)``.
The record's message is a ``LogEvent``: the event's name, the queue id of the
message it is about (if any) and its fields, in order. Nothing is rendered
until a handler formats the record, so a line below the configured level
costs one ``isEnabledFor``. Everything else logged through ``logging`` (start
and recovery lines, tracebacks) is a plain message and keeps its text.

``install`` (``mta serve``) puts one handler on the root logger whose
formatter writes either shape ([log] format):

- ``text``: ``2025-03-01T12:00:00.123Z mta.smtpd[4242] INFO event=reject
  client=192.0.2.7 command=RCPT ...``: a UTC timestamp, the logger and
  process (as Postfix's ``postfix/smtpd[4242]``), the level, then the
  message. An event's message is logfmt: ``key=value`` pairs, ``event``
  first, then ``qid``; a value with a space, ``=``, a quote or a backslash
  is double-quoted with ``\\"`` and ``\\\\`` escaped.
- ``json``: one JSON object per line, ``{"ts": ..., "level": ..., "logger":
  ..., "pid": ..., "event": ..., "qid": ..., <fields>}``; a plain message
  is ``"msg"`` (with ``event`` and ``qid`` when the record names them in
  its ``extra``, as recovery's lines do) and a traceback ``"exc"``. Non-ASCII is written ``\\uXXXX``.

Peer bytes never reach the log raw: in either shape every character that is
not printable (C0, DEL, C1, line and paragraph separators, bidi controls,
lone surrogates) is written escaped (``\\n``, ``\\x1b``, ``\\u202e``), so a
client cannot forge a line or rewrite the operator's terminal. In text, a
traceback still follows its line (our own code's, for a bug report).

A field value is a ``str``, ``int``, ``float`` (two decimals in text),
``bool`` (``yes``/``no`` in text), a sequence of those (comma-joined in text,
an array in JSON) or None (left out). A field named ``from_`` is written
``from`` (Python reserves the word).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any, Final

__all__ = ["FORMATS", "JsonFormatter", "LogEvent", "TextFormatter", "escape", "event", "install", "render_kv"]

FORMATS: Final = ("text", "json")
RESERVED: Final = frozenset({"ts", "level", "logger", "pid", "msg", "exc", "event", "qid"})
FieldValue = str | int | float | bool | Sequence[str | int | float] | None
# A logfmt value that needs no quotes: no space, quote, backslash or equals sign, and not empty.
_BARE: Final = re.compile(r'[^\s"=\\]+')


def escape(text: str) -> str:
    """``text`` with every character that is not printable written as a Python escape (``\\n``, ``\\u202e``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def _kv_value(value: Any) -> str:
    text: str
    kind = type(value)
    if kind is str:
        text = value
        # What _BARE says, without a regex call for the common case (a line is rendered per message).
        # Every whitespace character but the space is unprintable, so isprintable() and the four tests cover \s.
        if text and text.isprintable() and not (" " in text or '"' in text or "=" in text or "\\" in text):
            return text
    elif kind is int:
        return str(value)
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = value
    else:
        text = ",".join(str(v) for v in value)
    if _BARE.fullmatch(text) and text.isprintable():
        return text
    return '"' + escape(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


def _json_value(value: Any) -> Any:
    if isinstance(value, str | int | float | bool):
        return round(value, 3) if isinstance(value, float) else value
    return list(value)


class LogEvent:
    """The message of one event's record: rendered to logfmt only when a handler asks (``str``)."""

    __slots__ = ("fields", "name", "qid")

    def __init__(self, name: str, qid: str | None, fields: Mapping[str, FieldValue]) -> None:
        self.name = name
        self.qid = qid
        self.fields = {k.removesuffix("_"): v for k, v in fields.items() if v is not None}
        if not RESERVED.isdisjoint(self.fields):
            clash = sorted(RESERVED.intersection(self.fields))
            raise ValueError(f"log event field names reserved for the line itself: {clash}")

    def __str__(self) -> str:
        return render_kv(self)

    def as_dict(self) -> dict[str, Any]:
        """The event's own keys, in order: event, qid (if any), then the fields."""
        out: dict[str, Any] = {"event": self.name}
        if self.qid is not None:
            out["qid"] = self.qid
        out.update((k, _json_value(v)) for k, v in self.fields.items())
        return out


def render_kv(ev: LogEvent) -> str:
    parts = [f"event={_kv_value(ev.name)}"]
    if ev.qid is not None:
        parts.append(f"qid={_kv_value(ev.qid)}")
    parts += [f"{k}={_kv_value(v)}" for k, v in ev.fields.items()]
    return " ".join(parts)


def event(logger: logging.Logger, name: str, qid: str | None = None, fields: Mapping[str, FieldValue] | None = None,
          *, level: int = logging.INFO, exc_info: BaseException | None = None, **more: FieldValue) -> None:
    """Log one event line: ``name``, the queue id of the message it is about (if any), and its fields.

    The fields are ``fields`` (a mapping, for fields made elsewhere) then the keywords, in order.
    """
    if logger.isEnabledFor(level):
        # The record names the caller's file and line, not this function's. Made here rather than by
        # logger.log(stacklevel=2), whose search of the stack for the caller costs a fifth of a line.
        caller = sys._getframe(1)
        code = caller.f_code
        record = logger.makeRecord(logger.name, level, code.co_filename, caller.f_lineno,
                                   LogEvent(name, qid, {**fields, **more} if fields else more), (),
                                   (type(exc_info), exc_info, exc_info.__traceback__) if exc_info else None,
                                   code.co_name)
        logger.handle(record)


# The last second rendered, and its text up to the milliseconds: a busy relay logs many lines a second.
_second: tuple[int, str] = (-1, "")


def _timestamp(record: logging.LogRecord) -> str:
    global _second
    created = record.created
    whole = int(created)
    second = _second
    if second[0] != whole:
        second = _second = (whole, dt.datetime.fromtimestamp(whole, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S."))
    return f"{second[1]}{int((created - whole) * 1000):03d}Z"


class TextFormatter(logging.Formatter):
    """``TIME LOGGER[PID] LEVEL MESSAGE``, the message escaped (an event's as logfmt); a traceback follows."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.name}[{record.process}] {record.levelname} " \
               f"{escape(record.getMessage())}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info).rstrip("\n")
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback is the ``exc`` field)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                               "pid": record.process}
        msg = record.msg
        if isinstance(msg, LogEvent) and not record.args:
            out.update(msg.as_dict())
        else:
            # A plain line may name its event and message (``extra={"event": ..., "qid": ...}``: the spool's
            # recovery lines, which cannot make a LogEvent), so that a search by event or queue id finds it.
            for key in ("event", "qid"):
                value = getattr(record, key, None)
                if isinstance(value, str):
                    out[key] = value
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # ensure_ascii escapes C0 and everything non-ASCII; DEL is the one control character it leaves raw.
        return json.dumps(out, ensure_ascii=True, default=str).replace("\x7f", "\\u007f")


def install(level: str, fmt: str, stream: IO[str] | None = None) -> logging.Handler:
    """Send every log record at ``level`` or above to ``stream`` (stderr) in ``fmt`` (``text`` or ``json``).

    Replaces whatever handlers the root logger had, so that a second call
    (tests run several relays) does not write each line twice.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
