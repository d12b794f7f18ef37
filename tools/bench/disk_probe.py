"""How many 4 KiB append + fdatasync calls per second this disk takes, and what CPU this is.

    .venv/bin/python tools/bench/disk_probe.py [--seconds 2] [--dir DIR]

Why: the relay's single-session rate, and how much group commit buys, depend
on the fsync rate more than on anything in the code (4,500/s on one
2-vCPU VM, 6,400/s on another). A figure in docs/benchmarks.md is only
comparable with another taken on a machine of the same fsync rate and CPU, so
every benchmark that quotes MTAs or spools side by side prints both
(``describe_machine``). The probe appends to a fresh file on the benchmark's
disk (``common.bench_root``: never tmpfs), one ``write`` then ``fdatasync`` per
4 KiB block, like a log's commit of one small message; it reports the rate and
the median and 90th-percentile latency of one such commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

BLOCK = 4096


def fsync_probe(seconds: float = 2.0, directory: str | None = None) -> dict[str, float]:
    """fdatasyncs per second of 4 KiB appends to a new file under ``directory`` (the benchmark disk)."""
    base = directory or common.bench_root()
    fd, path = tempfile.mkstemp(prefix="logspool-fsync-probe-", dir=base)
    block = b"\0" * BLOCK
    latencies: list[float] = []
    try:
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            t0 = time.perf_counter()
            os.write(fd, block)
            os.fdatasync(fd)
            t1 = time.perf_counter()
            latencies.append(t1 - t0)
            if t1 >= deadline:
                break
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    latencies.sort()
    return {"fsync_per_s": round(len(latencies) / elapsed),
            "fsync_median_ms": round(1000 * statistics.median(latencies), 3),
            "fsync_p90_ms": round(1000 * latencies[int(0.9 * (len(latencies) - 1))], 3),
            "fsync_probe_s": round(elapsed, 2)}


def describe_machine(seconds: float = 2.0, directory: str | None = None) -> dict[str, Any]:
    """CPU model, cores, load average and the fsync probe: what a benchmark's figures belong to."""
    return {"cpu_model": common.cpu_model(), "cores": os.cpu_count(), "loadavg": common.load_average(),
            **fsync_probe(seconds, directory)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="where the probe file goes (default: the benchmark disk)")
    args = ap.parse_args()
    print(json.dumps(describe_machine(args.seconds, args.dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
