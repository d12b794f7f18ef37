"""A simulation of the relay on N cores, from measured costs: what N spool shards buy, and what one commit stream would.

    /work/main/.venv/bin/python tools/bench/shards_model.py --cpu-ms 1.6 --fsync-ms 0.2 --client-ms 0.9
    /work/main/.venv/bin/python tools/bench/shards_model.py --from-bench run.json --fsync-ms 0.2

Why a simulation: the project's machine has two cores (shared), and the question is what 8 or 16 do. The
inputs are measured (``shards_bench.py``: CPU per message of the relay tree, the lone client's rate; the disk
probe: fdatasync latency); the model is a discrete-event simulation of the parts that decide the figures:

- ``S`` closed-loop SMTP clients (``smtp-source -s S``): a client sends its next message ``client-ms`` after
  its last 250 (its connect and the round trips that cost the relay no CPU);
- each connection goes to a shard chosen at random (SO_REUSEPORT's hash of the 4-tuple);
- ``shards``: N processes, each one event loop (one core, FIFO, ``cpu-ms`` a message: with ``processes`` =
  cores every process's share of the machine is one core) and its own group commit: the committer waits for
  the sessions that announced a commit (``commit_delay`` at most), one fdatasync covers what was appended
  meanwhile; delivery outcomes ride the next enqueue commit of their own shard while a client is connected
  to the relay (``shards-own-count``: to that shard, as before ``mta.process.presence``), within the ride
  bound, else they cost a sync of their own;
- ``shared``: N - 1 acceptor processes (``cpu-ms`` less the log's share ``writer-ms``, plus ``handoff-ms``
  for the hand-over; one acceptor when N = 1) feeding one writer process on the N-th core (``writer-ms`` +
  ``handoff-ms`` a message, serial) that owns the log: one commit stream, so one fdatasync covers every
  shard's messages;
- the disk runs one fdatasync at a time (ext4's journal commits serially; ``--disk-parallel`` lets each
  stream have its own).

It prints msgs/s and fsyncs per message for N = 1..16 and S = 1, 20, 100, and the ratio to the default
today: one relay process whose loop spends ``one-loop-ms`` a message, its deliveries in worker processes on
the other cores. It is a
model: no cache effects, no scheduler, no network stack; it is calibrated by comparing N = 1, 2 with the
measured ones (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

RIDE_MIN, RIDE_MAX = 0.002, 0.05  # seconds: spool.aio.group_commit's bound for outcomes riding an enqueue commit
COMMIT_DELAY = 0.1  # seconds: [spool] commit_delay's default, the group-commit window's bound


@dataclass
class Stream:
    """One commit stream: a log with its committer (a shard's, or the shared writer's)."""

    pending: list[int] = field(default_factory=list)  # clients whose message is appended, waiting for durability
    outcomes: int = 0  # outcome records appended, not durable
    syncing: bool = False
    connected: int = 0
    expected: int = 0  # sessions sent to this stream whose message is not appended yet (announced commits)
    gathering: bool = False
    commits: int = 0
    last_commit: float = 0.0
    interval: float = RIDE_MAX


@dataclass
class Params:
    sessions: int
    processes: int
    cpu: float  # seconds of loop CPU a message (shards) / acceptor + writer (shared)
    fsync: float
    client: float
    shared: bool = False
    writer: float = 0.0
    handoff: float = 0.0
    delivery: float = 0.001  # from the 250 to the outcome record (a delivery to a nearby sink)
    disk_parallel: bool = False
    presence: bool = True  # outcomes see the relay's clients, not only the shard's (mta.process.presence)
    messages: int = 20000
    seed: int = 1


def simulate(p: Params) -> dict[str, float]:
    rng = random.Random(p.seed)
    seq = itertools.count()
    events: list[tuple[float, int, Callable[[float], None]]] = []

    def at(t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(events, (t, next(seq), fn))

    n_streams = 1 if p.shared else p.processes
    streams = [Stream() for _ in range(n_streams)]
    # shared: one of the N cores is the writer's, N - 1 (at least one) run acceptors
    loops = max(1, p.processes - 1) if p.shared else p.processes
    loop_free = [0.0] * loops  # when each shard's (or acceptor's) loop is next free
    writer_free = [0.0]
    disk_free = [0.0] * n_streams if p.disk_parallel else [0.0]
    done = [0]
    fsyncs = [0]
    finish = [0.0]
    acceptor_cpu = max(p.cpu - p.writer, 0.0) + p.handoff if p.shared else p.cpu

    def sync(k: int, t: float, *, cut: bool = False) -> None:
        s = streams[k]
        if s.syncing or not (s.pending or s.outcomes) or not (s.pending or cut):
            return  # outcomes alone wait to ride an enqueue commit, or for their bound (then ``cut``)
        if s.pending and s.expected > 0 and not cut:
            # The group-commit window (spool.aio.group_commit._gather): wait for the announced commits, at most
            # commit_delay.
            if not s.gathering:
                s.gathering = True
                round_ = s.commits

                def window_ends(t2: float) -> None:
                    if s.gathering and s.commits == round_:
                        s.gathering = False
                        sync(k, t2, cut=True)

                at(t + COMMIT_DELAY, window_ends)
            return
        s.gathering = False
        s.syncing = True
        s.commits += 1
        batch, s.pending = s.pending, []
        s.outcomes = 0
        d = k if p.disk_parallel else 0
        start = max(t, disk_free[d])
        end = start + p.fsync
        disk_free[d] = end
        fsyncs[0] += 1

        def synced(t2: float) -> None:
            s.syncing = False
            if batch:
                gap = t2 - s.last_commit
                s.interval = 0.75 * s.interval + 0.25 * gap
                s.last_commit = t2
            for client in batch:
                replied(client, k, t2)
            sync(k, t2)

        at(end, synced)

    def appended(client: int, k: int, t: float) -> None:
        streams[k].pending.append(client)
        streams[k].expected -= 1
        sync(k, t)

    def replied(client: int, k: int, t: float) -> None:
        done[0] += 1
        finish[0] = t
        streams[k].connected -= 1
        at(t + p.delivery, lambda t2: outcome(k, t2))
        if done[0] + p.sessions <= p.messages:
            at(t + p.client, lambda t2: send(client, t2))

    def outcome(k: int, t: float) -> None:
        s = streams[k]
        s.outcomes += 1
        connected = sum(x.connected for x in streams) if p.presence else s.connected
        if connected > 0 or s.pending or s.syncing:
            bound = min(max(2 * s.interval, RIDE_MIN), RIDE_MAX)
            seen = s.commits

            def ran_out(t2: float) -> None:
                if s.outcomes and s.commits == seen:
                    sync(k, t2, cut=True)

            at(t + bound, ran_out)
        else:
            sync(k, t, cut=True)

    def send(client: int, t: float) -> None:
        shard = rng.randrange(loops)
        k = 0 if p.shared else shard
        streams[k].connected += 1
        streams[k].expected += 1
        start = max(t, loop_free[shard])
        end = start + acceptor_cpu
        loop_free[shard] = end
        if p.shared:
            def to_writer(t2: float) -> None:
                w_end = max(t2, writer_free[0]) + p.writer + p.handoff
                writer_free[0] = w_end
                at(w_end, lambda t3: appended(client, 0, t3))

            at(end, to_writer)
        else:
            def to_log(t2: float) -> None:
                appended(client, k, t2)

            at(end, to_log)

    for c in range(p.sessions):
        at(0.0, functools.partial(send, c))
    while events:
        t, _, fn = heapq.heappop(events)
        fn(t)
    return {"msgs_per_s": done[0] / finish[0] if finish[0] else 0.0, "fsyncs_per_msg": fsyncs[0] / max(done[0], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-ms", type=float, default=1.6, help="CPU a message of one shard's processes (relay tree)")
    ap.add_argument("--fsync-ms", type=float, default=0.2, help="one 4 KiB append + fdatasync (disk_probe.py)")
    ap.add_argument("--client-ms", type=float, default=0.9, help="a client's own time between 250 and next send")
    ap.add_argument("--one-loop-ms", type=float, default=0.55, help="one process with delivery workers: its "
                    "loop's CPU a message (relay_ab.py's 'relay process'; the deliveries are on other cores)")
    ap.add_argument("--writer-ms", type=float, default=0.15, help="shared: the log's share of a message's CPU")
    ap.add_argument("--handoff-ms", type=float, default=0.05, help="shared: the hand-over's CPU, on each side")
    ap.add_argument("--disk-parallel", action="store_true")
    ap.add_argument("--max-processes", type=int, default=16)
    ap.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 20, 100])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--json", help="write the table here too")
    ap.add_argument("--svg", help="draw msgs/s against the default today (needs matplotlib)")
    args = ap.parse_args(argv)
    rows = []
    for sessions in args.sessions:
        messages = max(args.messages // (10 if sessions == 1 else 1), 50 * sessions)
        # The default today on any number of cores: one relay process, its deliveries in workers on the others.
        base = simulate(Params(sessions, 1, args.one_loop_ms / 1000, args.fsync_ms / 1000, args.client_ms / 1000,
                               messages=messages))
        print(f"S={sessions:3} one process + workers: {base['msgs_per_s']:7.0f} msg/s  "
              f"{base['fsyncs_per_msg']:.3f} fsync/msg")
        rows.append({"sessions": sessions, "processes": 1, "design": "one-process", "msgs_per_s":
                     round(base["msgs_per_s"]), "fsyncs_per_msg": round(base["fsyncs_per_msg"], 3),
                     "vs_one_process": 1.0})
        for n in [1, 2, 4, 8, 12, 16]:
            if n > args.max_processes:
                break
            for design in ("shards", "shards-own-count", "shared"):
                r = simulate(Params(sessions, n, args.cpu_ms / 1000, args.fsync_ms / 1000, args.client_ms / 1000,
                                    shared=design == "shared", presence=design != "shards-own-count",
                                    writer=args.writer_ms / 1000,
                                    handoff=args.handoff_ms / 1000, disk_parallel=args.disk_parallel,
                                    messages=messages))
                row = {"sessions": sessions, "processes": n, "design": design, "msgs_per_s": round(r["msgs_per_s"]),
                       "fsyncs_per_msg": round(r["fsyncs_per_msg"], 3),
                       "vs_one_process": round(r["msgs_per_s"] / base["msgs_per_s"], 2)}
                rows.append(row)
                print(f"S={sessions:3} N={n:2} {design:16}: {row['msgs_per_s']:7} msg/s  "
                      f"{row['fsyncs_per_msg']:.3f} fsync/msg  x{row['vs_one_process']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": vars(args), "rows": rows}, f, indent=1)
    if args.svg:
        draw(rows, args.svg, f"model: {args.cpu_ms} ms CPU, {args.fsync_ms} ms fdatasync a message; "
                             "msgs/s against one process with delivery workers")
    return 0


def draw(rows: list[dict[str, object]], path: str, title: str) -> None:
    from mta.report.charts import Series, bar_chart

    groups = sorted({(int(str(r["sessions"])), int(str(r["processes"]))) for r in rows
                     if r["design"] != "one-process" and r["sessions"] != 1})
    labels = [f"{n} cores\n{s} sess" for s, n in groups]

    def ratio(design: str) -> list[float]:
        found = {(r["sessions"], r["processes"]): float(str(r["vs_one_process"])) for r in rows
                 if r["design"] == design}
        return [found.get(g, 0.0) for g in groups]

    series = [Series("shards (processes = cores)", ratio("shards"), "#dd8452"),
              Series("one commit stream (modelled)", ratio("shared"), "#4c72b0")]
    bar_chart(title, labels, series, ylabel="× one process", values=False, width_in=9.0, height_in=3.6,
              title_pt=9).write(path)


if __name__ == "__main__":
    sys.exit(main())
