"""Queue administration, one implementation for both ways it is reached.

While the relay runs, ``mta queue ...`` talks to it over the control socket
(``mta.control``): the relay is the spool's only writer, so changes must go
through it. When no relay runs, the CLI opens the spool itself (taking its
lock, which also runs recovery) and calls the same functions. Requests and
answers are plain JSON-able dicts either way.

Reads are the spool's constant-memory walks (``spool.admin``); a page holds at
most ``limit`` messages and the cursor is a log position.

Each function serves one spool shard (``shard``, see ``mta.shards``): ids in
requests must be that shard's and ids in answers carry its suffix. Spreading
a request over the shards and merging the answers is the CLI's job.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mta.shards import format_queue_id, parse_queue_id
from spool import admin
from spool.errors import NotFound

MAX_LIMIT = 10_000


class RequestError(ValueError):
    """A malformed admin request: answered, never raised to the client as a traceback."""


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


def make_filter(req: dict[str, Any]) -> admin.Filter:
    try:
        return admin.Filter(
            sender=req.get("sender"), recipient=req.get("recipient"), domain=req.get("domain"),
            min_age=req.get("min_age"), max_age=req.get("max_age"),
            held=True if req.get("held") else None, in_doubt=bool(req.get("in_doubt")))
    except TypeError as exc:
        raise RequestError(f"bad filter: {exc}") from None


def read_op(listable: admin.Listable, req: dict[str, Any], read_body: Callable[[Any], Any] | None = None,
            shard: int = 0) -> dict[str, Any]:
    """list, count, show and shape: everything that does not change the queue."""
    op = req.get("op")
    now = time.time()
    if op == "list":
        limit = int(req.get("limit") or 100)
        if not 1 <= limit <= MAX_LIMIT:
            raise RequestError(f"limit must be between 1 and {MAX_LIMIT}")
        cursor = req.get("cursor")
        msgs, nxt = admin.page(listable, make_filter(req), int(cursor) if cursor is not None else None, limit, now)
        return {"messages": [message_dict(m, now, shard) for m in msgs], "next": nxt}
    if op == "count":
        return {"count": admin.count(listable, make_filter(req), now)}
    if op == "show":
        mid = _id(req.get("id"), shard)
        try:
            msg = admin.find(listable, mid)
        except NotFound:
            raise NotFound(f"no queued message with id {format_queue_id(mid, shard)}") from None
        out = message_dict(msg, now, shard)
        if req.get("body") and read_body is not None:
            data = b"".join(read_body(msg.envelope))
            out["body"] = data.decode("utf-8", "replace")
        return out
    if op == "shape":
        rows = admin.shape(listable, now, int(req.get("top") or 20))
        return {"buckets": [b if b != float("inf") else None for b in admin.AGE_BUCKETS],
                "rows": [{"domain": d, "total": t, "counts": c} for d, t, c in rows]}
    raise RequestError(f"unknown operation {op!r}")


def _id(value: Any, shard: int) -> int:
    if not isinstance(value, str):
        raise RequestError("a queue id is required")
    try:
        owner, mid = parse_queue_id(value)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    if owner != shard:
        raise RequestError(f"queue id {value} belongs to shard {owner}, not to shard {shard}")
    return mid


CHANGES = ("hold", "release", "delete", "flush")


async def change_op(req: dict[str, Any], apply: Callable[[str, int], Awaitable[bool]],
                    all_deferred: Callable[[], AsyncIterator[int]], shard: int = 0) -> dict[str, Any]:
    """hold/release/delete/flush for each id (flush with no ids: every deferred message).

    A flush of everything streams the ids page by page, so it runs in constant
    memory; its answer counts rather than lists what it did.
    """
    op = req.get("op")
    if op not in CHANGES:
        raise RequestError(f"unknown operation {op!r}")
    ids = req.get("ids") or []
    if not isinstance(ids, list):
        raise RequestError("ids must be a list")
    if not ids:
        if op != "flush":
            raise RequestError(f"{op} needs at least one queue id")
        flushed = 0
        async for mid in all_deferred():
            try:
                flushed += await apply(op, mid)
            except Exception:  # busy or gone since the page was read: it is being retried anyway
                continue
        return {"done": flushed, "skipped": [], "errors": {}}
    targets = [_id(i, shard) for i in ids]
    done: list[str] = []
    skipped: list[str] = []
    errors: dict[str, str] = {}
    for mid in targets:
        try:
            (done if await apply(op, mid) else skipped).append(format_queue_id(mid, shard))
        except NotFound:
            errors[format_queue_id(mid, shard)] = f"no queued message with id {format_queue_id(mid, shard)}"
        except Exception as exc:  # MessageBusy and friends: reported per id
            errors[format_queue_id(mid, shard)] = str(exc)
    return {"done": done, "skipped": skipped, "errors": errors}
