"""Queue administration, one implementation for both ways it is reached.

While the relay runs, ``mta queue ...`` talks to it over the control socket
(``mta.admin.control``): the relay is the spool's only writer, so changes must go
through it. When no relay runs, ``mta.admin.offline`` opens the spool itself
(taking its lock, which also runs recovery) and calls the same functions. Requests and
answers are plain JSON-able dicts either way.

Reads are the spool's constant-memory walks (``spool.read.listing``). A ``list``
page holds at most ``limit`` messages, oldest first, with the totals of every
message the filter matches; its cursor is the last message's arrival time and
queue id (``mta.shards.format_cursor``), so pages over several shards
merge into one order.

Answers are for programs (``--json``) as much as for people: times are
seconds since the epoch, classes and sizes are numbers, and states are
fixed words (``state``: queued, held, active; a recipient's ``status``:
``RECIPIENT_STATUSES``). ``mta.admin.cli`` turns them into words for people.

Each function serves one spool shard (``shard``, see ``mta.shards``): ids in
requests must be that shard's and ids in answers carry its suffix. Spreading
a request over the shards and merging the answers is ``mta.admin.shards_merge``'s job.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import attrs

from mta.shards import Cursor, format_cursor, format_queue_id, parse_cursor, parse_queue_id
from spool import DamagedBody, MessageMoved, NotFound, SpoolConfig, SpoolError, Status
from spool import listing as admin
from spool.engine.core import SpoolCore

MAX_LIMIT = 10_000
MAX_POSITION = (1 << 64) - 1  # a log position: segment id << 32 | offset (``spool.format.record.make_pos``)
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

    ``filter``: for list and count; ``limit`` and ``cursor`` (the last listed
    message's place, None for the oldest): list; ``id`` and ``body``: show; ``top``: shape;
    ``ids``: hold, release, delete and flush (empty: flush every deferred message);
    ``select``: instead of ids, the messages a filter matches (``--all``,
    ``--in-doubt``, ``--domain``, ``--sender``), streamed from the log.
    """

    op: str
    filter: admin.Filter = attrs.field(factory=admin.Filter)
    limit: int = 100
    cursor: Cursor | None = None
    id: str = ""
    body: bool = False
    top: int = 20
    ids: tuple[str, ...] = ()
    select: admin.Filter | None = None


READS = ("list", "count", "show", "shape")
CHANGES = ("hold", "release", "delete", "flush")
_FILTER_FIELDS = ("sender", "recipient", "domain", "min_age", "max_age", "held", "in_doubt")
_FIELDS: dict[str, tuple[str, ...]] = {
    "list": (*_FILTER_FIELDS, "limit", "cursor"),
    "count": _FILTER_FIELDS,
    "show": ("id", "body"),
    "shape": ("top",),
    "reload": (),  # SIGHUP to the relay's own process (``mta reload``; mta.process.reload)
    **dict.fromkeys(CHANGES, ("ids", "all", "in_doubt", "domain", "sender")),
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
    select = None
    if op in CHANGES and (_flag("all", get("all")) or flt.in_doubt or flt.domain is not None
                          or flt.sender is not None):
        if ids:
            raise RequestError(f"{op} takes queue ids or a selection (all, in_doubt, domain, sender), not both")
        select = admin.Filter(sender=flt.sender, domain=flt.domain, in_doubt=flt.in_doubt)
    if not ids and select is None and op in CHANGES and op != "flush":
        raise RequestError(f"{op} needs at least one queue id, or a selection (all, in_doubt, domain, sender)")
    try:
        cursor = parse_cursor(get("cursor"))
    except ValueError:
        raise RequestError(f"not a list cursor: {shown(get('cursor'))}") from None
    return Request(op=op, filter=flt, limit=_integer("limit", get("limit"), 100, 1, MAX_LIMIT), cursor=cursor,
                   id=qid if isinstance(qid, str) else "", body=_flag("body", get("body")),
                   top=_integer("top", get("top"), 20, 1, MAX_LIMIT), ids=tuple(ids), select=select)


# A recipient's ``status`` in ``show``: a final outcome from the log, or where it stands in the queue.
FINAL_STATUSES = {Status.DELIVERED: "delivered", Status.BOUNCED: "bounced", Status.EXPIRED: "expired",
                  Status.DELETED: "deleted"}
RECIPIENT_STATUSES = (*FINAL_STATUSES.values(), "deferred", "new", "held", "active", "in_doubt")


def message_dict(m: admin.LiveMessage, now: float, shard: int = 0,
                 config: SpoolConfig | None = None) -> dict[str, Any]:
    """One message for an answer. ``retry_every`` and ``next_retry`` need the spool's ``config``.

    ``next_retry`` (seconds since the epoch) is when its runner reaches the
    envelope: written at ``appended``, due ``retry_every`` later (at once for
    new mail); None while held or being delivered.
    """
    env = m.envelope
    every = None
    if config is not None and m.state == "queued":  # a class beyond today's retry_intervals: the last one's
        every = config.interval(min(m.klass, config.classes - 1))
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
        "retry_every": every,
        "next_retry": None if every is None else m.appended + every,
    }


