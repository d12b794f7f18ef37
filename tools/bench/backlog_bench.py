"""Deferred backlog: recovery time and RSS against queue size, and new mail's share while a backlog is retried.

    .venv/bin/python tools/bench/backlog_bench.py [--sizes 10000,100000,1000000] [--backlog N] [--json FILE]
    .venv/bin/python tools/bench/backlog_bench.py --quick      # 2k/10k queues, 10k backlog, short rounds

Two measurements (benchmarks, never timed tests: docs/benchmarks.md):

1. Recovery vs. queue size. For each size a spool holding that many deferred
   messages is built in a child process (``--build engine``: the engine's own
   APIs, ``Spool.enqueue_many`` then ``poll_due`` claims and ``finish`` with
   ``next_class=1``, i.e. every message was attempted once and deferred;
   ``--build direct``: the same record stream plus DELIVERY records appended
   straight through the LogWriter, ``spool_bench.child_build_direct``;
   ``--build synthetic``: ``spool_bench.child_build_synthetic``, one message's
   seven frames repeated, seconds for 1M: valid frames whose payload
   references are not meaningful, so a retry copies an envelope's payload
   where a body should be, the same work as copying a 100-byte body). Then
   ``Spool.open`` (= recovery) is timed in fresh child processes with the
   segments' pages evicted from the page cache first, and
   each child reports its peak RSS (``ru_maxrss`` and ``VmHWM``). Median of
   ``--runs``. The child is ``spool_bench.child_open`` plus the time spent in
   fsync calls (``SyncTimingIO``), which on a shared disk is most of the wall time.
2. Fairness. A spool with ``--backlog`` deferred messages is opened through
   ``AsyncSpool`` with a 1 s retry interval for class 1, so the whole backlog is
   due. ``--enqueuers`` tasks loop ``AsyncSpool.enqueue`` (append + group commit:
   what a 250 waits for) while one consumer does what the relay's scheduler
   does with instant outcomes: ``next_due(limit=256)``, a DELIVERY record per
   attempt (DELIVERED for new mail, DEFERRED for the backlog), one commit, then
   ``finish`` (the deferred ones go back to class 1). The same workload on an
   empty spool is the reference; rounds alternate A (empty) B (backlog) so
   that load from elsewhere hits both alike. B runs with the spool's deferred
   budget (``spool.config.fairness``, ``--deferred-share``, default the engine's);
   with ``--compare-off`` (the default) each round also runs B0, the backlog
   with the budget off (share 1.0: the engine before the budget), so A B0 B
   interleave and before/after come from the same minutes. Reported: accepted
   messages/s in each, the ratios B/A and B0/A, and how many backlog messages
   were retried per second (the proof that the backlog really was being
   worked, and drains).

Temp dirs are on the real disk (``common.bench_root``: $BENCH_DIR, else the
temp dir unless it is tmpfs) and are removed. Charts (SVG, drawn through
mta/report/charts.py) need matplotlib, an optional extra (``pip install -e
.[bench]``); without it the script says so in one line and writes none. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from typing import Any

import common
import spool_bench
import trio
from common import fmt, median, say

from spool.aio.async_spool import AsyncSpool
from spool.config.engine import SpoolConfig
from spool.config.fairness import DEFAULT_SHARE
from spool.engine.spool import Attempt, Spool
from spool.fileio import OsFileIO
from spool.format.record import Outcome, Status

SENDER = spool_bench.SENDER
RCPTS = spool_bench.RCPTS
BODY = b"m" * 100
DEFERRED = spool_bench.DEFERRED
DELIVERED = Outcome(RCPTS[0], Status.DELIVERED, 250, "2.0.0", "250 2.0.0 ok", "mx.example.net")
CLAIM_LIMIT = 256  # what mta/delivery/scheduler.py asks next_due for at most
BUILD_CHUNK = 10_000
# Claims per commit while building. Why not the whole chunk: LogWriter.mark_pending is
# a list membership test, so claiming k messages before a commit costs O(k^2).
BUILD_CLAIMS = 500
NEVER = 1e9
FAIR_INTERVALS = (1.0, 3600.0, 3600.0, 3600.0, 3600.0)


# -- building a deferred queue ------------------------------------------------------------


def child_build_engine(path: str, n: int) -> dict[str, Any]:
    """N messages through the engine: enqueue_many, claimed by the new-mail runner, finished into class 1.

    The retry intervals are huge while building so that no deferred runner
    takes a message back before the build ends (the config is not stored in
    the spool: the measurements open it with their own).
    """
    cfg = SpoolConfig(retry_intervals=(NEVER,) * 5, active_limit=BUILD_CHUNK, checkpoint_interval=math.inf)
    sp = Spool.open(path, cfg)
    t0 = time.perf_counter()
    c0 = time.process_time()
    done = 0
    try:
        while done < n:
            k = min(BUILD_CHUNK, n - done)
            sp.enqueue_many([(SENDER, RCPTS, BODY)] * k)
            attempts: list[Attempt] = []
            while len(attempts) < k:
                got = sp.poll_due(limit=min(BUILD_CLAIMS, k - len(attempts)))
                if not got:
                    raise RuntimeError(f"the new-mail runner found {len(attempts)} of {k} messages just enqueued")
                attempts += got
                sp.commit()
            for a in attempts:
                sp.finish(a, next_class=1)
            sp.commit()
            done += k
        sp.checkpoint()
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
    finally:
        sp.close()
    return {"build_s": dt, "build_cpu_s": cpu, **_log_size(path)}


def child_build_direct(path: str, n: int) -> dict[str, Any]:
    c0 = time.process_time()
    out = spool_bench.child_build_direct(path, n)
    return {**out, "build_cpu_s": time.process_time() - c0}


def child_build_synthetic(path: str, n: int) -> dict[str, Any]:
    c0 = time.process_time()
    out = spool_bench.child_build_synthetic(path, n)
    return {**out, "build_cpu_s": time.process_time() - c0}


def _log_size(path: str) -> dict[str, int]:
    log_dir = os.path.join(path, "log")
    names = os.listdir(log_dir)
    return {"bytes": sum(os.path.getsize(os.path.join(log_dir, f)) for f in names), "segments": len(names)}


class SyncTimingIO(OsFileIO):
    """The real file I/O, counting the calls that wait for the disk and the time they take.

    Why: on a shared disk a single fsync can take seconds, and recovery's wall
    time is then the disk's; this splits it from the engine's own work.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.sync_s = 0.0

    def _timed(self, fn: Any, arg: Any) -> None:
        t = time.perf_counter()
        try:
            fn(arg)
        finally:
            self.sync_s += time.perf_counter() - t
            self.syncs += 1

    def fsync(self, fd: int) -> None:
        self._timed(super().fsync, fd)

    def fdatasync(self, fd: int) -> None:
        self._timed(super().fdatasync, fd)

    def fsync_dir(self, path: str) -> None:
        self._timed(super().fsync_dir, path)


