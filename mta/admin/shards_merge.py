"""One queue request over every spool shard: route it, ask each shard, merge the answers.

Each shard answers for itself (``mta.admin.queue_ops``), through its relay's
control socket if it runs (``mta.admin.client``) or from its spool on disk
if not (``mta.admin.offline``). Here the answers become the one answer an
operator asked for: counts and shapes add up, ``show`` and the changes go to
each id's shard, and each shard's oldest messages of a ``list`` page merge
into one page, oldest first over every shard.

No queue command creates a spool: when shard 0's spool is not there, no
relay has ever run on this config, and ``SpoolNotFound`` names the spool and
the config that named it (``missing_spool``). Only ``mta serve`` makes one.
"""

from __future__ import annotations

import os
from typing import Any

from mta.admin.client import ask_relay
from mta.admin.control import socket_path
from mta.admin.errors import BadRequest, NoSuchMessage, SpoolNotFound, SpoolUnavailable
from mta.admin.offline import answer_offline
from mta.config import DEFAULTS_SOURCE, Config
from mta.shards import Cursor, all_shards, format_cursor, parse_cursor, parse_queue_id
from spool import LOG_DIR
from spool import listing as admin

SHAPE_TOP_PER_SHARD = 1000  # each shard's table before the merge: exact unless a shard sees more domains
Shards = list[tuple[int, Config]]


def request(config: Config, req: dict[str, Any]) -> dict[str, Any]:
    """The answer to ``req`` (a control-socket request) over every shard of ``config``'s spool.

    Raises:
        AdminError: one of its subclasses (``mta.admin.errors``), from routing or from any shard.
        ConfigError: the config cannot be split into shards, or the spool refuses a setting.
    """
    try:
        shards = all_shards(config)
    except OSError as exc:
        raise SpoolUnavailable(f"spool {config.spool.dir}: {exc}") from None
    op = req["op"]
    if op == "count":
        return {"ok": True, "count": sum(ask_shard(c, k, req)["count"] for k, c in shards)}
    if op == "list":
        return _list(shards, req)
    if op == "show":
        shard = shard_of(str(req["id"]), len(shards))
        return ask_shard(shards[shard][1], shard, req)
    if op == "shape":
        return _shape(shards, req)
    return _change_all(shards, req)


def ask_shard(config: Config, shard: int, req: dict[str, Any]) -> dict[str, Any]:
    """One shard's answer: from its relay process if it runs, else from its spool on disk."""
    answer = ask_relay(socket_path(config), req)
    if answer is not None:
        return answer
    if not os.path.isdir(os.path.join(config.spool.dir, LOG_DIR)):
        if not shard:
            raise SpoolNotFound(missing_spool(config))
        return _empty_answer(req)  # configured but never started: it holds nothing
    return answer_offline(config, shard, req)


def missing_spool(config: Config) -> str:
    """One line: which spool is not there, which config named it, and that nothing was created."""
    if config.source == DEFAULTS_SOURCE:
        named = ("the built-in default spool.dir, relative to the current directory: no --config, "
                 "$LOGSPOOL_CONFIG or ./logspool.toml")
    else:
        named = f"spool.dir of {os.path.abspath(config.source)}"
    return f"no spool at {config.spool.dir} ({named}); nothing was created"


def _empty_answer(req: dict[str, Any]) -> dict[str, Any]:
    op = req["op"]
    if op == "list":
        return {"messages": [], "next": None, "total": 0, "total_bytes": 0}
    if op == "count":
        return {"count": 0}
    if op == "shape":
        return {"buckets": [b if b != float("inf") else None for b in admin.AGE_BUCKETS], "rows": []}
    if op == "show":
        raise NoSuchMessage(f"no queued message with id {req.get('id')}")
    ids = req.get("ids") or []
    if not ids:
        return {"done": 0, "skipped": 0, "failed": 0, "errors": {}}
    return {"done": [], "skipped": [], "errors": {i: f"no queued message with id {i}" for i in ids}}


def check_ids(ids: tuple[str, ...]) -> list[str]:
    """``ids`` if each is a queue id. Raises BadRequest for the first that is not."""
    for i in ids:
        try:
            parse_queue_id(i)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    return list(ids)


