"""The report's figures computed in plain Python, for the tests to compare.

This reads the segments with the spool's own log reader (not the Spark
data source) and follows the definitions in mta/report/job.py's docstring with
dictionaries and lists, so that a mistake in a Spark join or aggregation shows
up as a difference.
"""

from __future__ import annotations

import bisect
import glob
import math
import os
from collections import Counter, defaultdict
from typing import Any

import attrs

from mta.bounce_class import Classifier, default_rules
from mta.report.figures import (
    CLASSED_NAMES,
    LATENCY_EDGES_S,
    LATENCY_LABELS,
    PERCENTILES,
    QSHAPE_EDGES_MIN,
    QSHAPE_LABELS,
    STATUS_NAMES,
    TOP_N,
    DomainRow,
    Figures,
    QueueShapeRow,
)
from spool.fileio import OsFileIO
from spool.format.record import Delivery, Envelope, Finish, RecordType, Start, StartKind, decode_payload, make_pos
from spool.format.segment import SEGMENT_HEADER_SIZE, parse_segment_name
from spool.read.reader import LogReader


@attrs.frozen
class Rec:
    relay: str
    pos: int
    rtype: int
    time: int
    payload: Any


def plain_records(spool_dirs: dict[str, str], ends: dict[str, int] | None = None) -> list[Rec]:
    """Every non-DATA record of every relay, through the spool's sequential reader.

    ``ends`` stops the reader early in the files it names (path -> offset),
    for a segment a test has torn: the reader would rightly refuse its tail.
    """
    io = OsFileIO()
    out: list[Rec] = []
    for relay, d in sorted(spool_dirs.items()):
        for path in sorted(p for sub in ("log", "archive") for p in glob.glob(os.path.join(d, sub, "*.seg"))):
            seg_id = parse_segment_name(os.path.basename(path))
            assert seg_id is not None
            end = (ends or {}).get(path, os.path.getsize(path))
            reader = LogReader(io, os.path.dirname(path), segments=(seg_id,))
            out.extend(Rec(relay, fr.pos, fr.rtype, fr.time, decode_payload(fr.rtype, fr.payload))
                       for fr in reader.frames(make_pos(seg_id, SEGMENT_HEADER_SIZE), make_pos(seg_id, end))
                       if fr.rtype != RecordType.DATA)
    return out


def domain(addr: str) -> str:
    return addr.rsplit("@", 1)[-1].lower()


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks, as Spark SQL's exact ``percentile``."""
    s = sorted(values)
    x = (len(s) - 1) * p
    lo, hi = math.floor(x), math.ceil(x)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def reason(a: dict[str, Any]) -> str:
    return " ".join(p for p in (str(a["code"]) if a["code"] else "", a["enhanced"], a["reply"]) if p)


_classes = Classifier(default_rules())


def top(counter: Counter[str]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_N])


def tables(recs: list[Rec], since_ms: int | None = None,
           until_ms: int | None = None) -> dict[str, list[dict[str, Any]]]:
    if until_ms is not None:
        recs = [r for r in recs if r.time * 1000 < until_ms]
    env = {(r.relay, r.pos): r.payload for r in recs if isinstance(r.payload, Envelope)}
    starts = {(r.relay, r.pos): r.payload for r in recs if isinstance(r.payload, Start)}
    attempts: list[dict[str, Any]] = []
    for r in recs:
        if not isinstance(r.payload, Delivery):
            continue
        s = starts.get((r.relay, r.payload.start))
        e = env.get((r.relay, s.envelope)) if s else None
        if s is None or e is None:
            continue
        attempts.extend({"relay": r.relay, "message_id": e.message_id, "time_ms": r.payload.time_ms,
                         "recipient": o.recipient, "domain": domain(o.recipient),
                         "status": STATUS_NAMES[o.status], "code": o.code, "enhanced": o.enhanced,
                         "reply": o.reply, "delay_ms": r.payload.time_ms - e.arrival_ms}
                        for o in r.payload.outcomes)
    times = [max(r.time * 1000, getattr(r.payload, "time_ms", 0)) for r in recs]
    end_ms = until_ms if until_ms is not None else max(times)
    finished = set()
    for r in recs:
        if isinstance(r.payload, Finish) and (r.relay, r.payload.start) in starts:
            finished.add((r.relay, starts[(r.relay, r.payload.start)].envelope))
    by_msg: dict[tuple[str, int], list[int]] = defaultdict(list)
    for (relay, pos), e in env.items():
        by_msg[(relay, e.message_id)].append(pos)
    queue: list[dict[str, Any]] = []
    for (relay, mid), positions in by_msg.items():
        newest = max(positions)
        if (relay, newest) not in finished:
            e = env[(relay, newest)]
            queue.append({"relay": relay, "message_id": mid, "recipients": list(e.recipients), "held": e.held,
                          "age_s": (end_ms - e.arrival_ms) / 1000.0})
    n_tries: Counter[tuple[str, int]] = Counter()
    for (relay, _pos), s in starts.items():
        e = env.get((relay, s.envelope))
        if e is not None and s.kind is StartKind.DELIVERY:
            n_tries[(relay, e.message_id)] += 1
    outcome: dict[tuple[str, int], Counter[str]] = defaultdict(Counter)
    final_ms: dict[tuple[str, int], int] = {}
    for a in attempts:
        key = (a["relay"], a["message_id"])
        outcome[key][a["status"]] += 1
        if a["status"] != "deferred":
            final_ms[key] = max(final_ms.get(key, 0), a["time_ms"])
    qstate = {(q["relay"], q["message_id"]): "held" if q["held"] else "queued" for q in queue}
    messages: list[dict[str, Any]] = []
    for key, positions in by_msg.items():
        first = env[(key[0], min(positions))]
        oc = outcome[key]
        state = qstate.get(key) or next((s for s in ("bounced", "expired", "deleted", "delivered") if oc[s]),
                                        "unknown")
        messages.append({"relay": key[0], "message_id": key[1], "sender": first.sender,
                         "recipients": list(first.recipients), "size": first.body_size,
                         "arrival_ms": first.arrival_ms, "attempts": n_tries[key], "state": state,
                         "final_ms": None if key in qstate else final_ms.get(key)})
    if since_ms is not None:
        messages = [m for m in messages if m["arrival_ms"] >= since_ms]
        attempts = [a for a in attempts if a["time_ms"] >= since_ms]
    return {"messages": messages, "attempts": attempts, "queue": queue}