def child_open(path: str) -> dict[str, Any]:
    """``spool_bench.child_open`` (the timed ``Spool.open``), with the fsyncs timed apart and VmHWM."""
    base = common.peak_rss_mb()
    io = SyncTimingIO()
    c0 = time.process_time()
    t0 = time.perf_counter()
    sp = Spool.open(path, SpoolConfig(), io)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    st = sp.recovery_stats
    out = {"open_s": dt, "cpu_s": cpu, "sync_s": io.sync_s, "syncs": io.syncs, "rss_mb": common.peak_rss_mb(),
           "rss_base_mb": base, "vmhwm_mb": _vmhwm_mb(), "records_read": st.records_read,
           "bytes_read": st.bytes_read, "in_flight": st.in_flight}
    sp.close()
    return out


def _vmhwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def build(path: str, n: int, how: str) -> dict[str, Any]:
    built = _child(f"--child-build-{how}", path, str(n))
    say(f"  built {fmt(n)} deferred ({how}) in {built['build_s']:.1f} s ({fmt(n / built['build_s'])} msg/s, "
        f"{built['build_cpu_s']:.1f} s CPU): {built['bytes'] / 2**20:.0f} MiB in {built['segments']} segments "
        f"(load {common.load_average()})")
    return built


# -- 1. recovery -------------------------------------------------------------------------------


def measure_recovery(path: str, runs: int) -> dict[str, Any]:
    opens = []
    for r in range(runs):
        common.drop_tree_cache(path)
        o = _child("--child-open", path)
        opens.append(o)
        say(f"    open {r + 1}: {o['open_s'] * 1000:.1f} ms ({o['cpu_s'] * 1000:.1f} ms CPU; {o['syncs']} fsyncs "
            f"took {o['sync_s'] * 1000:.1f} ms), peak RSS "
            f"{o['rss_mb']:.1f} MB (VmHWM {o['vmhwm_mb']:.1f}; after imports {o['rss_base_mb']:.1f}), "
            f"read {o['records_read']} records / {o['bytes_read']} bytes")
    return {k: median([o[k] for o in opens]) for k in
            ("open_s", "cpu_s", "sync_s", "syncs", "rss_mb", "vmhwm_mb", "rss_base_mb", "records_read", "bytes_read")}