def shard_of(queue_id: str, count: int) -> int:
    """The shard that holds ``queue_id``. Raises BadRequest (not an id) or NoSuchMessage (no such shard)."""
    try:
        shard, _ = parse_queue_id(queue_id)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if shard >= count:
        raise NoSuchMessage(f"no queued message with id {queue_id} (the relay has no shard {shard})")
    return shard


def _list(shards: Shards, req: dict[str, Any]) -> dict[str, Any]:
    """One page, oldest first over every shard: each shard's oldest after the cursor, merged.

    Memory: a page per shard. The cursor is the last message's place in the
    order (arrival, shard, id), which every shard can compare its own
    messages with (``mta.admin.queue_ops``).
    """
    limit = int(req["limit"])
    try:
        parse_cursor(req.get("cursor"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    found: list[Any] = []
    more = False
    total = total_bytes = 0
    for k, c in shards:
        answer = ask_shard(c, k, req)
        found += answer["messages"]
        more = more or answer["next"] is not None
        total += answer["total"]
        total_bytes += answer["total_bytes"]
    found.sort(key=_place)
    page = found[:limit]
    more = more or len(found) > limit
    nxt = format_cursor(_place(page[-1])) if more and page else None
    return {"ok": True, "messages": page, "next": nxt, "total": total, "total_bytes": total_bytes}


def _place(message: dict[str, Any]) -> Cursor:
    """A listed message's place in the order over every shard: (arrival in ms, shard, id)."""
    shard, mid = parse_queue_id(message["id"])
    return round(message["arrival"] * 1000), shard, mid  # seconds with 3 decimals, exact in a double


def _shape(shards: Shards, req: dict[str, Any]) -> dict[str, Any]:
    """Sum the shards' tables by domain, then keep the ``top`` largest (the rest as ``(others)``).

    ``totals`` is qshape's TOTAL row: each column summed over every domain, so
    a message to two domains counts in both rows and twice in it, as in qshape.
    """
    top = int(req.get("top") or 20)
    table: dict[str, list[int]] = {}
    buckets: list[Any] = []
    for k, c in shards:
        answer = ask_shard(c, k, {**req, "top": SHAPE_TOP_PER_SHARD})
        buckets = answer["buckets"]
        for row in answer["rows"]:
            counts = table.setdefault(row["domain"], [0] * len(row["counts"]))
            for i, n in enumerate(row["counts"]):
                counts[i] += n
    others = table.pop("(others)", None)
    rows = sorted(table.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    for _, counts in rows[top:]:
        others = [a + b for a, b in zip(others, counts, strict=True)] if others else list(counts)
    out = [{"domain": d, "total": sum(c), "counts": c} for d, c in rows[:top]]
    if others:
        out.append({"domain": "(others)", "total": sum(others), "counts": others})
    columns = [sum(column) for column in zip(*(row["counts"] for row in out), strict=True)] or [0] * len(buckets)
    return {"ok": True, "buckets": buckets, "rows": out, "totals": {"total": sum(columns), "counts": columns}}


def _change_all(shards: Shards, req: dict[str, Any]) -> dict[str, Any]:
    """hold/release/delete/flush: each id to its shard; a flush of everything to every shard."""
    ids: list[str] = req.get("ids") or []
    if not ids:  # a selection (or a flush of every deferred message): counts from every shard
        merged: dict[str, Any] = {"ok": True, "done": 0, "skipped": 0, "failed": 0, "errors": {}}
        for k, c in shards:
            answer = ask_shard(c, k, req)
            for key in ("done", "skipped", "failed"):
                value = answer.get(key) or 0
                merged[key] += value if isinstance(value, int) else len(value)
            merged["errors"].update(answer["errors"])
        return merged
    by_shard: dict[int, list[str]] = {}
    for i in ids:
        by_shard.setdefault(shard_of(i, len(shards)), []).append(i)
    merged = {"ok": True, "done": [], "skipped": [], "errors": {}}
    for k, some in sorted(by_shard.items()):
        answer = ask_shard(shards[k][1], k, {**req, "ids": some})
        merged["done"] += answer["done"]
        merged["skipped"] += answer["skipped"]
        merged["errors"].update(answer["errors"])
    return merged
