"""A body for a delivery worker: sent over the socketpair, or read by the worker from the spool by position?

    .venv/bin/python tools/bench/worker_body_bench.py --sizes 4096,102400 --messages 2000 --runs 5

Both ways on the same spool and a real socketpair, the relay's side in the main
thread and the worker's in another, each timed on its own thread's CPU clock
(``time.thread_time``: other processes' load does not show):

- ``pipe``: the relay takes the body's chunks (from the spool's body cache,
  as a fresh message's are) into the batch frame; the worker decodes it.
- ``position``: the batch frame carries the DATA records' positions; the
  worker decodes it and reads each record from the segment file (pread of the
  header and payload, checksum verified: ``spool.format.segment.read_frame_at``),
  with the segment's descriptor kept open.

Prints µs of CPU per message on each side, the median of the runs
(docs/benchmarks.md, "Delivery workers").
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from mta.delivery.worker_protocol import FrameReader, encode  # noqa: E402
from spool.engine.spool import Spool  # noqa: E402
from spool.fileio import OsFileIO  # noqa: E402
from spool.format.record import pos_offset, pos_segment  # noqa: E402
from spool.format.segment import read_frame_at, segment_path  # noqa: E402

HEADER = ["100000020", "sender@example.org", ["rcpt@example.net"], 0, {}]


def worker_side(sock: socket.socket, count: int, log_dir: str | None, out: dict[str, float]) -> None:
    io = OsFileIO()
    fds: dict[int, int] = {}
    reader = FrameReader()
    got = 0
    start = time.thread_time()
    while got < count:
        data = sock.recv(1 << 20)
        if not data:
            break
        for message in reader.feed(data):
            got += 1
            body = message[3][0][1]
            if log_dir is not None:  # positions: read every DATA record from its segment
                for pos in body:
                    seg = pos_segment(pos)
                    if seg not in fds:
                        fds[seg] = io.open_read(segment_path(log_dir, seg))
                    frame = read_frame_at(io, fds[seg], segment_path(log_dir, seg), seg, pos_offset(pos))
                    assert frame.payload
    out["worker_s"] = time.thread_time() - start
    for fd in fds.values():
        io.close(fd)


def one_run(way: str, bodies: list[tuple[tuple[bytes, ...], tuple[int, ...]]], log_dir: str) -> dict[str, float]:
    ours, theirs = socket.socketpair()
    out: dict[str, float] = {}
    thread = threading.Thread(target=worker_side, args=(theirs, len(bodies), log_dir if way == "position" else None,
                                                        out))
    thread.start()
    start = time.thread_time()
    for chunks, positions in bodies:
        item = list(chunks) if way == "pipe" else list(positions)
        ours.sendall(encode(["batch", 1, ["smtp", "127.0.0.1:25", "opportunistic"], [[HEADER, item]]]))
    relay_s = time.thread_time() - start
    thread.join()
    ours.close()
    theirs.close()
    n = len(bodies)
    return {"relay_us": round(1e6 * relay_s / n, 2), "worker_us": round(1e6 * out["worker_s"] / n, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 102400])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="worker-body-") as work:
        spool = Spool.open(os.path.join(work, "spool"))
        for size in args.sizes:
            body = (b"x" * 76 + b"\r\n") * (size // 78 + 1)
            body = body[:size]
            appended = [spool.append_message("s@example.org", ["r@example.net"], body)
                        for _ in range(args.messages)]
            spool.commit()
            bodies = [(tuple(spool.read_chunk(p) for p in a.body), a.body) for a in appended]
            runs: dict[str, list[dict[str, float]]] = {"pipe": [], "position": []}
            for r in range(args.runs):
                for way in (("pipe", "position") if r % 2 == 0 else ("position", "pipe")):
                    runs[way].append(one_run(way, bodies, os.path.join(work, "spool", "log")))
            results[str(size)] = {way: {k: statistics.median(x[k] for x in rs) for k in ("relay_us", "worker_us")}
                                  for way, rs in runs.items()}
            print(f"{size} bytes: {json.dumps(results[str(size)])}", flush=True)
    print(json.dumps({"args": vars(args), "results": results, "loadavg": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