# -- 2. fairness -------------------------------------------------------------------------------


async def _round(path: str, enqueuers: int, duration: float, warmup: float, share: float) -> dict[str, float]:
    """One measurement window: enqueuers and a retrying consumer on one AsyncSpool."""
    cfg = SpoolConfig(retry_intervals=FAIR_INTERVALS)
    asp = await AsyncSpool.open(path, cfg)
    asp.core.budget.share = share  # SpoolConfig.deferred_share once that field exists; the same budget
    recovered = asp.core.recovery_stats.in_flight
    counts = {"accepted": 0, "retried": 0, "delivered": 0}
    lat: list[float] = []
    measuring = False
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(asp.run)

            async def enqueuer() -> None:
                while True:
                    t = time.perf_counter()
                    await asp.enqueue(SENDER, RCPTS, BODY)
                    counts["accepted"] += 1
                    if measuring:
                        lat.append(time.perf_counter() - t)

            async def consumer() -> None:
                core = asp.core
                while True:
                    attempts = await asp.next_due(limit=CLAIM_LIMIT)
                    for a in attempts:
                        core.record_delivery(a, (DELIVERED if a.klass == 0 else DEFERRED,))
                    await asp.commit()  # the DELIVERY records are durable before the next step
                    for a in attempts:
                        if a.klass == 0:
                            asp.finish(a)
                            counts["delivered"] += 1
                        else:
                            asp.finish(a, next_class=1)
                            counts["retried"] += 1

            nursery.start_soon(consumer)
            for _ in range(enqueuers):
                nursery.start_soon(enqueuer)
            await trio.sleep(warmup)
            before = dict(counts)
            w = asp.core.writer
            f0, c0, b0 = w.fsyncs, w.commits, w.appended_bytes
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            measuring = True
            await trio.sleep(duration)
            dt = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            got = {k: counts[k] - before[k] for k in counts}
            fsyncs, commits, written = w.fsyncs - f0, w.commits - c0, w.appended_bytes - b0
            nursery.cancel_scope.cancel()
    finally:
        asp.core.close()
    return {"accepted_mps": got["accepted"] / dt, "retried_mps": got["retried"] / dt,
            "delivered_mps": got["delivered"] / dt, "accepted": got["accepted"], "retried": got["retried"],
            "p50_ms": median(lat) * 1000, "fsyncs_per_s": fsyncs / dt, "commits": commits,
            "mib_written_per_s": written / dt / 2**20, "cpu_share": cpu / dt, "seconds": dt,
            "recovered_in_flight": recovered}


KINDS = {"empty": "A (empty queue)", "backlog_off": "B0 (backlog due, budget off)",
         "backlog": "B (backlog due, budget on)"}


def measure_fairness(backlog_path: str, rounds: int, enqueuers: int, duration: float,
                     warmup: float, share: float, compare_off: bool) -> dict[str, Any]:
    kinds = ["empty", "backlog_off", "backlog"] if compare_off else ["empty", "backlog"]
    res: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    # A round ends the way a crash does: the claims in flight are recovered (and reported in
    # doubt, one warning each) when the next round opens the spool. Counted, not printed.
    logging.getLogger("spool").setLevel(logging.ERROR)
    for r in range(rounds):
        for kind in kinds:
            if kind == "empty":
                with common.temp_dir("fair-empty") as d:
                    out = trio.run(_round, d, enqueuers, duration, warmup, share)
            else:
                out = trio.run(_round, backlog_path, enqueuers, duration, warmup,
                               1.0 if kind == "backlog_off" else share)
            res[kind].append(out)
            say(f"  round {r + 1} {KINDS[kind]}: accepted "
                f"{fmt(out['accepted_mps'], 1)} msg/s (p50 {out['p50_ms']:.1f} ms), new mail delivered "
                f"{fmt(out['delivered_mps'], 1)}/s, backlog retried {fmt(out['retried_mps'], 1)}/s; "
                f"{out['fsyncs_per_s']:.1f} fsync/s, {out['mib_written_per_s']:.2f} MiB/s written, "
                f"process CPU {out['cpu_share'] * 100:.0f}% of a core; {out['recovered_in_flight']} "
                f"attempts of the last round recovered at open (load {common.load_average()})")
    if not any(o["retried"] for o in res["backlog"]):
        raise SystemExit("no backlog message was retried during the backlog rounds: the measurement is void")
    ratios = [b["accepted_mps"] / a["accepted_mps"] if a["accepted_mps"] else float("nan")
              for a, b in zip(res["empty"], res["backlog"])]
    summary: dict[str, Any] = {kind: {k: median([o[k] for o in outs]) for k in outs[0]} for kind, outs in res.items()}
    summary["rounds"] = res
    summary["ratio_per_round"] = ratios
    summary["ratio"] = median(ratios)
    summary["ratio_of_medians"] = summary["backlog"]["accepted_mps"] / summary["empty"]["accepted_mps"]
    summary["share"] = share
    if compare_off:
        off = [b["accepted_mps"] / a["accepted_mps"] if a["accepted_mps"] else float("nan")
               for a, b in zip(res["empty"], res["backlog_off"])]
        summary["ratio_off_per_round"] = off
        summary["ratio_off"] = median(off)
    return summary


