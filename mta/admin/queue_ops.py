"""Queue administration, one implementation for both ways it is reached.

While the relay runs, ``mta queue ...`` talks to it over the control socket
(``mta.admin.control``): the relay is the spool's only writer, so changes must go
through it. When no relay runs, ``mta.admin.offline`` opens the spool itself
(taking its lock, which also runs recovery) and calls the same functions. Requests and
answers are plain JSON-able dicts either way.

Reads are the spool's constant-memory walks (``spool.admin``); a page holds at
most ``limit`` messages and the cursor is a log position.

Each function serves one spool shard (``shard``, see ``mta.process.shards``): ids in
requests must be that shard's and ids in answers carry its suffix. Spreading
a request over the shards and merging the answers is ``mta.admin.shards_merge``'s job.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs

from mta.process.shards import format_queue_id, parse_queue_id
from spool import admin
from spool.errors import DamagedBody, NotFound, SpoolError

MAX_LIMIT = 10_000
MAX_POSITION = (1 << 64) - 1  # a log position: segment id << 32 | offset (``spool.record.make_pos``)
_SHOWN = 40  # at most this many characters of a client's value appear in an error


class RequestError(ValueError):
    """A malformed admin request: answered, never raised to the client as a traceback."""


def shown(value: Any) -> str:
    """A client's value for an error message: its repr, cut short (a 60 KB op name is not worth echoing)."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


@attrs.frozen
class Request:
    """One admin request, every field checked for its type and range (``parse_request``).

    ``filter``: for list and count; ``limit`` and ``cursor`` (a log position,
    None for the start): list; ``id`` and ``body``: show; ``top``: shape;
    ``ids``: hold, release, delete and flush (empty: flush every deferred message).
    """

    op: str
    filter: admin.Filter = attrs.field(factory=admin.Filter)
    limit: int = 100
    cursor: int | None = None
    id: str = ""
    body: bool = False
    top: int = 20
    ids: tuple[str, ...] = ()


READS = ("list", "count", "show", "shape")
CHANGES = ("hold", "release", "delete", "flush")
_FILTER_FIELDS = ("sender", "recipient", "domain", "min_age", "max_age", "held", "in_doubt")
_FIELDS: dict[str, tuple[str, ...]] = {
    "list": (*_FILTER_FIELDS, "limit", "cursor"),
    "count": _FILTER_FIELDS,
    "show": ("id", "body"),
    "shape": ("top",),
    **{op: ("ids",) for op in CHANGES},
}


