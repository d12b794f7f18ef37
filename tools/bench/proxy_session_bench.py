"""What the PROXY header costs a session: the same short SMTP sessions on a direct and a ``[proxy]`` listener.

Why: a relay behind a balancer reads a header before every session
(``mta.inbound.proxy_header``) and takes the session slot after it; this
measures whether that shows against the rest of a session. One relay in
this process listens both ways; a client thread opens N connections in a
row, each: (a PROXY v1 or v2 header on the proxy listener), banner, EHLO,
QUIT. Runs alternate direct / v1 / v2, ``--runs`` each; the medians of the
process's CPU time and the ratios to direct are printed. The CPU is the
relay's and the client's together (one process): the ratio is what to quote.

    python tools/bench/proxy_session_bench.py --sessions 400 --runs 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import tempfile
import time

import trio

from mta.config import parse_config
from mta.inbound.proxy_header import V2_SIGNATURE
from mta.process.relay import Relay

CONFIG = """
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
max_sessions_per_client = 1000
[proxy]
listen = ["127.0.0.1:0"]
[spool]
dir = "spool"
[routes]
"*" = "discard"
"""


def header(kind: str, n: int) -> bytes:
    src, sport = f"192.0.2.{n % 250 + 1}", 10000 + n % 50000
    if kind == "v1":
        return f"PROXY TCP4 {src} 127.0.0.1 {sport} 25\r\n".encode()
    if kind == "v2":
        body = socket.inet_aton(src) + socket.inet_aton("127.0.0.1") + struct.pack("!HH", sport, 25)
        return V2_SIGNATURE + b"\x21\x11" + struct.pack("!H", len(body)) + body
    return b""


def sessions(port: int, kind: str, count: int) -> float:
    """CPU seconds of this process (the relay's loop and this client thread) for ``count`` sessions in a row:
    CPU, not wall time, since the machine is shared and wall time swings with the neighbours' load."""
    start = time.process_time()
    for n in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            f = sock.makefile("rb")
            sock.sendall(header(kind, n))
            assert f.readline().startswith(b"220 ")
            sock.sendall(b"EHLO bench.example\r\n")
            while not f.readline().startswith(b"250 "):
                pass
            sock.sendall(b"QUIT\r\n")
            assert f.readline().startswith(b"221 ")
    return time.process_time() - start


async def main(count: int, runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config(CONFIG, source=os.path.join(tmp, "bench.toml"), base_dir=tmp)
        async with trio.open_nursery() as nursery:
            relay: Relay = await nursery.start(Relay(config).run)
            assert relay.server is not None
            direct = relay.ports[0]
            proxied = int(relay.server.proxy_listeners[0].socket.getsockname()[1])
            times: dict[str, list[float]] = {"direct": [], "v1": [], "v2": []}
            for _ in range(runs):
                for kind in times:
                    port = direct if kind == "direct" else proxied
                    times[kind].append(await trio.to_thread.run_sync(sessions, port, kind, count))
            for kind, values in times.items():
                med = statistics.median(values)
                # Each round's ratio to the direct run beside it: the load of the neighbours drifts between rounds.
                ratio = statistics.median(v / d for v, d in zip(values, times["direct"], strict=True))
                print(f"{kind:6} median {med:.3f} CPU s for {count} sessions ({med / count * 1e6:.0f} us each), "
                      f"median ratio to direct in the same round {ratio:.3f}  runs: "
                      f"{', '.join(f'{v:.3f}' for v in values)}")
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, args.sessions, args.runs)
