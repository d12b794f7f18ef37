"""``GET /events``: the event stream over HTTP, served by the relay with bounded work per client.

A page of events as JSON, long-polled: a request that finds nothing new
past its cursor waits (``wait=`` seconds, at most ``[events] max_wait``)
until the durable horizon moves, then answers. One request per
connection, ``Connection: close``; at most ``max_connections`` at once, the
others wait in the kernel's listen backlog; each has ``max_wait`` plus a few
seconds in all, whatever it does. The log is read in a worker thread, so a
page never holds the relay's event loop; every request is its own unit of
failure (a bad request gets a 400 naming the parameter, an unexpected
exception is logged and ends that request only).

The query:

- ``after``: the ``next`` of the previous answer (an event id: its record's
  position); none: from the consumer's cursor, else from the oldest record.
- ``consumer``: a name (``[A-Za-z0-9_.-]``, at most 64). With ``after``, the
  cursor of that consumer is set to it first (fsynced): ``after`` is what
  the consumer acknowledges. Without, it reads on from its cursor. A named
  consumer's cursor pins the segments it has not read (``[spool]
  cursor_pin_max``).
- ``limit``: records at most (``[events] page_records``); ``wait``: seconds;
  ``shard``: which shard's stream.

A request with ``Accept: text/event-stream`` gets the stream as server-sent
events instead (``mta.events.sse``): one response that goes on, new events
framed as they become durable, a heartbeat comment every ``[events]
sse_heartbeat`` when there is nothing, for at most ``sse_max_time``; it
begins at ``Last-Event-ID`` (a reconnecting client's) or ``after``.
``consumer`` and ``wait`` are for the long poll only.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any
from urllib.parse import parse_qs

import trio

from mta.admin.errors import AdminError
from mta.config import Config
from mta.events.cursors import CursorError, Cursors, check_name
from mta.events.rejections import RejectionReader, format_rid, parse_rid
from mta.events.source import classes_of, event_dict, open_stream
from mta.events.sse import (
    CONTENT_TYPE,
    HEARTBEAT,
    BadEventId,
    Resume,
    frame,
    lagged_frame,
    parse_last_event_id,
    wants_sse,
)
from mta.observe.bounded_accept import BoundedAccept
from mta.shards import shard_config, shard_count
from spool import EventBatch, EventStream, NotARecord, SpoolError, format_pos, parse_pos

log = logging.getLogger("mta.events")

MAX_HEAD = 8192
POLL = 0.1  # seconds between looks at the durable horizon while a request waits
GRACE = 5.0  # seconds a request may take beyond its wait: to send its head and read its answer


class BadRequest(ValueError):
    """The request cannot be served; ``status`` the HTTP answer, ``text`` why (one line)."""

    def __init__(self, status: str, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class EventsServer:
    """Serves the event streams of ``config``'s shards."""

    def __init__(self, config: Config) -> None:
        self.config = config
        cfg = config.events
        self.max_wait = cfg.max_wait
        self.page_records = cfg.page_records
        self.sse_heartbeat = cfg.sse_heartbeat
        self.sse_max_time = cfg.sse_max_time
        self.cursors = Cursors(config)
        self.accept = BoundedAccept("events endpoint", cfg.max_connections, self._handle)
        self.serve = self.accept.serve
        self._readers = trio.CapacityLimiter(cfg.max_connections)
        self._streams: dict[int, EventStream] = {}

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            head = b""
            with trio.move_on_after(GRACE):
                head = await _read_head(stream)
            if not head:
                return
            if wants_sse(_headers(head).get("accept", "")):
                with trio.move_on_after(self.sse_max_time):
                    await self._exchange_sse(stream, head)
                return
            with trio.move_on_after(self.max_wait + GRACE):
                await self._exchange(stream, head)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except BadRequest as e:
            with trio.move_on_after(GRACE):
                await _send_json(stream, e.status, {"error": e.text})
        except Exception:
            log.exception("events request from %s failed", _peer(stream))

    async def _exchange(self, stream: trio.SocketStream, head: bytes) -> None:
        try:
            status, body = "200 OK", await self.answer(_query(head))
        except BadRequest as e:
            status, body = e.status, {"error": e.text}
        except (SpoolError, AdminError, OSError) as e:
            status, body = "503 Service Unavailable", {"error": " ".join(str(e).split())}
        await _send_json(stream, status, body)

    async def _exchange_sse(self, stream: trio.SocketStream, head: bytes) -> None:
        """The stream as server-sent events, until the client goes or ``sse_max_time`` ends it.
        Raises BadRequest (answered as JSON) for what is wrong before the first byte of the stream."""
        query, headers = _query(head), _headers(head)
        for name in ("consumer", "wait"):
            if name in query:
                raise BadRequest("400 Bad Request", f"{name}: not with Accept: {CONTENT_TYPE} (an event-stream "
                                 f"client resumes with Last-Event-ID)")
        shard = _int(query, "shard", 0, 0, shard_count(self.config) - 1)
        limit = _int(query, "limit", self.page_records, 1, self.page_records)
        resume: Resume | None = None
        after = _position(query["after"]) if "after" in query else None
        if "last-event-id" in headers:
            try:
                resume = parse_last_event_id(headers["last-event-id"])
            except BadEventId as e:
                raise BadRequest("400 Bad Request", str(e)) from None
            after = None if resume.index is not None else resume.pos
        since = resume.pos if resume is not None and resume.index is not None else None
        events = self._stream(shard)
        try:
            batch = await self._read(events, after, limit, since)  # before the head: a bad id is still a 400
        except (SpoolError, AdminError, OSError) as e:
            await _send_json(stream, "503 Service Unavailable", {"error": " ".join(str(e).split())})
            return
        await stream.send_all(f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nCache-Control: no-store\r\n"
                              f"X-Accel-Buffering: no\r\nConnection: close\r\n\r\n".encode("latin-1"))
        quiet_since = trio.current_time()
        while True:
            out = b""
            if batch.lagged and batch.gap is not None:
                out += lagged_frame(batch.gap)
            for event in batch.events:
                d = event_dict(event, shard, classes_of(self.config))
                if resume is None or resume.keep(d):
                    out += frame(d)
            if out:
                await stream.send_all(out)
                quiet_since = trio.current_time()
            moved = batch.after is not None and batch.after != after
            if batch.after is not None:
                after = batch.after
                if resume is not None and after >= resume.pos:
                    resume = None
            if not moved:
                if trio.current_time() - quiet_since >= self.sse_heartbeat:
                    await stream.send_all(HEARTBEAT)
                    quiet_since = trio.current_time()
                await trio.sleep(POLL)
            batch = await self._read(events, after, limit)

    # -- the answer, apart from HTTP ------------------------------------------------------

    async def answer(self, query: dict[str, str]) -> dict[str, Any]:
        """The page for ``query`` (``after``, ``consumer``, ``limit``, ``wait``, ``shard``, ``stream``). Raises
        BadRequest."""
        shard = _int(query, "shard", 0, 0, shard_count(self.config) - 1)
        limit = _int(query, "limit", self.page_records, 1, self.page_records)
        wait = _number(query, "wait", 0.0, 0.0, self.max_wait)
        which = query.get("stream", "messages")
        if which == "rejections":
            return await self._rejections(query, shard, limit, wait)
        if which != "messages":
            raise BadRequest("400 Bad Request", f"stream: {which!r} is not messages nor rejections")
        consumer = query.get("consumer")
        after = _position(query["after"]) if "after" in query else None
        if consumer is not None:
            try:
                check_name(consumer)
                if after is not None:
                    await trio.to_thread.run_sync(self.cursors.store, consumer, shard, after)
                else:
                    after = await trio.to_thread.run_sync(self.cursors.load, consumer, shard)
            except CursorError as e:
                raise BadRequest("400 Bad Request", str(e)) from None
        stream = self._stream(shard)
        deadline = trio.current_time() + wait
        while True:
            batch = await self._read(stream, after, limit)
            if batch.events or trio.current_time() >= deadline:
                break
            if batch.after != after:
                after = batch.after  # only records that make no event (STARTs): passed, and the wait goes on
                continue
            await trio.sleep(min(POLL, max(0.0, deadline - trio.current_time())))
        return {
            "events": [event_dict(e, shard, classes_of(self.config)) for e in batch.events],
            "next": None if batch.after is None else format_pos(batch.after),
            "horizon": None if batch.horizon is None else format_pos(batch.horizon),
            "lagged": batch.lagged,
            "gap": None if batch.gap is None else [format_pos(p) for p in batch.gap],
        }

    async def _rejections(self, query: dict[str, str], shard: int, limit: int, wait: float) -> dict[str, Any]:
        """A page of the shard's SMTP rejections (``mta.events.rejections``): no consumer cursor (nothing pins
        them: they are kept up to ``[events] rejections_max``)."""
        if "consumer" in query:
            raise BadRequest("400 Bad Request", "consumer: not with stream=rejections (nothing pins them)")
        after = None
        if "after" in query:
            try:
                after = parse_rid(query["after"])
            except ValueError as e:
                raise BadRequest("400 Bad Request", f"after: {e}") from None
        reader = RejectionReader(shard_config(self.config, shard, shard_count(self.config)).spool.dir)
        deadline = trio.current_time() + wait
        while True:
            page = await trio.to_thread.run_sync(functools.partial(reader.read, after, limit),
                                                 limiter=self._readers)
            if page.events or trio.current_time() >= deadline:
                break
            await trio.sleep(min(POLL, max(0.0, deadline - trio.current_time())))
        return {
            "events": page.events,
            "next": None if page.after is None else format_rid(page.after),
            "horizon": format_rid(page.durable),
            "lagged": page.lagged,
            "gap": None if page.gap is None else [format_rid(page.gap[0]), format_rid(page.gap[1])],
        }

    def _stream(self, shard: int) -> EventStream:
        if shard not in self._streams:
            self._streams[shard] = open_stream(self.config, shard)
        return self._streams[shard]

    async def _read(self, stream: EventStream, after: int | None, limit: int,
                    since: int | None = None) -> EventBatch:
        try:
            return await trio.to_thread.run_sync(functools.partial(stream.read, after, since=since,
                                                                   max_records=limit), limiter=self._readers)
        except NotARecord as e:
            raise BadRequest("400 Bad Request", f"after: {e}") from None