# -- charts ------------------------------------------------------------------------------------


def charts(result: dict[str, Any], out_dir: str, tag: str = "") -> list[str]:
    """Two SVGs: recovery and RSS against queue size; accepted/s per round with and without backlog."""
    try:
        from mta.report.charts import Chart
    except ImportError:
        say("matplotlib is not installed (pip install -e '.[bench]'): no charts written")
        return []

    written = []
    rec = result.get("recovery", {})
    if rec:
        sizes = sorted(int(n) for n in rec)
        chart = Chart.new(10, 4, "Recovery time and peak RSS against queue size")
        ax1, ax2 = chart.figure.subplots(1, 2)
        ax1.plot(sizes, [rec[str(n)]["open_s"] * 1000 for n in sizes], "o-", label="wall")
        ax1.plot(sizes, [rec[str(n)]["cpu_s"] * 1000 for n in sizes], "s--", label="CPU")
        ax1.plot(sizes, [max(rec[str(n)]["open_s"] - rec[str(n)]["sync_s"], 1e-4) * 1000 for n in sizes], "^:",
                 label="wall minus time in fsync")
        ax1.axhline(1000, color="red", linestyle=":", label="target 1 s")
        ax1.set(xscale="log", yscale="log", xlabel="deferred messages in the queue", ylabel="Spool.open, ms",
                title="Recovery time (median)")
        ax1.legend()
        base = rec[str(sizes[0])]["vmhwm_mb"]
        ax2.plot(sizes, [rec[str(n)]["vmhwm_mb"] for n in sizes], "o-", label="peak RSS after open (VmHWM)")
        ax2.plot(sizes, [rec[str(n)]["rss_base_mb"] for n in sizes], "s--", label="after imports, before open")
        ax2.axhline(base * 1.5, color="red", linestyle=":", label="1.5x the smallest queue's")
        ax2.set(xscale="log", xlabel="deferred messages in the queue", ylabel="MB", title="Peak RSS (median)")
        ax2.set_ylim(0, base * 1.8)
        ax2.legend(fontsize="small")
        path = os.path.join(out_dir, f"bench_backlog_recovery{tag}.svg")
        chart.write(path)
        written.append(path)
    fair = result.get("fairness")
    if fair:
        rounds = fair["rounds"]
        n = len(rounds["empty"])
        chart = Chart.new(7, 5, "New mail accepted per second with and without a due backlog")
        ax = chart.figure.subplots()
        xs = list(range(n))
        bars = [("empty", "empty queue (A)")]
        if "backlog_off" in rounds:
            bars.append(("backlog_off", f"{fmt(result['backlog'])} deferred retried, budget off (B0)"))
        bars.append(("backlog", f"{fmt(result['backlog'])} deferred retried, share {fair['share']:g} (B)"))
        width = 0.8 / len(bars)
        for i, (kind, label) in enumerate(bars):
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [o["accepted_mps"] for o in rounds[kind]], width,
                   label=label)
        for x, r in zip(xs, fair["ratio_per_round"]):
            text = f"B/A {r:.2f}"
            if "backlog_off" in rounds:
                text = f"B0/A {fair['ratio_off_per_round'][x]:.2f}\n" + text
            ax.annotate(text, (x, max(o[x]["accepted_mps"] for o in rounds.values())), ha="center", va="bottom")
        ax.set_xticks(xs, [f"round {x + 1}" for x in xs])
        ax.set(ylabel="new messages accepted per second",
               title=f"New mail with and without a due backlog ({result['enqueuers']} enqueuers)")
        ax.margins(y=0.2)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize="small")
        path = os.path.join(out_dir, f"bench_backlog_fairness{tag}.svg")
        chart.write(path)
        written.append(path)
    return written


