"""HTTP injection throughput beside SMTP's, same relay, same run: recipients/s and msg/s, durable at each answer.

    PYTHONPATH=. .venv/bin/python tools/bench/inject_bench.py --reps 3

One ``mta serve`` (route ``"*" = "discard"``, so delivery costs little) with
an SMTP listener and ``[http]``. Each rep runs, in turn:

- ``templated``: ``--big`` requests of 1,000 recipients each (a builder with
  a text and an HTML body and a templated subject and header, one
  substitution per recipient), ``--big-clients`` at once, each with an
  ``Idempotency-Key``; recipients/s from the first request sent to the last
  ``200`` (every message durable);
- ``http1``: ``--small`` requests of one recipient from ``--sessions``
  keep-alive connections, without a key (as KumoMTA's clients send them); msg/s;
- ``smtp``: Postfix's smtp-source, ``--sessions`` sessions, ``--small``
  messages of one recipient; msg/s to its last ``250``.

Before each run the queue is drained (``mta queue count``), so that no run
pays for the deliveries of the one before. The order of the three rotates
from rep to rep; medians of the reps, and the
ratio http1/smtp of each rep; and the relay's own CPU time per message
(its process tree, from /proc), which the clients' cost does not enter. The
clients run on the same machine and share its CPUs with the relay (the HTTP
client is Python, smtp-source is C).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import h11
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_model, load_average
from relay_vs_postfix import free_port, smtp_source, tree_cpu_seconds

TOKEN = "bench-token"
MTA = os.path.join(os.path.dirname(sys.executable), "mta")


def config(root: str, smtp_port: int, http_port: int) -> str:
    with open(os.path.join(root, "tokens"), "w") as f:
        f.write(TOKEN + "\n")
    os.chmod(os.path.join(root, "tokens"), 0o600)
    path = os.path.join(root, "relay.toml")
    with open(path, "w") as f:
        f.write(f"""