async def _read_head(stream: trio.SocketStream) -> bytes:
    buf = bytearray()
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        if len(buf) > MAX_HEAD:
            raise BadRequest("431 Request Header Fields Too Large", "the request head is too large")
        data = await stream.receive_some(4096)
        if not data:
            break
        buf += data
    return bytes(buf[:MAX_HEAD + 4])


def _headers(head: bytes) -> dict[str, str]:
    """The head's fields, names in lower case (a repeated field: its last value)."""
    lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")[1:]
    fields = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if colon and name.strip():
            fields[name.strip().lower()] = value.strip()
    return fields


async def _send_json(stream: trio.SocketStream, status: str, body: dict[str, Any]) -> None:
    payload = (json.dumps(body, sort_keys=True) + "\n").encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"Cache-Control: no-store\r\nConnection: close\r\n\r\n")
    await stream.send_all(head.encode("latin-1") + payload)


def _query(head: bytes) -> dict[str, str]:
    line = head.decode("latin-1").split("\n", 1)[0].strip()
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest("400 Bad Request", "not an HTTP/1.x request")
    method, target, _ = parts
    path, _, query = target.partition("?")
    if path != "/events":
        raise BadRequest("404 Not Found", f"no {path} here: GET /events")
    if method != "GET":
        raise BadRequest("405 Method Not Allowed", "GET /events only")
    try:
        parsed = parse_qs(query, strict_parsing=bool(query), max_num_fields=16)
    except ValueError as e:
        raise BadRequest("400 Bad Request", f"the query: {e}") from None
    known = {"after", "consumer", "limit", "wait", "shard", "stream"}
    for name, values in parsed.items():
        if name not in known:
            raise BadRequest("400 Bad Request", f"unknown parameter {name!r} (known: {', '.join(sorted(known))})")
        if len(values) > 1:
            raise BadRequest("400 Bad Request", f"{name} given {len(values)} times")
    return {name: values[0] for name, values in parsed.items()}


def _int(query: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    if name not in query:
        return default
    try:
        value = int(query[name])
    except ValueError:
        raise BadRequest("400 Bad Request", f"{name}: not an integer: {query[name]!r}") from None
    if not low <= value <= high:
        raise BadRequest("400 Bad Request", f"{name}: {value} is not in {low}..{high}")
    return value


def _number(query: dict[str, str], name: str, default: float, low: float, high: float) -> float:
    if name not in query:
        return default
    try:
        value = float(query[name])
    except ValueError:
        raise BadRequest("400 Bad Request", f"{name}: not a number: {query[name]!r}") from None
    if not low <= value <= high:
        raise BadRequest("400 Bad Request", f"{name}: {value:g} is not in {low:g}..{high:g}")
    return value


def _position(text: str) -> int:
    try:
        return parse_pos(text.split("/", 1)[0])
    except ValueError:
        raise BadRequest("400 Bad Request", f"after: not an event id: {text!r} (want 1:70)") from None


def _peer(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:
        return "?"
