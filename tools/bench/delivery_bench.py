"""The whole life of a message in the engine: durable enqueue, claim, delivery, outcome, finish.

    .venv/bin/python tools/bench/delivery_bench.py [--messages 600] [--levels 1,10,100] [--runs 3] [--gap-ms 0]

Why beside spool_bench's enqueue figures: at one session a message costs not
only its enqueue's fsync but the commit of its claim (START), of its DELIVERY
record, and whatever the FINISH and garbage marks trigger. Here ``c``
producers each enqueue one message at a time (as ``c`` SMTP sessions would,
4 KiB bodies), the relay's real ``Scheduler`` delivers them to the ``discard``
transport, and the run ends when the last outcome is durable. ``--gap-ms``
makes each producer pause between its messages, as an SMTP client's round
trips do (then commits of the delivery side cannot share the producers'). All fsync,
fdatasync and directory fsync calls of the engine are counted (checkpoints
included, at the relay's default interval), and the bytes it read back.
The last line is one JSON object with the medians.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import common
import trio
from common import fmt, median, say

from mta.config import parse_config
from mta.delivery.local import DiscardTransport
from mta.delivery.scheduler import Scheduler
from mta.observe.metrics import Metrics
from spool.aio.async_spool import AsyncSpool
from spool.config.engine import SpoolConfig
from spool.fileio import OsFileIO
from spool.format.record import Outcome, Status

BODY = (b"Subject: bench\r\n\r\n" + b"x" * 76 + b"\r\n") * 52  # about 4 KiB


class CountingIO(OsFileIO):
    """The real file operations, counted (a benchmark's probe, not a fake)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.read_bytes = 0

    def fsync(self, fd: int) -> None:
        self.syncs += 1
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self.syncs += 1
        super().fdatasync(fd)

    def fsync_dir(self, path: str) -> None:
        self.syncs += 1
        super().fsync_dir(path)

    def read(self, fd: int, size: int, offset: int) -> bytes:
        data = super().read(fd, size, offset)
        self.read_bytes += len(data)
        return data


async def cycle(path: str, concurrency: int, messages: int, gap: float) -> dict[str, float]:
    cfg = parse_config(f'[spool]\ndir = "{path}"\n[routes]\n"bench.test" = "discard"\n', base_dir=path)
    io = CountingIO()
    asp = await AsyncSpool.open(path, SpoolConfig(), io)
    delivered = 0
    all_done = trio.Event()

    def observe(_qid: str, o: Outcome) -> None:
        nonlocal delivered
        if o.status is Status.DELIVERED:
            delivered += 1
            if delivered >= messages:
                all_done.set()

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(asp.run)
            sched = Scheduler(asp, cfg, {"discard": DiscardTransport()}, Metrics())
            sched.observers.append(observe)
            await nursery.start(sched.run)
            left = messages

            async def producer() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await asp.enqueue("alice@example.org", ["bob@bench.test"], BODY)
                    if gap:
                        await trio.sleep(gap)

            s0, r0 = io.syncs, io.read_bytes
            cpu0, t0 = time.process_time(), time.perf_counter()
            async with trio.open_nursery() as producers:
                for _ in range(concurrency):
                    producers.start_soon(producer)
            await all_done.wait()
            dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            syncs, read = io.syncs - s0, io.read_bytes - r0
            nursery.cancel_scope.cancel()
    finally:
        asp.core.close()
    return {"mps": messages / dt, "syncs_per_msg": syncs / messages, "cpu_us_per_msg": cpu / messages * 1e6,
            "read_bytes_per_msg": read / messages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=600, help="messages per run (default 600)")
    ap.add_argument("--levels", default="1,10,100", help="producer concurrency levels (default 1,10,100)")
    ap.add_argument("--runs", type=int, default=3, help="runs per level, interleaved (default 3)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="pause of each producer between messages (default 0)")
    args = ap.parse_args()
    common.exit_on_sigterm()
    levels = [int(x) for x in args.levels.split(",")]
    say(f"delivery cycle, {args.messages} x {len(BODY)} B per run, levels {levels}, {args.runs} runs, "
        f"gap {args.gap_ms:g} ms; load {common.load_average()}; code {common.ROOT}")
    res: dict[int, list[dict[str, float]]] = {c: [] for c in levels}
    for r in range(args.runs):
        for c in levels:
            with common.temp_dir(f"cycle{c}") as d:
                spool_dir = os.path.join(d, "spool")
                out = trio.run(cycle, spool_dir, c, args.messages, args.gap_ms / 1000)
            res[c].append(out)
            say(f"  run {r + 1} c={c}: {fmt(out['mps'])} msg/s, {out['syncs_per_msg']:.3f} syncs/msg, "
                f"{out['cpu_us_per_msg']:.0f} CPU-us/msg, {fmt(out['read_bytes_per_msg'])} B read/msg")
    result: dict[str, Any] = {"messages": args.messages, "gap_ms": args.gap_ms, "loadavg_end": common.load_average()}
    for c, outs in res.items():
        for k in outs[0]:
            result[f"{k}_c{c}"] = round(median([o[k] for o in outs]), 3)
    common.emit_json(result)


if __name__ == "__main__":
    main()
