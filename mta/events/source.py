"""Where the relay's events come from: the stream of one shard's spool, as the relay's config places it.

An event as a consumer sees it is the spool's event (``spool.EventStream``)
with the shard's queue id: the spool names a message by its id inside its
own log, a sharded relay by that id and the shard (``mta.shards``). Event ids
are positions in one shard's log, so each shard is a stream of its own.
"""

from __future__ import annotations

import calendar
import os
import time
from typing import Any

from mta.admin.errors import BadRequest, SpoolNotFound
from mta.bounce_class import Classifier, classifier_for
from mta.config import Config
from mta.shards import id_suffix, shard_config, shard_count
from spool import Event, EventStream, parse_pos

_CLASSED_KINDS = frozenset({"deferred", "bounced", "expired"})


def open_stream(config: Config, shard: int = 0) -> EventStream:
    """The event stream of ``shard``. Raises SpoolNotFound (no such spool) or BadRequest (no such shard)."""
    shards = shard_count(config)
    if not 0 <= shard < shards:
        raise BadRequest(f"no shard {shard}: the relay has {shards} (0..{shards - 1})")
    cfg = shard_config(config, shard, shards)
    if not os.path.isdir(os.path.join(cfg.spool.dir, "log")):
        raise SpoolNotFound(f"spool {cfg.spool.dir}: no log there (has the relay ever run?)")
    return EventStream(cfg.spool.dir, archive_dir=cfg.spool.archive_dir,
                       retry_intervals=cfg.spool.engine().retry_intervals)


def classes_of(config: Config) -> Classifier:
    """The bounce classes ``config`` asks for (``[bounce_classes]``)."""
    return classifier_for(config.bounce_classes.rules_file, config.bounce_classes.defaults)


def event_dict(event: Event, shard: int = 0, classes: Classifier | None = None) -> dict[str, Any]:
    """The event as JSON sends it: the spool's fields, the queue id as the relay names it, and an outcome's
    bounce ``class`` (derived from its recorded reply by ``classes``, the shipped rules if None)."""
    d = event.as_dict()
    if event.kind in _CLASSED_KINDS:
        d["class"] = (classes or classifier_for()).classify(int(d.get("code") or 0), str(d.get("enhanced") or ""),
                                                            str(d.get("reply") or ""))
    if d["queue_id"] is not None and shard:
        d["queue_id"] += id_suffix(shard)
    if shard:
        d["shard"] = shard
    return d


def parse_from(text: str) -> tuple[int | None, int | None]:
    """``--from``: a position (``segment:offset``, an event id, its ``/index`` ignored) or a UTC time
    (``2026-12-02T01:00:00Z``, or seconds since the epoch prefixed with ``@``). Returns (position, time_ms).

    Raises BadRequest naming what is accepted.
    """
    text = text.strip()
    if ":" in text and "T" not in text:
        try:
            return parse_pos(text.split("/", 1)[0]), None
        except ValueError:
            pass
    if text.startswith("@"):
        try:
            return None, int(float(text[1:]) * 1000)
        except ValueError:
            pass
    for shape in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%MZ", "%Y-%m-%d"):
        try:
            return None, calendar.timegm(time.strptime(text, shape)) * 1000
        except ValueError:
            continue
    raise BadRequest(f"--from {text!r}: not a position (1:70) nor a time (2026-12-02T01:00:00Z or @SECONDS)")