def recipient_rows(m: admin.LiveMessage, history: dict[str, admin.Tried]) -> list[dict[str, Any]]:
    """Each recipient's status and last reply: those still queued first, then those done (from the log)."""
    env = m.envelope
    rows = []
    for r in (*env.recipients, *(r for r in history if r not in env.recipients)):
        tried = history.get(r)
        o = tried.outcome if tried is not None else None
        if o is not None and o.status.final:  # done, perhaps in the attempt still in flight
            status = FINAL_STATUSES[o.status]
        elif r in env.in_doubt:
            status = "in_doubt"
        elif m.state != "queued":
            status = m.state
        elif o is not None or m.klass > 0 or env.attempts:
            status = "deferred"
        else:
            status = "new"
        rows.append({"recipient": r, "status": status, "code": o.code if o else 0, "enhanced": o.enhanced if o else "",
                     "reply": o.reply if o else "", "next_hop": o.next_hop if o else "",
                     "time": tried.time_ms / 1000 if tried else None})
    return rows


def read_op(listable: admin.Listable, req: Request, read_body: Callable[[Any], Any] | None = None,
            shard: int = 0) -> dict[str, Any]:
    """list, count, show and shape: everything that does not change the queue."""
    now = time.time()
    config = listable.config if isinstance(listable, SpoolCore) else None
    if req.op == "list":
        got = admin.oldest_first(listable, req.filter, _local_after(req.cursor, shard), req.limit, now)
        last = got.messages[-1] if got.messages else None
        nxt = format_cursor((last.envelope.arrival_ms, shard, last.message_id)) if got.more and last else None
        return {"messages": [message_dict(m, now, shard, config) for m in got.messages], "next": nxt,
                "total": got.total, "total_bytes": got.total_bytes}
    if req.op == "count":
        return {"count": admin.count(listable, req.filter, now)}
    if req.op == "show":
        mid = _id(req.id, shard)
        try:
            msg = admin.find(listable, mid)
        except NotFound:
            raise NotFound(f"no queued message with id {format_queue_id(mid, shard)}") from None
        out = message_dict(msg, now, shard, config)
        history = admin.outcomes(listable, msg)
        out["recipient_status"] = recipient_rows(msg, history)
        out["last_attempt"] = max((t.time_ms for t in history.values()), default=None)
        if out["last_attempt"] is not None:
            out["last_attempt"] /= 1000
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


def _local_after(cursor: Cursor | None, shard: int) -> admin.Key | None:
    """The cursor of an order over every shard, as a bound on this shard's own (arrival, id) keys.

    The order is (arrival, shard, id): after a message of a lower shard come
    this shard's messages of the same millisecond, after a higher shard's only later ones.
    """
    if cursor is None:
        return None
    arrival_ms, owner, mid = cursor
    if owner == shard:
        return arrival_ms, mid
    return (arrival_ms - 1, MAX_POSITION) if owner < shard else (arrival_ms, MAX_POSITION)


