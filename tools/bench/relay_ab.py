"""Two (or more) logspool relays from different code trees, A B A B on the same machine: msgs/s and fsyncs/msg.

    .venv/bin/python tools/bench/relay_ab.py base=/tmp/base new=/work/main --sessions 20 --messages 300 --reps 4
    .venv/bin/python tools/bench/relay_ab.py base=/tmp/base new=/work/main --processes 2 --strace 300
    .venv/bin/python tools/bench/relay_ab.py w0=/tmp/new w1=/tmp/new --delivery-processes 0,1
    .venv/bin/python tools/bench/relay_ab.py main=/tmp/main auto=/tmp/new --delivery-processes 0,auto
    .venv/bin/python tools/bench/relay_ab.py plain=/work/main signed=/work/main --dkim signed --size 102400

Each VARIANT is ``name=DIR``: DIR holds the ``spool`` and ``mta`` packages to run (``git archive COMMIT
spool mta | tar -x -C DIR`` makes one), put first on PYTHONPATH of that relay's ``mta serve``. Uses
relay_vs_postfix.py's pieces (same config, smtp-source without -d, smtp-sink, strace -f -c over the
process tree); no Postfix. Runs alternate in order A B, then B A, ...; the ratio line compares the
first two variants pair by pair. Needs root only for smtp-sink's -u; strace for --strace; perf and root
for --perf.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dkim_vs_postfix import add_key, write_key
from relay_vs_postfix import Logspool, Sink, free_port, log, measure, smtp_source, strace_counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="name=DIR (DIR holds spool/ and mta/)")
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--strace", type=int, default=200, help="messages in the strace run (0: none)")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--delivery-processes", type=lambda v: [x if x == "auto" else int(x) for x in v.split(",")],
                    default=None,
                    help="[delivery] processes of each variant in order, comma-separated, a number or auto (default: "
                         "each variant's own default): base=DIR new=DIR --delivery-processes 0,1 runs the same tree "
                         "both ways")
    ap.add_argument("--metrics", action="store_true",
                    help="give each relay a metrics endpoint and add its fsyncs per message to every timed run "
                         "(logspool_fsyncs before and after: no strace, so the timing is the run's own)")
    ap.add_argument("--perf", action="store_true",
                    help="count every fsync and fdatasync on the machine during each timed run (perf stat -a on "
                         "the syscall tracepoints): the relay's and its delivery workers' together, without "
                         "strace's slowdown, so a count that depends on timing (marks gathered into one sync) is "
                         "the run's own; needs a quiet machine, since any other process's syncs count too")
    ap.add_argument("--dkim", type=lambda v: v.split(","), default=[],
                    help="variants (comma-separated names) that sign every message with one RSA-2048 key, as "
                         "dkim_vs_postfix.py's relay does: plain=DIR signed=DIR --dkim signed is signing's cost")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="relay-ab-")
    os.chmod(work, 0o755)
    relays: list[tuple[str, Logspool, Sink]] = []
    metrics_port: dict[str, int] = {}
    try:
        workers: list[int | str | None] = args.delivery_processes or [None] * len(args.variants)
        for spec, delivery_processes in zip(args.variants, workers, strict=True):
            name, _, path = spec.partition("=")
            sink = Sink(free_port())
            base = os.path.join(work, name)
            os.makedirs(base)
            relay = Logspool(base, free_port(), sink.port, args.sessions, args.processes, delivery_processes)
            if name in args.dkim:
                add_key(relay.config, write_key(base)[0])
            if args.metrics:
                metrics_port[name] = free_port()
                with open(relay.config) as f:
                    text = f.read()
                with open(relay.config, "w") as f:
                    listen = f'metrics_listen = "127.0.0.1:{metrics_port[name]}"\n'
                    f.write(text.replace("[server]\n", "[server]\n" + listen, 1))
            relay.start(pythonpath=path)
            relays.append((name, relay, sink))
        for _name, relay, sink in relays:  # warm-up
            count = sink.count
            smtp_source(relay.port, 2, 10, 4096, 300)
            sink.wait_for(count + 10, 300)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in relays}
        for rep in range(args.reps):
            for name, relay, sink in (relays if rep % 2 == 0 else relays[::-1]):
                fsyncs0 = fsyncs(metrics_port[name]) if args.metrics else 0.0
                with machine_syncs(work, args.perf) as counted:
                    r = measure(relay.pid, sink, relay.port, args.size, args.sessions, args.messages, 900)
                if args.perf:
                    r["machine_fsyncs_per_msg"] = round(counted[0] / args.messages, 4)
                if args.metrics:
                    r["fsyncs_per_msg"] = round((fsyncs(metrics_port[name]) - fsyncs0) / args.messages, 4)
                r["loadavg"] = round(os.getloadavg()[0], 1)
                runs[name].append(r)
                log(f"{name} rep {rep + 1}: {r}")
        traced: dict[str, Any] = {}
        for name, relay, sink in relays if args.strace else []:
            traced[name] = strace_counts(relay.pid, sink, relay.port, args.size, args.sessions,
                                         max(args.strace, args.sessions), 900, work)
            log(f"{name} strace: {traced[name]}")
        print(json.dumps({"args": vars(args), "runs": runs, "strace": traced}))
        for name, rs in runs.items():
            e2e = [r["e2e_per_s"] for r in rs if r["e2e_per_s"]]
            cpu = statistics.median(r["cpu_ms_per_msg"] for r in rs) if rs else None
            root = statistics.median(r["cpu_root_ms_per_msg"] for r in rs) if rs else None
            pss = max((r["peak_pss_mb"] for r in rs), default=None)
            print(f"{name}: end-to-end msg/s median {statistics.median(e2e) if e2e else None} runs {e2e}; "
                  f"CPU ms/msg all processes {cpu}, relay process {root}; peak PSS {pss} MB; "
                  f"fsyncs/msg {traced.get(name, {}).get('fsync_per_msg')} {traced.get(name, {}).get('strace_calls')}"
                  + (f"; untraced fsyncs/msg median {statistics.median(r['fsyncs_per_msg'] for r in rs)} "
                     f"runs {[r['fsyncs_per_msg'] for r in rs]}" if args.metrics and rs else "")
                  + (f"; machine fsyncs/msg median {statistics.median(r['machine_fsyncs_per_msg'] for r in rs)} "
                     f"runs {[r['machine_fsyncs_per_msg'] for r in rs]}" if args.perf and rs else ""))
        names = list(runs)
        if len(names) >= 2:
            pairs = [b["e2e_per_s"] / a["e2e_per_s"] for a, b in zip(runs[names[0]], runs[names[1]], strict=True)
                     if a["e2e_per_s"] and b["e2e_per_s"]]
            print(f"end-to-end {names[1]}/{names[0]} per pair {[round(p, 2) for p in pairs]}, "
                  f"median {round(statistics.median(pairs), 2) if pairs else None}")
    finally:
        for _name, relay, sink in relays:
            relay.stop()
            sink.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


@contextlib.contextmanager
def machine_syncs(workdir: str, on: bool) -> Iterator[list[int]]:
    """Count the machine's fsync and fdatasync calls while the block runs (``perf stat -a``, one line each
    100 ms, so its first line says counting has begun); the total lands in the yielded list's one item."""
    counted = [0]
    if not on:
        yield counted
        return
    out = os.path.join(workdir, "perf.csv")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out)
    proc = subprocess.Popen(["perf", "stat", "-a", "-x,", "-I", "100", "-o", out, "-e",
                             "syscalls:sys_enter_fdatasync,syscalls:sys_enter_fsync"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and not _perf_lines(out):
            time.sleep(0.02)
        if proc.poll() is not None or not _perf_lines(out):
            raise RuntimeError("perf stat did not start counting (it needs root and the syscall tracepoints)")
        yield counted
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    counted[0] = sum(int(float(fields[1])) for fields in _perf_lines(out) if fields[1].replace(".", "").isdigit())


def _perf_lines(path: str) -> list[list[str]]:
    """perf's interval lines (time,count,unit,event,...), without its comments."""
    with contextlib.suppress(OSError), open(path) as f:
        return [line.split(",") for line in f if line.lstrip()[:1].isdigit()]
    return []


def fsyncs(port: int) -> float:
    """The relay's ``logspool_fsyncs`` (its fsync and fdatasync calls since start), from its metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("logspool_fsyncs "):
                return float(line.split()[1])
    raise RuntimeError("no logspool_fsyncs in the metrics")


if __name__ == "__main__":
    sys.exit(main())
