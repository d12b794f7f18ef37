"""The scheduler's cost of shaping: delivery msg/s with 1,000 rules and 10,000 destinations, against none.

    .venv/bin/python tools/bench/shaping_bench.py [--messages 4000] [--runs 3] [--producers 20]

Three variants, alternated run by run on the same machine: ``off``
(``[shaping] enabled = false``: no shaper), ``empty`` (a shaper with an
empty table) and ``full`` (100 providers matched by MX suffix, each with a
connection total, messages per connection and a rate far above what the run
reaches, and 1,000 rules: 10 on every domain, 990 on the providers, none of
which the replies match). Each message goes to one of 10,000 recipient
domains (``dN.bench.test``, N random), routed by MX, so the scheduler meets
every destination. By default the shaper has classified every domain before
the run (as a relay that has run a while has); ``--cold``: none, so each
first message to a domain waits for its MX lookup (a local function: DNS is
not what is measured). The transport answers at once: 95 %
``250``, 5 % ``451 4.3.0`` (deferred to a retry class past the run), so the
rules' matching runs on every refusal. The producers enqueue with the real
spool (fsync, group commit). The variants take turns at going first. The last line is one JSON object
with the medians, their ratios against ``off``, and the median of each
run's ratios (``pair_median_full_vs_empty``: the rules' and destinations'
cost over a shaper with no rules).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import common
import trio
from common import fmt, median, say

from mta.config import parse_config
from mta.delivery.scheduler import Scheduler
from mta.delivery.transport import BeforeDot, Destination, Job, OnOutcome
from mta.observe.metrics import Metrics
from mta.shaping.adapt import Adaptive
from mta.shaping.gate import Shaper
from mta.shaping.table import ShapingTable, load_table
from spool.aio.async_spool import AsyncSpool
from spool.config.engine import SpoolConfig
from spool.format.record import Outcome, Status

BODY = (b"Subject: bench\r\n\r\n" + b"x" * 76 + b"\r\n") * 13  # about 1 KiB
DOMAINS = 10_000
PROVIDERS = 100


class InstantMx:
    """Answers every recipient at once, as a provider's host of the domain would: no I/O."""

    PASSES_DOT = True

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        hop = f"mx.p{hash(destination.target) % PROVIDERS}.bench[127.0.0.1]:25"
        out = []
        for job in jobs:
            if random.random() < 0.05:
                out.append([Outcome(r, Status.DEFERRED, 451, "4.3.0", "try again later", hop) for r in job.recipients])
            else:
                out.append([Outcome(r, Status.DELIVERED, 250, "2.0.0", "ok", hop) for r in job.recipients])
        return out


def full_table(path: str) -> ShapingTable:
    lines = []
    for p in range(PROVIDERS):
        lines += [f"[provider.p{p}]", f'mx_suffix = [".p{p}.bench"]', "connections = 50",
                  "messages_per_connection = 100", 'rate = "100000/s"', ""]
    for i in range(1000):
        applies = "*" if i < 10 else f"provider:p{i % PROVIDERS}"
        lines += ["[[rule]]", f'name = "r{i}"', f'applies_to = "{applies}"', "code = 421",
                  f"text = 'unusual rate {i}|TS{i:04d}'", "threshold = 2", 'window = "1h"', 'action = "suspend"',
                  'duration = "1h"', ""]
    file = os.path.join(path, "shaping.toml")
    with open(file, "w") as f:
        f.write("\n".join(lines))
    table = load_table(False, file)
    assert len(table.rules) == 1000 and len(table.providers) == PROVIDERS
    return table


async def mx_of(domain: str) -> Sequence[str]:
    return [f"mx.p{hash(domain) % PROVIDERS}.bench"]


async def cycle(path: str, variant: str, messages: int, producers: int, warm: bool) -> dict[str, float]:
    os.makedirs(path, exist_ok=True)
    cfg = parse_config(f'[spool]\ndir = "{path}/spool"\nretry_intervals = ["1h"]\n[routes]\n"*" = "mx"\n',
                       base_dir=path)
    shaper = None
    if variant != "off":
        table = full_table(path) if variant == "full" else ShapingTable()
        shaper = Shaper(table, Adaptive(table.rules), cfg.delivery.per_destination,
                        cfg.delivery.max_messages_per_connection, mx_of)
    asp = await AsyncSpool.open(f"{path}/spool", SpoolConfig())
    done = 0
    all_done = trio.Event()

    def observe(_qid: str, _o: Outcome) -> None:
        nonlocal done
        done += 1
        if done >= messages:
            all_done.set()

    rng = random.Random(7)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(asp.run)
            if shaper is not None and warm:  # a running relay's: every domain's MX hosts already looked up
                for i in range(DOMAINS):
                    await shaper.classify(f"d{i}.bench.test")
            sched = Scheduler(asp, cfg, {"mx": InstantMx()}, Metrics(), shaper=shaper)
            sched.observers.append(observe)
            await nursery.start(sched.run)
            left = messages

            async def producer() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await asp.enqueue("alice@example.org", [f"bob@d{rng.randrange(DOMAINS)}.bench.test"], BODY)

            cpu0, t0 = time.process_time(), time.perf_counter()
            async with trio.open_nursery() as ps:
                for _ in range(producers):
                    ps.start_soon(producer)
            await all_done.wait()
            dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            nursery.cancel_scope.cancel()
    finally:
        asp.core.close()
    return {"mps": messages / dt, "cpu_us_per_msg": cpu / messages * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=4000, help="messages per run (default 4000)")
    ap.add_argument("--runs", type=int, default=3, help="runs per variant, alternated (default 3)")
    ap.add_argument("--producers", type=int, default=20, help="concurrent producers (default 20)")
    ap.add_argument("--cold", action="store_true", help="no domain classified before the run: each first message "
                    "to a domain waits for its MX lookup (the first minutes after a start)")
    args = ap.parse_args()
    common.exit_on_sigterm()
    variants = ("off", "empty", "full")
    say(f"shaping cost, {args.messages} messages to {DOMAINS} domains per run, {args.runs} runs, "
        f"{args.producers} producers; {common.cpu_model()}; load {common.load_average()}; code {common.ROOT}")
    res: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(args.runs):
        for v in variants[r % 3:] + variants[:r % 3]:  # each variant first, second and third in turn
            with common.temp_dir(f"shaping-{v}") as d:
                out = trio.run(cycle, d, v, args.messages, args.producers, not args.cold)
            res[v].append(out)
            say(f"  run {r + 1} {v}: {fmt(out['mps'])} msg/s, {out['cpu_us_per_msg']:.0f} CPU-us/msg")
    result: dict[str, Any] = {"messages": args.messages, "runs": args.runs, "cold": args.cold,
                              "loadavg_end": common.load_average()}
    for v, outs in res.items():
        for k in outs[0]:
            result[f"{k}_{v}"] = round(median([o[k] for o in outs]), 3)
    for v in ("empty", "full"):
        result[f"ratio_{v}_vs_off"] = round(result[f"mps_{v}"] / result["mps_off"], 3)
    # Per run, the variants ran side by side: the median of those ratios is what a shared machine cannot blur.
    for a, b in (("empty", "off"), ("full", "off"), ("full", "empty")):
        pairs = [x["mps"] / y["mps"] for x, y in zip(res[a], res[b], strict=True)]
        result[f"pair_median_{a}_vs_{b}"] = round(median(pairs), 3)
        say(f"  {a}/{b} per run: {', '.join(f'{p:.2f}' for p in pairs)}; median {median(pairs):.2f}")
    common.emit_json(result)


if __name__ == "__main__":
    main()
