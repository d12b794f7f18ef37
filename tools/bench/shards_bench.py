"""Relay processes against each other and against Postfix, in one run: what a second core buys.

    /work/main/.venv/bin/python tools/bench/shards_bench.py --sessions 1,20,100 --messages 1500 --reps 3
    /work/main/.venv/bin/python tools/bench/shards_bench.py p1=1 p2=2 p2w=2:1 --sessions 20,100

Each variant is ``name=PROCESSES[:DELIVERY_PROCESSES]`` (``[server] processes`` and ``[delivery]
processes``; no delivery figure: the relay's default). Postfix and every variant run side by side, each
relaying to its own ``smtp-sink`` and driven by ``smtp-source`` (one connection per message), and every
rep runs them all in a rotating order (Postfix, p1, p2; then p1, p2, Postfix; ...), so a burst of load
from elsewhere on a shared machine hits them alike. Ratios are per rep (same rep, adjacent runs) and their
median. fsyncs per message come from a separate ``strace -f -c`` run per variant over its whole tree
(supervisor, shards, workers), as in ``relay_vs_postfix.py``, whose machinery this reuses.

The relay runs the code tree this file is in (``PYTHONPATH``), so a worktree measures itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import relay_vs_postfix as rvp
from common import cpu_model
from postfix_instance import PostfixInstance

TREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variant(text: str) -> tuple[str, int, int | str | None]:
    name, _, spec = text.partition("=")
    procs, _, workers = spec.partition(":")
    delivery: int | str | None = None if not workers else workers if workers == "auto" else int(workers)
    return name, int(procs), delivery


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", default=["p1=1", "p2=2"], help="name=PROCESSES[:DELIVERY_PROCESSES]")
    ap.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 20, 100])
    ap.add_argument("--messages", type=int, default=1500, help="per run (a lone client: a quarter)")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--strace-messages", type=int, default=1000, help="0: no fsync counting runs")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="write the JSON document here too")
    args = ap.parse_args(argv)
    rvp.VENV_BIN = os.path.dirname(sys.executable)  # the interpreter's venv holds `mta`; the tree is PYTHONPATH
    variants = [_variant(v) for v in args.variants]
    work = tempfile.mkdtemp(prefix="shardbench-")
    os.chmod(work, 0o755)
    stops: list[Any] = []
    load0 = os.getloadavg()
    cells: list[dict[str, Any]] = []
    try:
        sink = rvp.Sink(rvp.free_port())
        stops.append(sink.stop)
        pf = PostfixInstance(os.path.join(work, "postfix"), rvp.free_port(), sink.port)
        stops.append(pf.stop)
        pf.start()
        assert pf.master_pid is not None
        mtas: dict[str, tuple[int, rvp.Sink, int]] = {"postfix": (pf.master_pid, sink, pf.port)}
        for name, procs, delivery in variants:
            s = rvp.Sink(rvp.free_port())
            stops.append(s.stop)
            base = os.path.join(work, name)
            os.makedirs(base)
            ls = rvp.Logspool(base, rvp.free_port(), s.port, max(args.sessions), procs, delivery)
            stops.append(ls.stop)
            ls.start(pythonpath=TREE)
            mtas[name] = (ls.pid, s, ls.port)
        for name, (_root, s, port) in mtas.items():  # warm-up
            base_count = s.count
            rvp.smtp_source(port, 2, 20, args.size, args.timeout)
            if s.wait_for(base_count + 20, args.timeout) is None:
                raise RuntimeError(f"{name}: warm-up never reached the sink")
        names = list(mtas)
        for sessions in args.sessions:
            n = max(sessions, args.messages // 4 if sessions == 1 else args.messages)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for rep in range(args.reps):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    root, s, port = mtas[name]
                    r = rvp.measure(root, s, port, args.size, sessions, n, args.timeout)
                    r["loadavg"] = round(os.getloadavg()[0], 1)
                    runs[name].append(r)
                    rvp.log(f"{sessions} sessions rep {rep + 1} {name}: e2e {r['e2e_per_s']}/s, "
                            f"cpu {r['cpu_ms_per_msg']} ms/msg, load {r['loadavg']}")
            cell: dict[str, Any] = {"sessions": sessions, "messages": n, "runs": runs, "median": {}, "ratio": {}}
            for name in names:
                rates = [r["e2e_per_s"] for r in runs[name] if r.get("e2e_per_s")]
                cpu = [r["cpu_ms_per_msg"] for r in runs[name]]
                cell["median"][name] = {"e2e_per_s": statistics.median(rates) if rates else None,
                                        "cpu_ms_per_msg": statistics.median(cpu)}
                if name != "postfix":
                    for peer in ["postfix"] + [v[0] for v in variants if v[0] != name]:
                        paired = [a["e2e_per_s"] / b["e2e_per_s"] for a, b in zip(runs[name], runs[peer], strict=True)
                                  if a.get("e2e_per_s") and b.get("e2e_per_s")]
                        cell["ratio"][f"{name}/{peer}"] = {"paired": [round(x, 3) for x in paired],
                                                           "median": round(statistics.median(paired), 3)
                                                           if paired else None}
            if args.strace_messages:
                for name in names:
                    root, s, port = mtas[name]
                    m = max(args.strace_messages // (4 if sessions == 1 else 1), sessions)
                    st = rvp.strace_counts(root, s, port, args.size, sessions, m, args.timeout, work)
                    cell["median"][name]["fsync_per_msg"] = st["fsync_per_msg"]
                    rvp.log(f"{sessions} sessions strace {name}: {st['strace_calls']}")
            cells.append(cell)
            for key, value in cell["ratio"].items():
                rvp.log(f"{sessions} sessions {key}: median {value['median']} (pairs {value['paired']})")
            for name, med in cell["median"].items():
                rvp.log(f"{sessions} sessions {name}: {med}")
    finally:
        for stop in reversed(stops):
            with contextlib.suppress(Exception):
                stop()
        shutil.rmtree(work, ignore_errors=True)
    doc = {"benchmark": "shards_bench", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
           "cpu_model": cpu_model(), "cpus": len(os.sched_getaffinity(0)), "loadavg_start": load0,
           "loadavg_end": os.getloadavg(), "variants": args.variants, "size": args.size, "cells": cells}
    text = json.dumps(doc, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
