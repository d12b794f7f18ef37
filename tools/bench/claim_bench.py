"""The CPU of one claim at one message a commit: ``Spool.poll_due`` alone, in process, as a lone client drives it.

    .venv/bin/python tools/bench/claim_bench.py [--messages 2000] [--runs 5]
    PYTHONPATH=DIR .venv/bin/python tools/bench/claim_bench.py    # another code tree (DIR holds spool/), run
                                                                  # from a cwd outside the worktree

Why: at one message a connection the relay's loop claims each message alone,
moments after its commit, and the claim's cost (the runners' scan,
the fairness budget, decoding the envelope, the START) is a few tens of
microseconds: too small to see in an end-to-end run, easy to see here. Each
message: append (4 KB body, an ``extra`` like the relay's), commit, then
``poll_due`` timed on the thread's CPU clock, then its DELIVERY and FINISH.
Prints the per-run medians (us a claim) and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status

BODY = b"x" * 4000 + b"\r\n"


def one_run(messages: int) -> float:
    """Microseconds of thread CPU per ``poll_due`` that claimed one message."""
    d = tempfile.mkdtemp(prefix="claim-bench-", dir="/var/tmp")
    try:
        sp = Spool.open(d, SpoolConfig())
        spent = 0.0
        try:
            for _ in range(messages):
                sp.enqueue("a@example.com", ["b@example.net"], BODY, extra={"client": "127.0.0.1"})
                sp.commit()
                t0 = time.thread_time()
                got = sp.poll_due()
                spent += time.thread_time() - t0
                if len(got) != 1:
                    raise SystemExit(f"claimed {len(got)} messages, not 1")
                sp.record_delivery(got[0], [Outcome("b@example.net", Status.DELIVERED, 250)])
                sp.finish(got[0])
        finally:
            sp.close()
        return spent / messages * 1e6
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    runs = [one_run(args.messages) for _ in range(args.runs)]
    print(json.dumps({"benchmark": "claim_bench", "messages": args.messages,
                      "us_per_claim": [round(r, 1) for r in runs], "median": round(statistics.median(runs), 1),
                      "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg())}))


if __name__ == "__main__":
    main()
