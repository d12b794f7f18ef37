"""Helpers shared by the benchmarks in tools/bench/ (not part of the installed package).

Benchmarks, never timed tests: each figure is the median of several runs on a
shared, noisy machine, and the runs of competing variants are interleaved so
that a burst of load from elsewhere hits them alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}


def _fstype(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (longest matching mount point)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def bench_root() -> str:
    """A directory on a real disk: $BENCH_DIR, else the temp dir, else /var/tmp (never tmpfs)."""
    for cand in (os.environ.get("BENCH_DIR"), tempfile.gettempdir(), "/var/tmp"):
        if cand and os.path.isdir(cand) and _fstype(os.path.realpath(cand)) not in _MEMORY_FS:
            return cand
    raise SystemExit("no directory on a real disk for the benchmark (set BENCH_DIR)")


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=f"logspool-{prefix}-", dir=bench_root())
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def peak_rss_mb() -> float:
    """Peak resident set size of this process image in MiB.

    ``VmHWM`` from /proc, not ``ru_maxrss``: Linux carries ``ru_maxrss`` across
    fork and exec, so a child started by a big parent reports the parent's
    peak (the spool_bench recovery children showed 59 MB or 101 MB depending on
    what the parent had built). ``VmHWM`` belongs to the new image alone.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def drop_cache(path: str) -> None:
    """Evict one file's pages from the page cache (after it is synced): a cold read of it, not of the machine."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree_cache(root: str) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            drop_cache(os.path.join(dirpath, name))


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def cpu_model() -> str:
    """``Model name`` from lscpu (with family/model, which tell EPYC generations apart), else /proc/cpuinfo."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    name = fields.get("Model name")
    if name:
        extra = [f"family {fields['CPU family']}" if "CPU family" in fields else "",
                 f"model {fields['Model']}" if "Model" in fields else "",
                 fields.get("Hypervisor vendor", "")]
        return f"{name} ({', '.join(x for x in extra if x)})" if any(extra) else name
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "?"


def machine() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "fs": _fstype(os.path.realpath(bench_root())),
        "bench_dir": bench_root(),
        "loadavg_start": load_average(),
    }


def fmt(value: float, digits: int = 0) -> str:
    if value != value:  # NaN
        return "-"
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table (Markdown pipe syntax, so it can be pasted into docs)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    out = [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def exit_on_sigterm() -> None:
    """SIGTERM ends the benchmark through SystemExit, so temp dirs are removed."""
    import signal

    def _exit(_sig: int, _frame: Any) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, _exit)


def say(*args: Any) -> None:
    print(*args, flush=True)


def emit_json(obj: dict[str, Any]) -> None:
    """The last line of a benchmark's output: one JSON object."""
    print(json.dumps(obj, sort_keys=True), flush=True)
