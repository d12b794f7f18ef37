"""Server-sent events (the WHATWG HTML standard's ``text/event-stream``): how ``GET /events`` frames the stream
for a client that asks for it, and where a reconnecting client resumes. No I/O here.

One frame per event: ``id:`` is the event id, ``data:`` its JSON (one line),
no ``event:`` field, so a browser's ``EventSource`` hands every event to
``onmessage`` and the kind is read from the JSON. A consumer that lags past
what the log keeps gets one frame ``event: lagged`` with the gap. A comment
line (``: heartbeat``) goes out when nothing else did for a while, so
proxies keep the connection and the client sees the server alive.

Resuming: a client sends the last id it took as ``Last-Event-ID``. An id
with a recipient's index (``1:5402/0``) names one event of a record that
may have more; the stream resumes *at* that record and drops its events up
to that index, so a connection cut in the middle of a record's events
loses none of them and repeats none.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from spool import format_pos, parse_pos

__all__ = ["CONTENT_TYPE", "HEARTBEAT", "BadEventId", "Resume", "frame", "lagged_frame", "parse_last_event_id",
           "wants_sse"]

CONTENT_TYPE = "text/event-stream"
HEARTBEAT = b": heartbeat\n\n"


class BadEventId(ValueError):
    """A ``Last-Event-ID`` that is not an event id."""


@attrs.frozen
class Resume:
    """Where a stream begins: at the record ``pos`` (inclusive) skipping its events up to ``index``, or
    after the record ``pos`` (``index`` None: the id named the record's only event)."""

    pos: int
    index: int | None

    def keep(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` (read from ``pos`` on) is new to the client."""
        if event["pos"] != self.pos:
            return True
        if self.index is None:
            return False
        _, _, index = str(event["id"]).partition("/")
        return index != "" and int(index) > self.index


def parse_last_event_id(text: str) -> Resume:
    """``1:5402`` or ``1:5402/0``. Raises BadEventId."""
    pos_text, slash, index_text = text.strip().partition("/")
    try:
        pos = parse_pos(pos_text)
        index = int(index_text) if slash else None
    except ValueError:
        raise BadEventId(f"Last-Event-ID: not an event id: {text!r} (want 1:70 or 1:70/0)") from None
    if index is not None and index < 0:
        raise BadEventId(f"Last-Event-ID: not an event id: {text!r} (want 1:70 or 1:70/0)")
    return Resume(pos, index)


def wants_sse(accept: str) -> bool:
    """The ``Accept`` header names ``text/event-stream`` (with any parameters)."""
    return any(part.split(";", 1)[0].strip().lower() == CONTENT_TYPE for part in accept.split(","))


def frame(event: dict[str, Any]) -> bytes:
    """One event as a frame: ``id:`` and one ``data:`` line (JSON has no raw newline)."""
    return f"id: {event['id']}\ndata: {json.dumps(event, sort_keys=True)}\n\n".encode()


def lagged_frame(gap: tuple[int, int]) -> bytes:
    """The client lags: positions ``gap`` are no longer in the log nor the archive. No ``id:`` (it names no
    event, and the client's last id stays where it was)."""
    body = json.dumps({"lagged": True, "gap": [format_pos(gap[0]), format_pos(gap[1])]})
    return f"event: lagged\ndata: {body}\n\n".encode()
