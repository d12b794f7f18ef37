"""LMTP into Dovecot: the relay's LMTP transport beside Postfix's smtp-source -L, same server, same run.

    .venv/bin/python tools/bench/lmtp_bench.py [--messages 500] [--reps 3]

One Dovecot LMTP service (tests/support/dovecot_support.py: its own config,
Maildirs in a temporary directory) takes ``--messages`` messages of 4 KB for
a user of its own (a fresh Maildir: Dovecot slows as a mailbox grows), over
one connection, one message after another, from each client in turn,
alternated A B B A ... so the machine's load hits both alike:

- ``logspool``: ``LmtpTransport.deliver`` of one job at a time, its
  connection kept in the cache between calls (as the scheduler drives it);
- ``smtp-source``: Postfix's test client in LMTP mode (``-L``), one session.

Dovecot's own work (its fsyncs into the Maildir) is in both figures, so the
ratio says how much the transport adds to a delivery beside a C client, not
the transport's CPU alone. Messages per second, medians of the runs. Needs
``dovecot`` and ``smtp-source``. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support")]

from common import emit_json, machine, median, say, table  # noqa: E402


def _body() -> bytes:
    return b"From: s@src.test\r\nTo: u@d.test\r\nSubject: lmtp bench\r\n\r\n" + (b"x" * 70 + b"\r\n") * 56


def run_logspool(port: int, messages: int, user: str) -> float:
    """Seconds for ``messages`` deliveries through ``LmtpTransport``."""
    import trio
    from relay_support import relay_config

    from mta.delivery.lmtp_transport import LmtpTransport
    from mta.delivery.transport import Destination, Job

    body = _body()

    async def main() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            target = f"127.0.0.1:{port}"
            transport = LmtpTransport(relay_config(tmp, {"d.test": f"lmtp://{target}"}))
            dest = Destination("lmtp", target, "none")
            job = Job("Q", "s@src.test", (f"{user}@d.test",), [body], len(body))
            async with trio.open_nursery() as nursery:
                await nursery.start(transport.run)
                start = time.perf_counter()
                for _ in range(messages):
                    (outcomes,) = await transport.deliver(dest, [job])
                    assert outcomes[0].code == 250, outcomes
                elapsed = time.perf_counter() - start
                nursery.cancel_scope.cancel()
        return elapsed

    return trio.run(main)


def run_smtp_source(port: int, messages: int, user: str) -> float:
    start = time.perf_counter()
    subprocess.run(["smtp-source", "-L", "-s", "1", "-m", str(messages), "-l", str(len(_body())), "-f", "s@src.test",
                    "-t", f"{user}@d.test", f"127.0.0.1:{port}"], check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from dovecot_support import Dovecot

    info = machine()
    say(f"machine: {info['cpu_model']}, {info['cpus']} CPUs, load {info['loadavg_start']}")
    clients = {"logspool": run_logspool, "smtp-source": run_smtp_source}
    rates: dict[str, list[float]] = {name: [] for name in clients}
    users = tuple(f"u{i}" for i in range(2 * args.reps + 1))
    with tempfile.TemporaryDirectory(prefix="lmtp-bench-") as tmp:
        dovecot = Dovecot(Path(tmp), users)
        dovecot.start()
        try:
            run_logspool(dovecot.port, 20, users[-1])  # warm-up: Dovecot's auth and lmtp processes start
            runs = 0
            for rep in range(args.reps):
                order = list(clients) if rep % 2 == 0 else list(clients)[::-1]
                for name in order:
                    seconds = clients[name](dovecot.port, args.messages, users[runs])
                    runs += 1
                    rates[name].append(args.messages / seconds)
                    say(f"rep {rep + 1} {name}: {args.messages / seconds:.0f} msg/s")
            delivered = [len(dovecot.messages(user)) for user in users[:-1]]
        finally:
            dovecot.stop()
    assert delivered == [args.messages] * (2 * args.reps), f"Dovecot holds {delivered} messages"
    med = {name: median(r) for name, r in rates.items()}
    ratio = med["logspool"] / med["smtp-source"]
    # Each rep's two runs follow each other: their ratio sees the same load, so its median is what to quote.
    pairs = [a / b for a, b in zip(rates["logspool"], rates["smtp-source"])]
    say(table(["client", "msg/s (median)", "runs"],
              [[name, f"{med[name]:.0f}", ", ".join(f"{r:.0f}" for r in rates[name])] for name in clients]))
    say(f"logspool / smtp-source: {ratio:.2f} of the medians; per rep {', '.join(f'{p:.2f}' for p in pairs)}, "
        f"median {median(pairs):.2f}")
    emit_json({"benchmark": "lmtp", "messages": args.messages, "reps": args.reps, "machine": info,
               "msg_per_s": med, "runs": rates, "ratio_logspool_to_smtp_source": round(ratio, 3),
               "paired_ratios": [round(p, 3) for p in pairs], "paired_ratio_median": round(median(pairs), 3),
               "loadavg_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