# -- main --------------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x.replace("_", "")) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--sizes: expected comma-separated counts, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise SystemExit("--sizes: counts must be positive")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip())
    ap.add_argument("--sizes", default="", help="queue sizes for recovery (default 10000,100000,1000000)")
    ap.add_argument("--backlog", type=int, default=0, help="deferred backlog for the fairness rounds "
                                                           "(default 1,000,000; 0 with --no-fairness)")
    ap.add_argument("--build", choices=["engine", "direct", "synthetic"], default="engine",
                    help="engine: the engine's APIs (default); direct: the same record stream through the "
                         "LogWriter (spool_bench); synthetic: one message's frames repeated (spool_bench), "
                         "seconds for 1M")
    ap.add_argument("--runs", type=int, default=3, help="opens per queue size (median)")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds of the fairness measurement")
    ap.add_argument("--enqueuers", type=int, default=50, help="concurrent enqueue+commit tasks")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds measured per fairness round")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds before each round's window opens")
    ap.add_argument("--deferred-share", type=float, default=DEFAULT_SHARE,
                    help=f"the deferred budget's share in the B rounds (default {DEFAULT_SHARE:g}; 1.0 = off)")
    ap.add_argument("--no-compare-off", dest="compare_off", action="store_false",
                    help="skip the B0 rounds (backlog with the budget off)")
    ap.add_argument("--no-recovery", action="store_true", help="skip the recovery measurement")
    ap.add_argument("--no-fairness", action="store_true", help="skip the fairness measurement")
    ap.add_argument("--quick", action="store_true", help="2k and 10k queues, a 10k backlog, 5 s rounds")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    ap.add_argument("--charts", metavar="DIR", default=str(common.ROOT / "docs"),
                    help="where the SVG charts go (default docs/); 'none' for no charts")
    ap.add_argument("--tag", default="", help="suffix of the chart names: bench_backlog_recovery_TAG.svg")
    ap.add_argument("--child-build-engine", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-build-direct", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-build-synthetic", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-open", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    common.exit_on_sigterm()
    if args.child_build_engine:
        common.emit_json(child_build_engine(args.child_build_engine[0], int(args.child_build_engine[1])))
        return
    if args.child_build_direct:
        common.emit_json(child_build_direct(args.child_build_direct[0], int(args.child_build_direct[1])))
        return
    if args.child_build_synthetic:
        common.emit_json(child_build_synthetic(args.child_build_synthetic[0], int(args.child_build_synthetic[1])))
        return
    if args.child_open:
        common.emit_json(child_open(args.child_open))
        return

    sizes = _sizes(args.sizes or ("2000,10000" if args.quick else "10000,100000,1000000"))
    backlog = args.backlog or (10_000 if args.quick else 1_000_000)
    duration = 5.0 if args.quick and args.duration == 15.0 else args.duration
    if args.runs < 1 or args.rounds < 1 or args.enqueuers < 1 or duration <= 0 or args.warmup < 0 or backlog < 1:
        raise SystemExit("--runs, --rounds, --enqueuers, --duration and --backlog must be positive")
    if not 0.0 <= args.deferred_share <= 1.0:
        raise SystemExit("--deferred-share must be between 0 and 1")
    if args.charts != "none" and not os.path.isdir(args.charts):
        raise SystemExit(f"--charts: {args.charts} is not a directory")
    do_rec, do_fair = not args.no_recovery, not args.no_fairness

    t_start = time.perf_counter()
    mach = common.machine()
    try:
        commit = subprocess.run(["git", "-C", str(common.ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    say(f"backlog_bench: sizes {sizes}, backlog {fmt(backlog)}, build {args.build}, {args.runs} opens per size, "
        f"{args.rounds} x A B rounds of {duration:g} s with {args.enqueuers} enqueuers; code {commit}; machine {mach}")
    result: dict[str, Any] = {"sizes": sizes, "backlog": backlog, "build": args.build, "runs": args.runs,
                              "enqueuers": args.enqueuers, "duration": duration, "machine": mach, "commit": commit,
                              "builds": {}, "recovery": {}}

    def fairness(path: str) -> None:
        say(f"\n[2] fairness: {args.enqueuers} enqueuers, {fmt(backlog)} deferred due (class-1 interval "
            f"{FAIR_INTERVALS[0]:g} s), A = empty queue, B = backlog")
        result["fairness"] = measure_fairness(path, args.rounds, args.enqueuers, duration, args.warmup,
                                              args.deferred_share, args.compare_off)

    if do_rec:
        say(f"\n[1] recovery vs. queue size {sizes}")
        for n in sizes:
            with common.temp_dir(f"backlog{n}") as d:
                result["builds"][str(n)] = build(d, n, args.build)
                result["recovery"][str(n)] = measure_recovery(d, args.runs)
                if do_fair and n == backlog:
                    fairness(d)
    if do_fair and "fairness" not in result:
        with common.temp_dir(f"backlog{backlog}") as d:
            say(f"\n[2] building the {fmt(backlog)}-message backlog")
            result["builds"][str(backlog)] = build(d, backlog, args.build)
            fairness(d)

    rows: list[list[Any]] = []
    targets: dict[str, bool] = {}
    if do_rec:
        rec = result["recovery"]
        biggest, smallest = str(sizes[-1]), str(sizes[0])
        rss_ratio = rec[biggest]["vmhwm_mb"] / rec[smallest]["vmhwm_mb"]
        result["rss_ratio"] = rss_ratio
        targets["recovery_lt_1s_at_largest"] = rec[biggest]["open_s"] < 1.0
        targets["rss_within_1.5x"] = rss_ratio <= 1.5
        for n in sizes:
            r, b = rec[str(n)], result["builds"][str(n)]
            rows.append([f"{fmt(n)} deferred: build s; open ms (CPU ms, fsync ms); peak RSS MB; records read",
                         f"{b['build_s']:.0f}; {r['open_s'] * 1000:.1f} ({r['cpu_s'] * 1000:.1f}, "
                         f"{r['sync_s'] * 1000:.1f}); "
                         f"{r['vmhwm_mb']:.1f}; {fmt(r['records_read'])}",
                         "< 1 s" if str(n) == biggest else "",
                         targets["recovery_lt_1s_at_largest"] if str(n) == biggest else ""])
        rows.append([f"peak RSS {fmt(sizes[-1])} / {fmt(sizes[0])}", f"{rss_ratio:.2f}", "<= 1.5",
                     targets["rss_within_1.5x"]])
        result["recovery_s"] = rec[biggest]["open_s"]
        result["queue_size"] = sizes[-1]
    if do_fair:
        f = result["fairness"]
        targets["fairness_ge_0.8"] = f["ratio"] >= 0.8
        if "ratio_off" in f:
            rows += [[f"accepted msg/s, {fmt(backlog)} backlog retried, budget off (B0)",
                      fmt(f["backlog_off"]["accepted_mps"], 1), "", ""],
                     ["backlog retried msg/s during B0", fmt(f["backlog_off"]["retried_mps"], 1), "", ""],
                     ["B0/A, median of paired rounds (per round)",
                      f"{f['ratio_off']:.2f} ({', '.join(f'{r:.2f}' for r in f['ratio_off_per_round'])})", "", ""]]
        rows += [["accepted msg/s, empty queue (A)", fmt(f["empty"]["accepted_mps"], 1), "", ""],
                 [f"accepted msg/s, {fmt(backlog)} backlog retried (B)", fmt(f["backlog"]["accepted_mps"], 1), "", ""],
                 ["backlog retried msg/s during B", fmt(f["backlog"]["retried_mps"], 1), "> 0", ""],
                 ["B/A, median of paired rounds (per round)",
                  f"{f['ratio']:.2f} ({', '.join(f'{r:.2f}' for r in f['ratio_per_round'])})", ">= 0.80",
                  targets["fairness_ge_0.8"]]]
    result["targets_met"] = targets
    say("\nSummary (medians)")
    say(common.table(["figure", "value", "target", "met"], rows))
    if args.charts != "none":
        for path in charts(result, args.charts, f"_{args.tag}" if args.tag else ""):
            say(f"chart: {path}")
    say(f"elapsed {time.perf_counter() - t_start:.0f} s, load average now {common.load_average()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, sort_keys=True)
    compact = {k: v for k, v in result.items() if k != "fairness"}
    if do_fair:
        compact["fairness"] = {k: v for k, v in result["fairness"].items() if k != "rounds"}
    common.emit_json(compact)


if __name__ == "__main__":
    main()
