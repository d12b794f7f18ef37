"""CPU of the SMTP transport alone: one 4 KB message per ``deliver`` over a cached connection to smtp-sink.

    .venv/bin/python tools/bench/transport_bench.py [--messages 2000] [--reps 3] [name=DIR ...]

Why beside transaction_split.py: the delivery side's CPU there mixes the
transport with the scheduler, the claims and the commits; this is the
transport's own share (``SmtpTransport.deliver``: connection cache, the client
core, the socket calls), the event loop thread's CPU time per message
(``time.thread_time``), after 50 messages of warm-up. Each ``name=DIR``
(DIR holds ``mta`` and ``spool``, as for relay_ab.py: ``git archive COMMIT
spool mta | tar -x -C DIR``) runs in its own process, alternated A B B A ...,
so the machine's load hits each alike; with none, this checkout. Also prints
the socket sends and receives per message. Needs root (smtp-sink runs as
``postfix``) and ``smtp-sink``. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def child(messages: int) -> None:
    """One measurement in this process: the code tree is whatever ``mta`` imports first (PYTHONPATH)."""
    sys.path.insert(0, HERE)
    import trio
    from relay_vs_postfix import Sink, free_port  # puts this checkout on sys.path: the tree to measure goes first

    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path.append(os.path.join(ROOT, "tests", "support"))
    from relay_support import relay_config

    from mta.delivery import smtp_transport
    from mta.delivery.smtp_transport import SmtpTransport
    from mta.delivery.transport import Destination, Job

    tree = os.environ.get("PYTHONPATH", ROOT).split(os.pathsep)[0]
    assert os.path.abspath(smtp_transport.__file__).startswith(os.path.abspath(tree)), smtp_transport.__file__

    counts = {"send": 0, "receive": 0}
    send_all, receive_some = trio.SocketStream.send_all, trio.SocketStream.receive_some

    async def counted_send(self: trio.SocketStream, data: bytes | bytearray | memoryview) -> None:
        counts["send"] += 1
        await send_all(self, data)

    async def counted_receive(self: trio.SocketStream, max_bytes: int | None = None) -> bytes:
        counts["receive"] += 1
        return await receive_some(self, max_bytes)

    async def run(port: int) -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            transport = SmtpTransport(relay_config(tmp, {"*": f"smtp://127.0.0.1:{port}?tls=none"}))
            dest = Destination("smtp", f"127.0.0.1:{port}", "none")
            body = [b"Subject: transport bench\r\n\r\n" + b"x" * 70 + b"\r\n" * 56]
            job = Job("Q", "sender@src.example", ("rcpt@dst.example",), body, len(body[0]))
            async with trio.open_nursery() as nursery:
                await nursery.start(transport.run)
                for _ in range(50):
                    await transport.deliver(dest, [job])
                trio.SocketStream.send_all, trio.SocketStream.receive_some = counted_send, counted_receive  # type: ignore[method-assign]
                start = time.thread_time()
                for _ in range(messages):
                    await transport.deliver(dest, [job])
                cpu = time.thread_time() - start
                nursery.cancel_scope.cancel()
        return {"us_per_message": round(cpu / messages * 1e6, 1), "sends": counts["send"] / messages,
                "receives": counts["receive"] / messages}

    port = free_port()
    sink = Sink(port)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        print(json.dumps(trio.run(run, port)))
    finally:
        sink.proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", help="name=DIR (DIR holds spool/ and mta/); none: this checkout")
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.messages)
        return 0
    variants = [tuple(v.split("=", 1)) for v in args.variants] or [("this", ROOT)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else variants[::-1]
        for name, tree in order:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--messages",
                                  str(args.messages)], env=env, capture_output=True, text=True, check=True, cwd="/")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[name].append(result)
            print(f"{name} rep {rep + 1}: {result}", flush=True)
    summary = {name: {"us_per_message_median": statistics.median(r["us_per_message"] for r in runs),
                      "runs": [r["us_per_message"] for r in runs], "sends": runs[-1]["sends"],
                      "receives": runs[-1]["receives"]} for name, runs in results.items()}
    for name, s in summary.items():
        print(f"{name}: {s['us_per_message_median']} us of CPU a message (runs {s['runs']}), "
              f"{s['sends']} sends and {s['receives']} receives a message")
    print(json.dumps({"benchmark": "transport", "messages": args.messages, "loadavg": os.getloadavg(),
                      "variants": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
