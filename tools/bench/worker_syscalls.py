"""System calls and CPU per message of the relay process and of its delivery worker, each apart.

    .venv/bin/python tools/bench/worker_syscalls.py [name=DIR ...] [--sessions 1] [--messages 500]

Why: with ``[delivery] processes = "auto"`` a message crosses the
relay's socketpair to its worker and back, and each process's loop wakes for
it; ``strace -f -c`` over the whole tree (relay_vs_postfix.py) mixes the two.
This starts each variant's ``mta serve`` (the default config of
relay_vs_postfix.py, ``[delivery] processes`` as given), sends ``--messages``
with smtp-source, and runs ``strace -f -c`` attached to the relay process and,
separately, to each of its children (the workers), printing every call's count
per message for each. A second, untraced run of the same size gives each
process's CPU ms per message (strace slows the processes it traces).

Each VARIANT is ``name=DIR`` as for relay_ab.py (DIR holds spool/ and mta/); none: this checkout.
Needs root (smtp-sink's -u), strace, smtp-source, smtp-sink.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from postfix_instance import process_tree
from relay_vs_postfix import Logspool, Sink, free_port, log, own_cpu_seconds, smtp_source, stop_process, tool

_LINE = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def traced(pids: list[int], out: str) -> subprocess.Popen[bytes]:
    """``strace -f -c`` attached to ``pids`` (and their threads); returns once every pid is attached."""
    cmd = [tool("strace") or "strace", "-f", "-c", "-o", out]
    for pid in pids:
        cmd += ["-p", str(pid)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    seen, deadline = b"", time.monotonic() + 30
    while time.monotonic() < deadline and seen.count(b"attached") < len(pids) and proc.poll() is None:
        with contextlib.suppress(BlockingIOError, TypeError):
            seen += proc.stderr.read() or b""
        time.sleep(0.05)
    return proc


def stop_trace(proc: subprocess.Popen[bytes], out: str, messages: int) -> dict[str, float]:
    with contextlib.suppress(OSError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        stop_process(proc)
    counts: dict[str, float] = {}
    with contextlib.suppress(OSError), open(out) as f:
        for line in f:
            m = _LINE.match(line)
            if m and m.group(2) != "total":
                counts[m.group(2)] = round(int(m.group(1)) / messages, 2)
    counts["(all)"] = round(sum(counts.values()), 2)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def one(name: str, relay: Logspool, sink: Sink, args: argparse.Namespace, work: str) -> dict[str, Any]:
    workers = [p for p in process_tree(relay.pid) if p != relay.pid]
    # CPU, untraced
    cpu0 = {p: own_cpu_seconds(p) for p in [relay.pid, *workers]}
    base = sink.count
    smtp_source(relay.port, args.sessions, args.messages, args.size, 600)
    sink.wait_for(base + args.messages, 120)
    time.sleep(0.3)
    cpu = {("relay" if p == relay.pid else f"worker {p}"): round(1000 * (own_cpu_seconds(p) - c) / args.messages, 3)
           for p, c in cpu0.items()}
    result: dict[str, Any] = {"cpu_ms_per_msg": cpu}
    for who, pids in (("relay", [relay.pid]), ("workers", workers)):
        if not pids:
            continue
        out = os.path.join(work, f"strace-{name}-{who}.txt")
        proc = traced(pids, out)
        base = sink.count
        smtp_source(relay.port, args.sessions, args.messages, args.size, 600)
        sink.wait_for(base + args.messages, 120)
        time.sleep(0.3)
        result[f"{who} calls/msg"] = stop_trace(proc, out, args.messages)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", help="name=DIR (DIR holds spool/ and mta/)")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--messages", type=int, default=500)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--delivery-processes", default="auto")
    args = ap.parse_args()
    variants = args.variants or ["this=" + os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))]
    work = tempfile.mkdtemp(prefix="worker-syscalls-")
    os.chmod(work, 0o755)
    dp: int | str = args.delivery_processes if args.delivery_processes == "auto" else int(args.delivery_processes)
    try:
        for spec in variants:
            name, _, path = spec.partition("=")
            sink = Sink(free_port())
            base = os.path.join(work, name)
            os.makedirs(base)
            relay = Logspool(base, free_port(), sink.port, args.sessions, 1, dp)
            relay.start(pythonpath=path)
            try:
                count = sink.count
                smtp_source(relay.port, 2, 20, args.size, 300)  # warm-up
                sink.wait_for(count + 20, 300)
                result = one(name, relay, sink, args, work)
                log(f"{name}: {json.dumps(result)}")
                print(json.dumps({"variant": name, "args": vars(args), **result}))
            finally:
                relay.stop()
                sink.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
