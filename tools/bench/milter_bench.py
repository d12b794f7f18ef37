"""Messages/s through rspamd: logspool with rspamd as a milter, logspool with rspamd over HTTP, Postfix with rspamd
as a milter; same rspamd, same machine, same run, alternated.

    .venv/bin/python tools/bench/milter_bench.py                    # 20 sessions, 4 KB, 1000 messages, 3 reps
    .venv/bin/python tools/bench/milter_bench.py --messages 500 --reps 3 --sessions 20 --size 4096

Needs root, Postfix (``postfix``, ``smtp-source``, ``smtp-sink``), rspamd and
the relay in ``.venv/bin/mta``. One rspamd (its normal worker for HTTP, its
proxy worker in milter mode; the config of ``tests/support/rspamd_support.py``)
serves all three. For each rep the three are run in turn (A B C, A B C, ...)
with ``smtp-source`` (one connection per message) against each, and each
MTA's own smtp-sink counts what it delivered:

- accepted msg/s: messages / smtp-source's wall time (every message went
  through rspamd before its 250);
- end-to-end msg/s: messages / time until the MTA's sink counted them all;
- CPU ms per message of the MTA's process tree, and of rspamd's (the scanner's share).

Medians of the reps; ratios are logspool/Postfix of the medians. The last
line is the JSON of the whole run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.join(ROOT, "tests", "support"))  # the rspamd config the tests use
from common import cpu_model  # noqa: E402
from postfix_instance import PostfixInstance, check_installed  # noqa: E402
from relay_vs_postfix import Logspool, Sink, free_port, measure, tree_cpu_seconds  # noqa: E402
from rspamd_support import Rspamd, start_rspamd  # noqa: E402


class MilterPostfix(PostfixInstance):
    """The benchmarks' private Postfix, with ``smtpd_milters`` pointing at rspamd's proxy."""

    def __init__(self, base: str, port: int, sink_port: int, milter: str) -> None:
        super().__init__(base, port, sink_port)
        self.milter = milter

    def write_config(self) -> None:
        super().write_config()
        with open(os.path.join(self.config_dir, "main.cf"), "a") as f:
            # No reverse lookup of the client, as logspool does none: rspamd then sees the same `unknown` name
            # from both (with a name it looks it up, and this machine has no DNS to give).
            f.write(f"smtpd_milters = {self.milter}\nmilter_default_action = tempfail\nmilter_protocol = 6\n"
                    "smtpd_peername_lookup = no\n")


def logspool_with(base: str, sink_port: int, filters: str, sessions: int) -> Logspool:
    os.makedirs(base)
    ls = Logspool(base, free_port(), sink_port, sessions)
    with open(ls.config, "a") as f:
        f.write("\n[filters]\n" + filters + "\n")
    return ls


def run(args: argparse.Namespace) -> dict[str, Any]:
    missing = check_installed()
    if missing:
        raise SystemExit("milter_bench: missing " + ", ".join(missing))
    with tempfile.TemporaryDirectory(prefix="milter-bench-") as tmp:
        os.chmod(tmp, 0o755)  # Postfix's daemons (user postfix) must reach their queue and data dirs
        os.makedirs(os.path.join(tmp, "rspamd"))
        rspamd: Rspamd = start_rspamd(Path(tmp) / "rspamd")
        sinks: dict[str, Sink] = {}
        mtas: dict[str, Any] = {}
        try:
            for name in ("logspool_milter", "logspool_http", "postfix_milter"):
                sinks[name] = Sink(free_port())
            milter = f"inet:{rspamd.milter_port}@127.0.0.1"
            mtas["logspool_milter"] = logspool_with(os.path.join(tmp, "ls-milter"), sinks["logspool_milter"].port,
                                                    f'smtp_milters = ["{milter}"]\nmilter_command_timeout = "2m"',
                                                    args.sessions)
            mtas["logspool_http"] = logspool_with(os.path.join(tmp, "ls-http"), sinks["logspool_http"].port,
                                                  f'rspamd_url = "{rspamd.url}"', args.sessions)
            os.makedirs(os.path.join(tmp, "postfix"))
            pf = MilterPostfix(os.path.join(tmp, "postfix"), free_port(), sinks["postfix_milter"].port,
                               f"inet:127.0.0.1:{rspamd.milter_port}")
            for ls in (mtas["logspool_milter"], mtas["logspool_http"]):
                ls.start(pythonpath=ROOT)  # this tree's relay, whichever checkout the venv was installed from
            pf.start()
            mtas["postfix_milter"] = pf
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in mtas}
            for rep in range(args.reps):
                for name, mta in mtas.items():
                    root = mta.pid if name != "postfix_milter" else pf.master_pid
                    assert root is not None
                    port = mta.port
                    assert rspamd.daemon.proc is not None
                    scanner0 = tree_cpu_seconds(rspamd.daemon.proc.pid)
                    got = measure(root, sinks[name], port, args.size, args.sessions, args.messages, args.timeout)
                    scanner = tree_cpu_seconds(rspamd.daemon.proc.pid) - scanner0
                    got["rspamd_cpu_ms_per_msg"] = round(1000 * scanner / args.messages, 3)
                    print(f"rep {rep + 1} {name}: {got['accepted_per_s']} accepted/s, {got['e2e_per_s']} e2e/s",
                          file=sys.stderr)
                    runs[name].append(got)
        finally:
            for mta in mtas.values():
                mta.stop()
            for sink in sinks.values():
                sink.stop()
            rspamd.daemon.stop()
    medians = {name: {key: statistics.median(r[key] for r in rs if r.get(key) is not None)
                      for key in ("accepted_per_s", "e2e_per_s", "cpu_ms_per_msg", "rspamd_cpu_ms_per_msg")}
               for name, rs in runs.items()}
    pf_med = medians["postfix_milter"]
    return {
        "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "cpu": cpu_model(),
        "cpus": os.cpu_count(), "sessions": args.sessions, "size": args.size, "messages": args.messages,
        "reps": args.reps, "medians": medians,
        "ratio_vs_postfix": {name: {k: round(v / pf_med[k], 2) for k, v in m.items() if pf_med[k]}
                             for name, m in medians.items() if name != "postfix_milter"},
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    doc = run(args)
    for name, m in doc["medians"].items():
        print(f"{name:16} accepted {m['accepted_per_s']:8.1f} msg/s   end-to-end {m['e2e_per_s']:8.1f} msg/s   "
              f"CPU {m['cpu_ms_per_msg']:6.2f} ms/msg (rspamd {m['rspamd_cpu_ms_per_msg']:6.2f})")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
