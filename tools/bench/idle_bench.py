"""CPU and wake-ups of an idle relay: ``mta serve`` with the embedded defaults, nothing to do.

    .venv/bin/python tools/bench/idle_bench.py [--seconds 10] [--runs 3]

Why: a relay spends most of its life idle, and anything it does then (timers
firing, re-reading the log, checkpoints that change nothing) is also the fixed
cost under every message at low rates. Each run starts a relay in a fresh temp
dir (listening on a free loopback port, everything else the built-in
defaults), waits for its "listening" line and a short settling time, then reads
utime+stime from /proc/PID/stat and the context switches of its main thread
over ``--seconds``. The last line is one JSON object with the medians.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

import common
from common import median, say

TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15)


def switches(pid: int) -> int:
    """Context switches of the main thread, where the event loop runs: one per wake-up at least.

    (Worker threads come and go, and their counts with them.)"""
    total = 0
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def one_run(seconds: float, settle: float) -> dict[str, float]:
    with common.temp_dir("idle") as d:
        conf = os.path.join(d, "logspool.toml")
        with open(conf, "w") as f:
            f.write(f'[server]\nlisten = ["127.0.0.1:{free_port()}"]\n')
        env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
        proc = subprocess.Popen([sys.executable, "-c", "from mta.cli import main; main()", "serve", "--config", conf],
                                cwd=d, env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            deadline = time.monotonic() + 60
            for line in proc.stderr:
                if "listening on" in line:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit("the relay did not start within 60 s")
            else:
                raise SystemExit(f"the relay exited with status {proc.wait()} before listening")
            time.sleep(settle)
            c0, s0, t0 = cpu_seconds(proc.pid), switches(proc.pid), time.monotonic()
            time.sleep(seconds)
            c1, s1, t1 = cpu_seconds(proc.pid), switches(proc.pid), time.monotonic()
        finally:
            proc.kill()
            proc.wait()
    dt = t1 - t0
    return {"cpu_pct": (c1 - c0) / dt * 100, "cpu_ms_per_s": (c1 - c0) / dt * 1000, "switches_per_s": (s1 - s0) / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time per run (default 10)")
    ap.add_argument("--settle", type=float, default=3.0, help="wait after the relay listens (default 3)")
    ap.add_argument("--runs", type=int, default=3, help="runs (default 3)")
    args = ap.parse_args()
    common.exit_on_sigterm()
    say(f"idle relay, {args.runs} runs of {args.seconds:g} s; load {common.load_average()}; code {common.ROOT}")
    outs: list[dict[str, Any]] = []
    for r in range(args.runs):
        out = one_run(args.seconds, args.settle)
        outs.append(out)
        say(f"  run {r + 1}: {out['cpu_pct']:.2f}% of a core, {out['switches_per_s']:.1f} context switches/s")
    result: dict[str, Any] = {k: round(median([o[k] for o in outs]), 3) for k in outs[0]}
    result["loadavg_end"] = common.load_average()
    common.emit_json(result)


if __name__ == "__main__":
    main()