[server]
listen = ["127.0.0.1:{smtp_port}"]
hostname = "bench.test"
max_sessions = 200
[spool]
dir = "spool"
[delivery]
processes = 0
[routes]
"*" = "discard"
[http]
listen = "127.0.0.1:{http_port}"
tokens_file = "tokens"
max_connections = 64
""")
    return path


def big_request(i: int, n: int) -> bytes:
    return json.dumps({
        "envelope_sender": "bulk@example.org",
        "content": {"from": {"email": "news@example.org", "name": "News"}, "subject": "Hello {{ name }}",
                    "text_body": "Dear {{ name }},\n\nyour code is {{ code }}.\n\n-- \nExample News\n",
                    "html_body": "<p>Dear {{ name }},</p><p>your code is <b>{{ code }}</b>.</p>",
                    "headers": {"X-Campaign": "{{ campaign }}"}},
        "substitutions": {"campaign": f"bench-{i}"},
        "recipients": [{"email": f"r{j}@bench.example", "name": f"Reader {j}", "substitutions": {"code": f"C{j}"}}
                       for j in range(n)]}).encode()


SMALL = json.dumps({"envelope_sender": "one@example.org",
                    "content": "From: one@example.org\nSubject: one\n\n" + "x" * 400 + "\n",
                    "recipients": [{"email": "rcpt@bench.example"}]}).encode()


async def session(port: int, bodies: list[bytes], keyed: bool) -> None:
    """Requests one after another on one keep-alive connection; each must get 200. ``keyed``: each with an
    Idempotency-Key of its own (the intent's fdatasync is then part of what is measured)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        for body in bodies:
            headers = [("Host", "bench"), ("Authorization", f"Bearer {TOKEN}"), ("Content-Length", str(len(body)))]
            if keyed:
                headers.append(("Idempotency-Key", secrets.token_hex(16)))
            head = h11.Request(method="POST", target="/api/inject/v1", headers=headers)
            await stream.send_all(conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            status = 0
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(ev, h11.Response):
                    status = ev.status_code
                elif isinstance(ev, h11.EndOfMessage):
                    break
            if status != 200:
                raise RuntimeError(f"answer {status}")
            conn.start_next_cycle()


async def run_sessions(port: int, per_session: list[list[bytes]], keyed: bool) -> float:
    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        for bodies in per_session:
            nursery.start_soon(session, port, bodies, keyed)
    return time.monotonic() - t0


def templated(port: int, requests: int, clients: int, n: int) -> float:
    bodies = [big_request(i, n) for i in range(requests)]
    per = [bodies[c::clients] for c in range(clients)]
    wall = trio.run(run_sessions, port, per, True)
    return requests * n / wall


def http1(port: int, messages: int, sessions: int) -> float:
    per = [[SMALL] * (messages // sessions) for _ in range(sessions)]
    wall = trio.run(run_sessions, port, per, False)
    return sessions * (messages // sessions) / wall


def drain(path: str, timeout: float = 600) -> None:
    """Until the queue is empty: the messages a run accepted are delivered before the next run is measured."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run([MTA, "queue", "count", "--json", "--config", path], capture_output=True, check=True)
        if json.loads(out.stdout)["count"] == 0:
            return
        time.sleep(0.5)
    raise RuntimeError("the queue did not drain")


def wait_listening(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen = False
    while time.monotonic() < deadline:
        line = proc.stderr.readline().decode(errors="replace")
        if not line:
            raise RuntimeError("the relay exited")
        if "HTTP API listening" in line:
            seen = True
        if seen:
            return
    raise RuntimeError("the relay did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--big", type=int, default=20, help="1,000-recipient requests per rep")
    ap.add_argument("--big-clients", type=int, default=2)
    ap.add_argument("--recipients", type=int, default=1000)
    ap.add_argument("--small", type=int, default=2000, help="one-recipient messages per rep, HTTP and SMTP each")
    ap.add_argument("--sessions", type=int, default=20)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="inject-bench-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
    smtp_port, http_port = free_port(), free_port()
    path = config(root, smtp_port, http_port)
    proc = subprocess.Popen([MTA, "serve", "--config", path], cwd=root, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    results: dict[str, list[float]] = {"templated": [], "http1": [], "smtp": []}
    cpu_us: dict[str, list[float]] = {"templated": [], "http1": [], "smtp": []}  # the relay's CPU per message
    count = {"templated": args.big * args.recipients, "http1": args.small // args.sessions * args.sessions,
             "smtp": args.small}
    ratios = []
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    try:
        wait_listening(proc)
        subprocess.Popen(["cat"], stdin=proc.stderr, stdout=subprocess.DEVNULL)  # keep its pipe drained
        runs: dict[str, Callable[[], float]] = {
            "templated": lambda: templated(http_port, args.big, args.big_clients, args.recipients),
                "http1": lambda: http1(http_port, args.small, args.sessions),
                "smtp": lambda: args.small / smtp_source(smtp_port, args.sessions, args.small, 500, 600)}
        order = list(runs)
        for rep in range(args.reps):
            this = {}
            for name in order[rep % 3:] + order[:rep % 3]:
                drain(path)
                cpu0 = tree_cpu_seconds(proc.pid)
                this[name] = runs[name]()
                cpu_us[name].append((tree_cpu_seconds(proc.pid) - cpu0) / count[name] * 1e6)
                results[name].append(this[name])
                print(f"rep {rep} {name}: {this[name]:.0f}/s, relay CPU {cpu_us[name][-1]:.0f} µs/msg",
                      file=sys.stderr, flush=True)
            ratios.append(this["http1"] / this["smtp"])
    finally:
        proc.kill()
        proc.wait()
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "load": load_average(), "args": vars(args),
        "templated_recipients_per_s": statistics.median(results["templated"]),
        "http1_msgs_per_s": statistics.median(results["http1"]), "smtp_msgs_per_s": statistics.median(results["smtp"]),
        "http1_over_smtp": statistics.median(ratios),
        "relay_cpu_us_per_msg": {k: statistics.median(v) for k, v in cpu_us.items()}, "runs": results}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
