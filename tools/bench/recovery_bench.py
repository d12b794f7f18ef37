"""Recovery with a working suffix to scan: the open after a crash with attempts in flight.

    .venv/bin/python tools/bench/recovery_bench.py [--messages 50000] [--runs 9] [--json FILE]

Why: ``backlog_bench.py`` measures the open of a checkpointed queue, which
reads almost nothing (the checkpoint's working suffix is empty after a clean
stop). This one measures the other end: a crash with no usable checkpoint, so
recovery finds the end of the log, syncs it and scans every record (the
reader's verifying walk), re-applies garbage marks, and replaces every
attempt that was in flight. Benchmarks, never timed tests (docs/benchmarks.md).

The spool is built once in a child process through the engine's API: batches
of 2,000 two-recipient messages with 2 KB bodies, each batch claimed, half of
the attempts given a DEFERRED outcome for one recipient, nine in ten
finished and one in ten left in flight, in 4 MiB segments; then the
checkpoint is removed. Each run opens a fresh copy of it (pages evicted from
the page cache first) in a fresh child process. Reported: the median open
time, wall and CPU, and what recovery read and did (``RecoveryStats``). The
last line printed is one JSON object.
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

SEGMENT_SIZE = 4 << 20
RCPTS = ("b@example.net", "c@example.net")


def config() -> SpoolConfig:
    return SpoolConfig(checkpoint_interval=math.inf, segment_size=SEGMENT_SIZE)


def child_build(path: str, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    sp = Spool.open(path, config())
    body = b"x" * 2000
    done = in_flight = 0
    try:
        while done < n:
            k = min(2000, n - done)
            sp.enqueue_many([("a@example.org", RCPTS, body)] * k)
            attempts = sp.poll_due(now=time.time() + 1, limit=k)
            for i, a in enumerate(attempts):
                if i % 2 == 0:
                    sp.record_delivery(a, [Outcome(RCPTS[0], Status.DEFERRED, 451, "4.0.0", "later", "mx")])
            sp.commit()
            for i, a in enumerate(attempts):
                if i % 10:
                    sp.finish(a)
                else:
                    in_flight += 1
            sp.commit()
            done += k
    finally:
        sp.close()
    os.unlink(os.path.join(path, "checkpoint"))
    log = os.path.join(path, "log")
    size = sum(os.path.getsize(os.path.join(log, f)) for f in os.listdir(log))
    return {"build_s": time.perf_counter() - t0, "bytes": size, "segments": len(os.listdir(log)),
            "in_flight": in_flight}


def child_open(path: str) -> dict[str, Any]:
    c0, t0 = time.process_time(), time.perf_counter()
    sp = Spool.open(path, config())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = sp.recovery_stats
    sp.close()
    return {"open_s": wall, "cpu_s": cpu, "records_read": st.records_read, "bytes_read": st.bytes_read,
            "in_flight": st.in_flight, "replacements": st.replacements, "marks": st.marks, "syncs": st.syncs}


def _child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=3600,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=50_000, help="messages in the log (one in ten in flight)")
    ap.add_argument("--runs", type=int, default=9, help="opens (median)")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    ap.add_argument("--child-build", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-open", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    common.exit_on_sigterm()
    if args.child_build:
        common.emit_json(child_build(args.child_build[0], int(args.child_build[1])))
        return
    if args.child_open:
        common.emit_json(child_open(args.child_open))
        return
    with common.temp_dir("recovery") as d:
        built_dir = os.path.join(d, "built")
        built = _child("--child-build", built_dir, str(args.messages))
        common.say(f"built {common.fmt(args.messages)} messages in {built['build_s']:.1f} s: "
                   f"{built['bytes'] / 2**20:.0f} MiB in {built['segments']} segments, "
                   f"{built['in_flight']} attempts in flight, no checkpoint")
        opens = []
        for r in range(args.runs):
            run_dir = os.path.join(d, "run")
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(built_dir, run_dir)
            common.drop_tree_cache(run_dir)
            o = _child("--child-open", run_dir)
            opens.append(o)
            common.say(f"  open {r + 1}: {o['open_s'] * 1000:.0f} ms ({o['cpu_s'] * 1000:.0f} ms CPU), read "
                       f"{o['records_read']} records / {o['bytes_read'] / 2**20:.0f} MiB, {o['in_flight']} in "
                       f"flight, {o['syncs']} syncs (load {common.load_average()})")
    result = {"messages": args.messages, "runs": args.runs, "build": built, "machine": common.machine(),
              **{k: common.median([o[k] for o in opens]) for k in ("open_s", "cpu_s")},
              **{k: opens[0][k] for k in ("records_read", "bytes_read", "in_flight", "replacements", "marks")}}
    common.say(f"recovery of {common.fmt(args.messages)} messages with no checkpoint: median "
               f"{result['open_s'] * 1000:.0f} ms wall, {result['cpu_s'] * 1000:.0f} ms CPU")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    common.emit_json(result)


if __name__ == "__main__":
    main()
