"""The cost of the rate limits: one take on the shared counter table, and the relay's msgs/s with limits on.

    .venv/bin/python tools/bench/limits_bench.py [--runs 3] [--takes 20000] [--messages 600] [--sessions 20]

What is measured:

- ``take``: ``mta.limits.table.RateTable.take`` with a MAIL's counters
  (client and sender: two counters), µs per call, against the peer of the
  same run: the same sliding-window arithmetic on a dict in the process's
  memory (what counting in one process alone would cost). The difference is
  the price of sharing: the ``flock`` pair and the struct reads and writes
  in the mapped file. Also: two processes taking on one table at once (the
  lock contended), µs per take in each.
- ``relay``: ``mta serve`` (one process) fed by Postfix's ``smtp-source``
  (``--sessions`` sessions, ``--messages`` messages of 4 KiB, one recipient
  each) delivering to ``smtp-sink``, without ``[limits]`` and with every
  client and sender limit set high enough never to refuse
  (``exempt_mynetworks = false``, so each MAIL and RCPT takes): accepted
  msgs/s and the relay's CPU ms per message, runs alternated off/on.

Each figure is the median of ``--runs`` runs, the variants interleaved. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import relay_vs_postfix
from common import ROOT, load_average, machine, median, table, temp_dir
from relay_vs_postfix import Logspool, Sink, free_port, measure

from mta.limits.table import Counter, RateTable

NOW = 1_800_000_000.0
LIMITS = """
[limits]
client_messages = "100000000/1h"
client_recipients = "100000000/1h"
sender_messages = "100000000/1h"
sender_recipients = "100000000/1h"
exempt_mynetworks = false
"""


def counters(i: int) -> list[Counter]:
    return [Counter(f"client:192.0.2.{i % 250}:messages", 10**9, 3600),
            Counter(f"sender:s{i % 1000}@example.org:messages", 10**9, 3600)]


def time_table(path: str, n: int) -> float:
    """µs per take of a MAIL's two counters on the shared table."""
    table_ = RateTable(path, 65536)
    work = [counters(i) for i in range(n)]
    t0 = time.perf_counter()
    for i, cs in enumerate(work):
        table_.take(cs, NOW + i * 1e-4)
    elapsed = time.perf_counter() - t0
    table_.close()
    return 1e6 * elapsed / n


def time_dict(n: int) -> float:
    """µs per take of the same counters, the same arithmetic, on a dict in this process."""
    slots: dict[bytes, list[int]] = {}
    work = [counters(i) for i in range(n)]
    t0 = time.perf_counter()
    for i, cs in enumerate(work):
        now = NOW + i * 1e-4
        found = []
        for c in cs:
            start = int(now // c.window) * c.window
            slot = slots.get(c.digest)
            if slot is None or slot[0] < start - c.window:
                slot = [start, 0, 0]
            elif slot[0] < start:
                slot = [start, 0, slot[1]]
            covered = 1.0 - min(1.0, (now - start) / c.window)
            if slot[1] + slot[2] * covered + 1 > c.limit:
                break
            found.append((c, slot))
        else:
            for c, slot in found:
                slot[1] += 1
                slots[c.digest] = slot
    return 1e6 * (time.perf_counter() - t0) / n


def _contended(path: str, n: int, out: multiprocessing.Queue[float]) -> None:
    out.put(time_table(path, n))


def time_two_processes(path: str, n: int) -> float:
    """µs per take in each of two processes taking on one table at the same time (median of the two)."""
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[float] = ctx.Queue()
    procs = [ctx.Process(target=_contended, args=(path, n, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    return median(got)


def relay_run(work: str, name: str, limits: bool, sessions: int, messages: int) -> dict[str, Any]:
    sink = Sink(free_port())
    base = os.path.join(work, name)
    os.makedirs(base)
    relay = Logspool(base, free_port(), sink.port, sessions)
    if limits:
        with open(relay.config, "a") as f:
            f.write(LIMITS)
    try:
        relay.start(pythonpath=str(ROOT))  # this tree's code, whichever venv runs it
        return measure(relay.pid, sink, relay.port, 4096, sessions, messages, timeout=600)
    finally:
        relay.stop()
        sink.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--takes", type=int, default=20000)
    ap.add_argument("--messages", type=int, default=600)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--no-relay", action="store_true", help="the table alone")
    args = ap.parse_args()
    if not os.access(os.path.join(relay_vs_postfix.VENV_BIN, "mta"), os.X_OK):  # a worktree without its own venv
        relay_vs_postfix.VENV_BIN = os.path.dirname(sys.executable)
    results: dict[str, list[float]] = {"dict_us": [], "table_us": [], "two_processes_us": []}
    relay: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with temp_dir("limits") as work:
        for run in range(args.runs):
            results["dict_us"].append(time_dict(args.takes))
            results["table_us"].append(time_table(os.path.join(work, f"t{run}"), args.takes))
            results["two_processes_us"].append(time_two_processes(os.path.join(work, f"c{run}"), args.takes))
            if not args.no_relay:
                order = ("off", "on") if run % 2 == 0 else ("on", "off")
                for variant in order:
                    relay[variant].append(relay_run(work, f"{variant}{run}", variant == "on", args.sessions,
                                                    args.messages))
    summary: dict[str, Any] = {k: round(median(v), 3) for k, v in results.items()}
    summary["table_vs_dict"] = round(summary["table_us"] / summary["dict_us"], 2)
    rows = [["a MAIL's take (2 counters)", "dict in the process (peer)", f"{summary['dict_us']:.2f} µs"],
            ["", "shared table (mmap + flock)", f"{summary['table_us']:.2f} µs"],
            ["", "shared table, two processes at once", f"{summary['two_processes_us']:.2f} µs"]]
    if not args.no_relay:
        for variant in ("off", "on"):
            runs = relay[variant]
            summary[f"relay_{variant}_msgs_per_s"] = median([r["accepted_per_s"] for r in runs])
            summary[f"relay_{variant}_cpu_ms_per_msg"] = median([r["cpu_ms_per_msg"] for r in runs])
        summary["relay_on_vs_off"] = round(summary["relay_on_msgs_per_s"] / summary["relay_off_msgs_per_s"], 3)
        pairs = [on["accepted_per_s"] / off["accepted_per_s"] for on, off in zip(relay["on"], relay["off"],
                                                                                    strict=True)]
        summary["relay_on_vs_off_pairs"] = [round(p, 3) for p in pairs]
        rows += [["relay, smtp-source", f"limits {variant}",
                  f"{summary[f'relay_{variant}_msgs_per_s']:.1f} msgs/s, "
                  f"{summary[f'relay_{variant}_cpu_ms_per_msg']:.3f} CPU ms/msg"] for variant in ("off", "on")]
    print(table(["what", "variant", f"median of {args.runs}"], rows))
    summary["machine"] = machine()
    summary["load"] = load_average()
    summary["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