def _optional_str(name: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise RequestError(f"{name} must be a string or null, got {_type(value)}")


def _flag(name: str, value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise RequestError(f"{name} must be true, false or null, got {_type(value)}")


def _age(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1e12:
        raise RequestError(f"{name} must be a number of seconds between 0 and 1e12, got {shown(value)}")
    return float(value)


def _integer(name: str, value: Any, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer between {low} and {high}, got {shown(value)}")
    return value


def _type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_request(req: Any) -> Request:
    """Check a decoded JSON request field by field; anything else than the documented types is refused.

    Raises:
        RequestError: not an object, unknown op or field, or a field of the wrong type or range.
    """
    if not isinstance(req, dict):
        raise RequestError(f"a request is a JSON object, got {_type(req)}")
    op = req.get("op")
    if not isinstance(op, str) or op not in _FIELDS:
        raise RequestError(f"unknown operation {shown(op)}; one of {', '.join(_FIELDS)}")
    unknown = sorted(k for k in req if k != "op" and k not in _FIELDS[op])
    if unknown:
        raise RequestError(f"unknown field {shown(unknown[0])} for {op}")
    get = req.get
    flt = admin.Filter(
        sender=_optional_str("sender", get("sender")), recipient=_optional_str("recipient", get("recipient")),
        domain=_optional_str("domain", get("domain")), min_age=_age("min_age", get("min_age")),
        max_age=_age("max_age", get("max_age")), held=True if _flag("held", get("held")) else None,
        in_doubt=_flag("in_doubt", get("in_doubt")))
    qid = get("id")
    if op == "show" and not isinstance(qid, str):
        raise RequestError(f"show needs an id (a string), got {_type(qid)}")
    ids = get("ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise RequestError("ids must be a list of queue ids (strings)")
    if not ids and op in CHANGES and op != "flush":
        raise RequestError(f"{op} needs at least one queue id")
    cursor = get("cursor")
    return Request(op=op, filter=flt, limit=_integer("limit", get("limit"), 100, 1, MAX_LIMIT),
                   cursor=None if cursor is None else _integer("cursor", cursor, 0, 0, MAX_POSITION),
                   id=qid if isinstance(qid, str) else "", body=_flag("body", get("body")),
                   top=_integer("top", get("top"), 20, 1, MAX_LIMIT), ids=tuple(ids))


def message_dict(m: admin.LiveMessage, now: float, shard: int = 0) -> dict[str, Any]:
    env = m.envelope
    return {
        "id": format_queue_id(m.message_id, shard),
        "state": m.state,
        "class": m.klass,
        "sender": env.sender,
        "recipients": list(env.recipients),
        "size": env.body_size,
        "arrival": env.arrival_ms / 1000,
        "age": round(m.age(now), 3),
        "attempts": env.attempts,
        "in_doubt": list(env.in_doubt),
        "last_error": str(env.extra.get("last_error", "")),
    }


def read_op(listable: admin.Listable, req: Request, read_body: Callable[[Any], Any] | None = None,
            shard: int = 0) -> dict[str, Any]:
    """list, count, show and shape: everything that does not change the queue."""
    now = time.time()
    if req.op == "list":
        msgs, nxt = admin.page(listable, req.filter, req.cursor, req.limit, now)
        return {"messages": [message_dict(m, now, shard) for m in msgs], "next": nxt}
    if req.op == "count":
        return {"count": admin.count(listable, req.filter, now)}
    if req.op == "show":
        mid = _id(req.id, shard)
        try:
            msg = admin.find(listable, mid)
        except NotFound:
            raise NotFound(f"no queued message with id {format_queue_id(mid, shard)}") from None
        out = message_dict(msg, now, shard)
        if req.body and read_body is not None:
            try:
                data = b"".join(read_body(msg.envelope))
            except DamagedBody as exc:  # quarantined and named by the spool: the message is shown without it
                out["body_error"] = str(exc)
            else:
                out["body"] = data.decode("utf-8", "replace")
        return out
    if req.op == "shape":
        rows = admin.shape(listable, now, req.top)
        return {"buckets": [b if b != float("inf") else None for b in admin.AGE_BUCKETS],
                "rows": [{"domain": d, "total": t, "counts": c} for d, t, c in rows]}
    raise RequestError(f"{req.op} is not a read")


def _id(value: str, shard: int) -> int:
    try:
        owner, mid = parse_queue_id(value)
    except ValueError:
        raise RequestError(f"not a queue id: {shown(value)}") from None
    if owner != shard:
        raise RequestError(f"queue id {value} belongs to shard {owner}, not to shard {shard}")
    return mid


async def change_op(req: Request, apply: Callable[[str, int], Awaitable[bool]],
                    all_deferred: Callable[[], AsyncIterator[int]], shard: int = 0) -> dict[str, Any]:
    """hold/release/delete/flush for each id (flush with no ids: every deferred message).

    A flush of everything streams the ids page by page, so it runs in constant
    memory; its answer counts rather than lists what it did.
    """
    op = req.op
    if op not in CHANGES:
        raise RequestError(f"{op} is not a change")
    if not req.ids:
        flushed = 0
        async for mid in all_deferred():
            try:
                flushed += await apply(op, mid)
            except SpoolError:  # busy or gone since the page was read: it is being retried anyway
                continue
        return {"done": flushed, "skipped": [], "errors": {}}
    targets = [_id(i, shard) for i in req.ids]
    done: list[str] = []
    skipped: list[str] = []
    errors: dict[str, str] = {}
    for mid in targets:
        try:
            (done if await apply(op, mid) else skipped).append(format_queue_id(mid, shard))
        except NotFound:
            errors[format_queue_id(mid, shard)] = f"no queued message with id {format_queue_id(mid, shard)}"
        except (SpoolError, OSError) as exc:  # MessageBusy, a disk error: reported per id
            errors[format_queue_id(mid, shard)] = str(exc)
    return {"done": done, "skipped": skipped, "errors": errors}