def _id(value: str, shard: int) -> int:
    try:
        owner, mid = parse_queue_id(value)
    except ValueError:
        raise RequestError(f"not a queue id: {shown(value)}") from None
    if owner != shard:
        raise RequestError(f"queue id {value} belongs to shard {owner}, not to shard {shard}")
    return mid


MAX_ERRORS_LISTED = 100  # a selection's answer names at most this many failed ids (and counts them all)
Batches = Callable[[admin.Filter], AsyncIterator[list[admin.LiveMessage]]]
ApplyBatch = Callable[[str, list[admin.LiveMessage]], Awaitable[list[bool | str]]]


async def change_op(req: Request, apply: Callable[[str, int], Awaitable[bool]], matching: Batches,
                    apply_batch: ApplyBatch, shard: int = 0) -> dict[str, Any]:
    """hold/release/delete/flush for each id, or for every message a selection matches.

    A selection (and a flush with no ids: every deferred message) streams the
    matching messages from the log in batches (``matching``), each applied
    with one commit (``apply_batch``), so it runs in constant memory; its
    answer counts rather than lists what it did (``done``, ``skipped``,
    ``failed``), and names at most ``MAX_ERRORS_LISTED`` of the failures.
    """
    op = req.op
    if op not in CHANGES:
        raise RequestError(f"{op} is not a change")
    if not req.ids:
        return await _change_selected(op, req.select or admin.Filter(), matching, apply_batch, shard)
    targets = [_id(i, shard) for i in req.ids]
    done: list[str] = []
    skipped: list[str] = []
    errors: dict[str, str] = {}
    for mid in targets:
        try:
            (done if await _apply_found(apply, op, mid) else skipped).append(format_queue_id(mid, shard))
        except NotFound:
            errors[format_queue_id(mid, shard)] = f"no queued message with id {format_queue_id(mid, shard)}"
        except (SpoolError, OSError) as exc:  # MessageBusy, a disk error: reported per id
            errors[format_queue_id(mid, shard)] = str(exc)
    return {"done": done, "skipped": skipped, "errors": errors}


MOVED_RETRIES = 3  # looks again for a message that moved between the look and the change


async def _apply_found(apply: Callable[[str, int], Awaitable[bool]], op: str, mid: int) -> bool:
    """``apply``, looked up again when the envelope moved in between: the operator named a message, not a
    place, so a carried-forward envelope is no reason to refuse."""
    for _ in range(MOVED_RETRIES):
        try:
            return await apply(op, mid)
        except MessageMoved:
            continue
    return await apply(op, mid)


async def _change_selected(op: str, flt: admin.Filter, matching: Batches, apply_batch: ApplyBatch,
                           shard: int) -> dict[str, Any]:
    done = skipped = failed = 0
    errors: dict[str, str] = {}
    async for batch in matching(flt):
        for msg, result in zip(batch, await apply_batch(op, batch), strict=True):
            if result is True:
                done += 1
            elif result is False or (op == "flush" and msg.state == "active"):  # active: being tried anyway
                skipped += 1
            else:
                failed += 1
                if len(errors) < MAX_ERRORS_LISTED:
                    errors[format_queue_id(msg.message_id, shard)] = str(result)
    return {"done": done, "skipped": skipped, "failed": failed, "errors": errors}


def selection_batches(listable: admin.Listable, flt: admin.Filter, size: int) -> Iterator[list[admin.LiveMessage]]:
    """The messages ``flt`` matches, in log order, ``size`` at a time: memory is one batch.

    Only envelopes written before the walk began are taken: a change writes
    the message's new envelope at the head, and the walk must not meet it again.
    """
    end = listable.source().durable_end
    cursor: int | None = None
    while True:
        msgs, cursor = admin.page(listable, flt, cursor, size)
        batch = [m for m in msgs if m.pos < end]
        if batch:
            yield batch
        if cursor is None or cursor >= end:
            return
