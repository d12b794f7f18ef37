"""The adaptive state read back from the log: the same outcomes, fed in the same order, give the same overrides.

The relay does this at start (so a restart mid-suspension keeps the
suspension and its end time) and ``mta shape explain`` does it while the
relay runs. Only the log's recent suffix is read: the segments written
within the longest rule's window, duration and ramp (``ShapingTable.span``),
found by their files' modification times (a segment's last write is at or
after its last record's time). Records come through the spool's event
stream (``spool.EventStream``): durable records only, damage named, never a
reason to stop.
"""

from __future__ import annotations

import os
import time as clock

from mta.shaping.adapt import Adaptive
from mta.shaping.reply import remote_reply
from mta.shaping.resolve import provider_of_reply
from mta.shaping.table import ShapingTable
from spool import LOG_DIR, SEGMENT_HEADER_SIZE, EventStream, NotARecord, make_pos, parse_segment_name

__all__ = ["READ_RECORDS", "rebuild", "suffix_start"]

READ_RECORDS = 4096
SLACK = 60.0  # seconds of clock skew between a record's time and its file's modification time


def suffix_start(spool_dir: str, span: float, now: float) -> int | None:
    """The position of the first record of the oldest log segment written within ``span`` seconds of ``now``
    (None: every segment is that recent, read from the oldest record there is)."""
    log_dir = os.path.join(spool_dir, LOG_DIR)
    try:
        names = os.listdir(log_dir)
    except OSError:
        return None
    segments = sorted(seg for seg in (parse_segment_name(n) for n in names) if seg is not None)
    cutoff = now - span - SLACK
    for i, seg in enumerate(segments):
        try:
            mtime = os.stat(os.path.join(log_dir, next(n for n in names if parse_segment_name(n) == seg))).st_mtime
        except OSError:
            continue
        if mtime >= cutoff:
            return None if i == 0 else make_pos(seg, SEGMENT_HEADER_SIZE)
    return make_pos(segments[-1], SEGMENT_HEADER_SIZE) if segments else None


def rebuild(table: ShapingTable, stream: EventStream, spool_dir: str, now: float | None = None) -> Adaptive:
    """The adaptive state as the log's recent outcomes make it, at ``now`` (default: the clock)."""
    now = clock.time() if now is None else now
    adaptive = Adaptive(table.rules)
    if not table.rules:
        return adaptive
    since = suffix_start(spool_dir, table.span, now)
    cutoff_ms = (now - table.span) * 1000
    try:
        batch = stream.read(since=since, max_records=READ_RECORDS)
    except NotARecord:
        batch = stream.read(max_records=READ_RECORDS)
    before = since
    while True:
        for event in batch.events:
            if event.kind not in ("deferred", "bounced") or event.time_ms < cutoff_ms or event.index is None:
                continue
            f = event.fields
            recipient = str(f.get("recipient", ""))
            said = remote_reply(int(f.get("code", 0)), str(f.get("enhanced", "")), str(f.get("reply", "")),
                                str(f.get("next_hop", "")))
            if said is None:
                continue  # the relay's own deferral: never counted
            domain = recipient.rpartition("@")[2].lower()
            adaptive.feed(pos=event.pos, time=event.time_ms / 1000, recipient=recipient, code=said.code,
                          enhanced=said.enhanced, text=said.text, next_hop=said.next_hop,
                          provider=provider_of_reply(table, domain, said.next_hop))
        if batch.after is None or batch.after == before:
            break
        before = batch.after
        batch = stream.read(batch.after, max_records=READ_RECORDS)
    adaptive.expire(now)
    return adaptive
