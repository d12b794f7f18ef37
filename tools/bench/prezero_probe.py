"""What a 4 KiB append + fdatasync costs by the kind of space it lands in (docs/benchmarks.md, "Zeroed room").

    .venv/bin/python tools/bench/prezero_probe.py [--count 2000] [--rounds 3] [--dir DIR]

Why: a lone client waits for one whole fdatasync per message. On ext4 an
fdatasync after a write that grows the file must also commit the new size and
extent in the journal; one after an overwrite of blocks that are allocated,
written and whose size is already durable has only the data to write. The
segment writer keeps zeroed, synced room ahead of its position for that
reason (docs/format.md, version 3). Three kinds of space, alternated in
rounds so that other load on the machine falls on each alike:

- ``grow``: appends to a new file (what format version 2 did);
- ``prezeroed``: overwrites a region written with zeros and fdatasynced first;
- ``fallocated``: overwrites a region given by posix_fallocate and fdatasynced
  (unwritten extents: the first write to each converts it, a metadata change).

Prints the median and 90th percentile of one write + fdatasync per kind, as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

BLOCK = 4096


def _prepare(fd: int, kind: str, size: int) -> None:
    if kind == "prezeroed":
        zeros = b"\0" * (1 << 20)
        for off in range(0, size, len(zeros)):
            os.pwrite(fd, zeros[: min(len(zeros), size - off)], off)
        os.fdatasync(fd)
    elif kind == "fallocated":
        os.posix_fallocate(fd, 0, size)
        os.fdatasync(fd)


def run(kind: str, count: int, base: str) -> list[float]:
    """``count`` 4 KiB writes, each followed by fdatasync, into a fresh file prepared as ``kind``."""
    fd, path = tempfile.mkstemp(prefix=f"logspool-prezero-{kind}-", dir=base)
    block = b"\x5a" * BLOCK
    latencies: list[float] = []
    try:
        _prepare(fd, kind, count * BLOCK)
        for i in range(count):
            t0 = time.perf_counter()
            os.pwrite(fd, block, i * BLOCK)
            os.fdatasync(fd)
            latencies.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=2000, help="appends per kind and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to probe (default: the bench root)")
    args = ap.parse_args()
    base = args.dir or common.bench_root()
    kinds = ("grow", "prezeroed", "fallocated")
    got: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            got[k].extend(run(k, args.count, base))
    grow = statistics.median(got["grow"])
    for k in kinds:
        lat = sorted(got[k])
        med = statistics.median(lat)
        print(json.dumps({"kind": k, "n": len(lat), "median_ms": round(1000 * med, 3),
                          "p90_ms": round(1000 * lat[int(0.9 * (len(lat) - 1))], 3),
                          "vs_grow": round(med / grow, 2)}))


if __name__ == "__main__":
    main()
