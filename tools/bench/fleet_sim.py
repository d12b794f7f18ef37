"""A simulated fleet's archive: N relays' spools, written by the spool engine over simulated time.

    .venv/bin/python tools/bench/fleet_sim.py DIR [--relays 10] [--messages 1000000] [--hours 24] [--jobs 2]

Why: the report is for operators of many relays, so its benchmark needs the
archive such a fleet leaves, with the engine's own records (envelopes, bodies,
starts, deliveries, finishes, replacement envelopes of the next retry class,
DSNs for bounces) in the proportions real traffic gives, not a synthetic
record stream. Each relay ``DIR/mxNN`` is a real spool (``spool.engine.spool.Spool``,
its clock injected) with ``archive_dir`` set, so finished segments move to
``DIR/mxNN/archive/`` at checkpoints, as on a relay that keeps its archive for
the report; ``mta report --input DIR/mx01 ... --input DIR/mx10`` (or
``--input 'DIR/mx*'``) reads them all.

The traffic: ``--messages`` in all over ``--hours`` of arrivals (a daily
curve, busier in the day), 1 to 4 recipients (most 1), bodies of 1 to 30 KB
(log-normal, mostly small). Each recipient domain answers as such a domain
does (:data:`DOMAINS`): most at once; some greylist the first try; one rate-
limits at random; a mailbox-full domain defers twice; one is down, so its mail
expires after the queue lifetime; a few percent of recipients are unknown
(550 5.1.1) or refused as spam (554 5.7.1) anywhere. Bounced and expired mail
gets its DSN (sender ``<>``) queued and delivered like any message. Retries
after 5, 15, 30, 60 and 120 minutes, a queue lifetime of 8 hours (a real relay
keeps 5 days; 8 hours makes the expiry show within a day's simulation), and
the simulation runs an hour past the last arrival, so some mail is still
queued at the end. Commits and checkpoints are the engine's real ones (fsync
included): a relay of 20,000 messages took 18-34 s here (2026-11-27, two at
once on 2 cores), so 200,000 in all 113 s with ``--jobs 2``.

The last line of output is JSON: per relay, messages, records, segments and
bytes; and the build time.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC
STEP_S = 60.0
RETRY_INTERVALS = (300.0, 900.0, 1800.0, 3600.0, 7200.0)
LIFETIME_S = 8 * 3600.0
SEGMENT_SIZE = 16 * 1024 * 1024

Answer = tuple[Status, int, str, str]
DELIVERED: Answer = (Status.DELIVERED, 250, "2.0.0", "OK queued as {id}")


def _always(answer: Answer) -> Callable[[int, random.Random], Answer]:
    return lambda _attempt, _rng: answer


def _first(n: int, answer: Answer) -> Callable[[int, random.Random], Answer]:
    """Deferred with ``answer`` for the first ``n`` attempts, then delivered."""
    return lambda attempt, _rng: answer if attempt < n else DELIVERED


def _random(p: float, answer: Answer) -> Callable[[int, random.Random], Answer]:
    return lambda _attempt, rng: answer if rng.random() < p else DELIVERED


# domain -> (weight, how it answers the attempt-th try)
DOMAINS: dict[str, tuple[float, Callable[[int, random.Random], Answer]]] = {
    "gmail.example": (30, _always(DELIVERED)),
    "outlook.example": (18, _random(0.04, (Status.DEFERRED, 421, "4.7.0", "too many connections, slow down"))),
    "yahoo.example": (10, _random(0.08, (Status.DEFERRED, 421, "4.7.0", "temporarily deferred, rate limited"))),
    "corp.example": (8, _always(DELIVERED)),
    "isp-a.example": (7, _first(1, (Status.DEFERRED, 451, "4.7.1", "greylisted, try again later"))),
    "isp-b.example": (6, _first(1, (Status.DEFERRED, 450, "4.2.0", "greylisted"))),
    "uni.example": (5, _always(DELIVERED)),
    "shop.example": (5, _always(DELIVERED)),
    "full.example": (2, _first(2, (Status.DEFERRED, 452, "4.2.2", "mailbox full"))),
    "slow.example": (2, _first(2, (Status.DEFERRED, 421, "4.4.2", "timeout reading banner"))),
    "gone.example": (1, _always((Status.DEFERRED, 0, "4.4.1", "connection refused"))),
}
UNKNOWN_USER: Answer = (Status.BOUNCED, 550, "5.1.1", "user unknown")
SPAM: Answer = (Status.BOUNCED, 554, "5.7.1", "message rejected as spam")
P_UNKNOWN, P_SPAM = 0.025, 0.005
SENDER_DOMAINS = ("news.example", "billing.example", "corp.example", "forum.example", "alerts.example")


def _arrivals(rng: random.Random, n: int, hours: float) -> list[float]:
    """``n`` arrival times over ``hours``, sorted, denser in the day than at night (a daily sine)."""
    out: list[float] = []
    span = hours * 3600.0
    while len(out) < n:
        t = rng.uniform(0, span)
        if rng.random() < 0.6 + 0.4 * math.sin(2 * math.pi * ((t / 86400.0) - 0.25)):
            out.append(T0 + t)
    out.sort()
    return out


def simulate_relay(directory: str, seed: int, messages: int, hours: float) -> dict[str, Any]:
    """One relay's spool at ``directory``; returns its counts."""
    rng = random.Random(seed)
    clock = [T0]
    config = SpoolConfig(segment_size=SEGMENT_SIZE, retry_intervals=RETRY_INTERVALS, max_queue_lifetime=LIFETIME_S,
                         archive_dir=os.path.join(directory, "archive"), clock=lambda: clock[0])
    names = list(DOMAINS)
    weights = [w for w, _ in DOMAINS.values()]
    arrivals = _arrivals(rng, messages, hours)
    end = T0 + hours * 3600.0 + 3600.0
    sp = Spool.open(directory, config)
    counts = {"messages": 0, "dsns": 0, "attempts": 0}
    next_arrival = 0
    steps = 0
    t_start = time.perf_counter()
    try:
        while clock[0] < end:
            batch = []
            while next_arrival < len(arrivals) and arrivals[next_arrival] <= clock[0]:
                next_arrival += 1
                n = rng.choices((1, 2, 3, 4), (70, 18, 8, 4))[0]
                rcpts = sorted({f"u{rng.randrange(5000)}@{rng.choices(names, weights)[0]}" for _ in range(n)})
                sender = f"s{rng.randrange(200)}@{rng.choice(SENDER_DOMAINS)}"
                size = min(30_000, int(rng.lognormvariate(7.6, 0.8)))
                batch.append((sender, rcpts, rng.randbytes(16) * (size // 16)))
            if batch:
                sp.enqueue_many(batch)
                counts["messages"] += len(batch)
            sp.commit()
            dsns = []
            for attempt in sp.poll_due(clock[0]):
                outcomes = []
                failed = []
                for r in attempt.remaining:
                    domain = r.rsplit("@", 1)[1]
                    if attempt.expired:
                        outcomes.append(Outcome(r, Status.EXPIRED, 0, "4.4.7", "message expired", ""))
                        failed.append(r)
                        continue
                    draw = rng.random()
                    if attempt.envelope.attempts == 0 and draw < P_UNKNOWN:
                        status, code, enh, reply = UNKNOWN_USER
                    elif attempt.envelope.attempts == 0 and draw < P_UNKNOWN + P_SPAM:
                        status, code, enh, reply = SPAM
                    elif domain in DOMAINS:
                        status, code, enh, reply = DOMAINS[domain][1](attempt.envelope.attempts, rng)
                    else:
                        status, code, enh, reply = DELIVERED
                    if status == Status.BOUNCED:
                        failed.append(r)
                    outcomes.append(Outcome(r, status, code, enh, reply.format(id=f"{rng.getrandbits(40):010X}"),
                                            f"mx.{domain}"))
                sp.record_delivery(attempt, outcomes, duration_ms=int(rng.lognormvariate(5.5, 0.9)))
                sp.finish(attempt)
                counts["attempts"] += 1
                if failed and attempt.envelope.sender:  # a DSN to the sender, as the relay's bounce code does
                    dsns.append(("", [attempt.envelope.sender], b"DSN " * rng.randrange(300, 900)))
            if dsns:
                sp.enqueue_many(dsns)
                counts["dsns"] += len(dsns)
            sp.commit()
            steps += 1
            if steps % 30 == 0:
                sp.checkpoint()
            clock[0] += STEP_S
        sp.commit()
        sp.checkpoint()
    finally:
        sp.close()
    files = [os.path.join(d, f) for d in (os.path.join(directory, "log"), os.path.join(directory, "archive"))
             if os.path.isdir(d) for f in os.listdir(d) if f.endswith(".seg")]
    return {"relay": os.path.basename(directory), **counts, "segments": len(files),
            "bytes": sum(os.path.getsize(f) for f in files), "build_s": round(time.perf_counter() - t_start, 1)}


def _one(args: tuple[str, int, int, float]) -> dict[str, Any]:
    return simulate_relay(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="an empty directory (or a new one) for the relays' spools")
    ap.add_argument("--relays", type=int, default=10)
    ap.add_argument("--messages", type=int, default=1_000_000, help="messages in all (DSNs come on top)")
    ap.add_argument("--hours", type=float, default=24.0, help="simulated hours of arrivals")
    ap.add_argument("--jobs", type=int, default=1, help="relays simulated at once (processes)")
    ap.add_argument("--seed", type=int, default=16)
    args = ap.parse_args()
    if os.path.isdir(args.dir) and os.listdir(args.dir):
        raise SystemExit(f"fleet_sim: {args.dir} is not empty (the spools would mix with old ones)")
    os.makedirs(args.dir, exist_ok=True)
    per = [args.messages // args.relays + (1 if i < args.messages % args.relays else 0) for i in range(args.relays)]
    tasks = [(os.path.join(args.dir, f"mx{i + 1:02d}"), args.seed * 1000 + i, per[i], args.hours)
             for i in range(args.relays)]
    t0 = time.perf_counter()
    results = []
    with multiprocessing.Pool(args.jobs) as pool:
        for r in pool.imap_unordered(_one, tasks):
            print(f"fleet_sim: {r['relay']}: {r['messages']} messages, {r['dsns']} DSNs, {r['attempts']} attempts, "
                  f"{r['segments']} segments, {r['bytes'] / 1e6:.0f} MB in {r['build_s']} s", file=sys.stderr,
                  flush=True)
            results.append(r)
    results.sort(key=lambda r: r["relay"])
    print(json.dumps({"dir": args.dir, "relays": results, "messages": sum(r["messages"] for r in results),
                      "build_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