def figures(recs: list[Rec], since_ms: int | None = None, until_ms: int | None = None) -> Figures:
    t = tables(recs, since_ms, until_ms)
    msgs, att, queue = t["messages"], t["attempts"], t["queue"]
    by_status = Counter(a["status"] for a in att)
    totals = {"received": len(msgs), "recipients": sum(len(m["recipients"]) for m in msgs),
              "bytes": sum(m["size"] for m in msgs), **{s: by_status[s] for s in STATUS_NAMES},
              "deferred_messages": len({(a["relay"], a["message_id"]) for a in att if a["status"] == "deferred"}),
              "queued": len(queue), "held": sum(q["held"] for q in queue)}
    delays = [a["delay_ms"] / 1000.0 for a in att if a["status"] == "delivered"]
    doms = []
    for d in sorted({a["domain"] for a in att}):
        rows = [a for a in att if a["domain"] == d]
        c = Counter(a["status"] for a in rows)
        dl = [a["delay_ms"] / 1000.0 for a in rows if a["status"] == "delivered"]
        doms.append(DomainRow(d, c["delivered"], c["deferred"], c["bounced"], c["expired"],
                              sum(dl) / len(dl) if dl else None, max(dl) if dl else None))
    doms.sort(key=lambda r: (-(r.delivered + r.deferred + r.bounced + r.expired), r.domain))
    hist = [0] * len(LATENCY_LABELS)
    for v in delays:
        hist[bisect.bisect_right(LATENCY_EDGES_S, v)] += 1
    senders: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for m in msgs:
        sd = domain(m["sender"]) if m["sender"] else "<>"
        senders[sd][0] += 1
        senders[sd][1] += m["size"]
    hours: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for m in msgs:
        hours[m["arrival_ms"] // 3_600_000 * 3_600_000][0] += 1
    for a in att:
        if a["status"] == "delivered":
            hours[a["time_ms"] // 3_600_000 * 3_600_000][1] += 1
    cells: dict[str, list[int]] = defaultdict(lambda: [0] * len(QSHAPE_LABELS))
    for q in queue:
        for r in q["recipients"]:
            cells[domain(r)][bisect.bisect_right(QSHAPE_EDGES_MIN, q["age_s"] / 60.0)] += 1
    arrivals = [m["arrival_ms"] for m in msgs]
    last = max([*(a["time_ms"] for a in att), *arrivals], default=None)
    return Figures(
        first_ms=min(arrivals, default=None),
        last_ms=last,
        totals=totals,
        states=dict(Counter(m["state"] for m in msgs)),
        domains=tuple(doms),
        latency=tuple(percentile(delays, p) for p in PERCENTILES) if delays else (None,) * len(PERCENTILES),
        latency_hist=tuple(hist),
        retries=tuple(sorted(Counter(m["attempts"] for m in msgs if m["attempts"] > 0).items())),
        top_deferrals=top(Counter(reason(a) for a in att if a["status"] == "deferred")),
        top_bounces=top(Counter(reason(a) for a in att if a["status"] in ("bounced", "expired"))),
        top_sender_domains=tuple(sorted(((d, n, b) for d, (n, b) in senders.items()),
                                        key=lambda x: (-x[1], x[0]))[:TOP_N]),
        top_recipient_domains=top(Counter(domain(r) for m in msgs for r in m["recipients"])),
        per_hour=tuple((h, rx, dx) for h, (rx, dx) in sorted(hours.items())),
        queue_shape=tuple(sorted((QueueShapeRow(d, sum(c), tuple(c)) for d, c in cells.items()),
                                 key=lambda q: (-q.total, q.domain))),
        errors=(),
        bounce_classes=top(Counter(_classes.classify(a["code"], a["enhanced"], a["reply"]) for a in att
                                   if a["status"] in CLASSED_NAMES)),
    )
