"""spoolctl salvage: time, CPU and peak memory to copy a queue of N messages into a new spool.

    .venv/bin/python tools/bench/salvage_bench.py [--messages 10000,100000] [--runs 3] [--json FILE]

Why: salvage is offline and one-off, but an operator waits for it with the
relay stopped, and its survey keeps one entry per queued message (unlike the
relay, whose memory does not grow with the queue). This says how long the
wait is and how much memory it takes. Benchmarks, never timed tests
(docs/benchmarks.md).

The spool is built once per size in a child process through the engine's
API: batches of 2,000 two-recipient messages with 2 KB bodies, each batch
claimed, three in four deferred for one recipient (a replacement envelope of
class 1), one in four delivered, in 4 MiB segments; then a checkpoint. Each
run salvages it (page cache dropped first) into a fresh directory in a fresh
child process. Reported: the median wall and CPU time, messages per second,
and the child's peak RSS. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import common

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status
from spool.tools.salvage import salvage

SEGMENT_SIZE = 4 << 20
RCPTS = ("b@example.net", "c@example.net")


def config() -> SpoolConfig:
    return SpoolConfig(checkpoint_interval=math.inf, segment_size=SEGMENT_SIZE)


def child_build(path: str, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    sp = Spool.open(path, config())
    body = b"x" * 2000
    done = 0
    try:
        while done < n:
            k = min(2000, n - done)
            sp.enqueue_many([("a@example.org", RCPTS, body)] * k)
            attempts = sp.poll_due(now=time.time() + 1, limit=k)
            for i, a in enumerate(attempts):
                first = Status.DELIVERED if i % 4 == 0 else Status.DEFERRED
                sp.record_delivery(a, [Outcome(RCPTS[0], first, 451, "4.0.0", "later", "mx"),
                                       Outcome(RCPTS[1], Status.DELIVERED, 250, "2.0.0", "ok", "mx")])
            sp.commit()
            for a in attempts:
                sp.finish(a)
            sp.commit()
            done += k
        sp.checkpoint()
    finally:
        sp.close()
    log = os.path.join(path, "log")
    size = sum(os.path.getsize(os.path.join(log, f)) for f in os.listdir(log))
    return {"build_s": time.perf_counter() - t0, "bytes": size, "segments": len(os.listdir(log))}


def child_salvage(src: str, dst: str) -> dict[str, Any]:
    c0, t0 = time.process_time(), time.perf_counter()
    report = salvage(src, dst, SpoolConfig(segment_size=SEGMENT_SIZE))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"salvage_s": wall, "cpu_s": cpu, "copied": report.copied, "complete": report.complete,
            "peak_rss_mb": common.peak_rss_mb()}


def _child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=3600,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", default="10000,100000", help="queue sizes, comma-separated")
    ap.add_argument("--runs", type=int, default=3, help="salvages per size (median)")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    ap.add_argument("--child-build", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-salvage", nargs=2, metavar=("DIR", "NEWDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    common.exit_on_sigterm()
    if args.child_build:
        common.emit_json(child_build(args.child_build[0], int(args.child_build[1])))
        return
    if args.child_salvage:
        common.emit_json(child_salvage(*args.child_salvage))
        return
    rows = []
    results = []
    for n in (int(x) for x in args.messages.split(",")):
        with common.temp_dir("salvage") as d:
            built_dir = os.path.join(d, "built")
            built = _child("--child-build", built_dir, str(n))
            common.say(f"built {common.fmt(n)} messages ({common.fmt(n * 3 // 4)} queued) in {built['build_s']:.1f} s: "
                       f"{built['bytes'] / 2**20:.0f} MiB in {built['segments']} segments")
            runs = []
            for r in range(args.runs):
                new_dir = os.path.join(d, "new")
                shutil.rmtree(new_dir, ignore_errors=True)
                common.drop_tree_cache(built_dir)
                o = _child("--child-salvage", built_dir, new_dir)
                assert o["complete"], o
                runs.append(o)
                common.say(f"  salvage {r + 1}: {o['salvage_s']:.2f} s ({o['cpu_s']:.2f} s CPU), {o['copied']} "
                           f"copied, peak RSS {o['peak_rss_mb']:.0f} MiB (load {common.load_average()})")
        res = {"messages": n, "queued": runs[0]["copied"], "build": built,
               **{k: common.median([o[k] for o in runs]) for k in ("salvage_s", "cpu_s", "peak_rss_mb")}}
        res["per_s"] = res["queued"] / res["salvage_s"]
        results.append(res)
        rows.append([common.fmt(res["queued"]), f"{built['bytes'] / 2**20:.0f} MiB", f"{res['salvage_s']:.2f} s",
                     f"{res['cpu_s']:.2f} s", common.fmt(res["per_s"]), f"{res['peak_rss_mb']:.0f} MiB"])
    common.say(common.table(["queued messages", "log", "wall", "CPU", "messages/s", "peak RSS"], rows))
    result = {"runs": args.runs, "results": results, "machine": common.machine()}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    common.emit_json(result)


if __name__ == "__main__":
    main()
