"""One queue request over every spool shard: route it, ask each shard, merge the answers.

Each shard answers for itself (``mta.admin.queue_ops``), through its relay's
control socket if it runs (``mta.admin.client``) or from its spool on disk
if not (``mta.admin.offline``). Here the answers become the one answer an
operator asked for: counts and shapes add up, ``show`` and the changes go to
each id's shard, ``list`` pages through shard 0, then shard 1, ... with a
cursor that names the shard (``mta.shards``).
"""

from __future__ import annotations

import os
from typing import Any

from mta.admin.client import ask_relay
from mta.admin.control import socket_path
from mta.admin.errors import BadRequest, NoSuchMessage, SpoolUnavailable
from mta.admin.offline import answer_offline
from mta.config import Config
from mta.shards import all_shards, format_cursor, parse_cursor, parse_queue_id
from spool import admin

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
    if shard and not os.path.isdir(config.spool.dir):
        return _empty_answer(req)  # configured but never started: it holds nothing
    return answer_offline(config, shard, req)


def _empty_answer(req: dict[str, Any]) -> dict[str, Any]:
    op = req["op"]
    if op == "list":
        return {"messages": [], "next": None}
    if op == "count":
        return {"count": 0}
    if op == "shape":
        return {"buckets": [b if b != float("inf") else None for b in admin.AGE_BUCKETS], "rows": []}
    if op == "show":
        raise NoSuchMessage(f"no queued message with id {req.get('id')}")
    ids = req.get("ids") or []
    return {"done": [] if ids else 0, "skipped": [],
            "errors": {i: f"no queued message with id {i}" for i in ids}}


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
    """One page over the shards in turn (shard 0's messages first, each shard oldest first).

    The cursor names the shard and the position inside it, so paging through
    every shard needs no memory beyond one page.
    """
    limit = int(req["limit"])
    try:
        shard, pos = parse_cursor(req.get("cursor"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    messages: list[Any] = []
    nxt: int | str | None = None
    while shard < len(shards):
        answer = ask_shard(shards[shard][1], shard, {**req, "limit": limit - len(messages), "cursor": pos})
        messages += answer["messages"]
        if answer["next"] is not None:
            nxt = format_cursor(shard, answer["next"])
            break
        shard, pos = shard + 1, None
        if len(messages) >= limit:
            nxt = format_cursor(shard, 0) if shard < len(shards) else None
            break
    return {"ok": True, "messages": messages, "next": nxt}


def _shape(shards: Shards, req: dict[str, Any]) -> dict[str, Any]:
    """Sum the shards' tables by domain, then keep the ``top`` largest (the rest as ``(others)``)."""
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
    return {"ok": True, "buckets": buckets, "rows": out}


def _change_all(shards: Shards, req: dict[str, Any]) -> dict[str, Any]:
    """hold/release/delete/flush: each id to its shard; a flush of everything to every shard."""
    ids: list[str] = req["ids"]
    if not ids:
        answers = [ask_shard(c, k, req) for k, c in shards]
        return {"ok": True, "done": sum(a["done"] for a in answers), "skipped": [], "errors": {}}
    by_shard: dict[int, list[str]] = {}
    for i in ids:
        by_shard.setdefault(shard_of(i, len(shards)), []).append(i)
    merged: dict[str, Any] = {"ok": True, "done": [], "skipped": [], "errors": {}}
    for k, some in sorted(by_shard.items()):
        answer = ask_shard(shards[k][1], k, {**req, "ids": some})
        merged["done"] += answer["done"]
        merged["skipped"] += answer["skipped"]
        merged["errors"].update(answer["errors"])
    return merged
