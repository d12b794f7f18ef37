"""Where one SMTP transaction's time goes, for a lone client sending one message per connection.

    .venv/bin/python tools/bench/transaction_split.py [--messages 300] [--runs 3] [--size 4096]

Why: a lone client waits for every step of its transaction in turn, so the
single-session rate is the sum of those steps. This runs the relay
in this process (``mta.process.relay.Relay``, the benchmark's config: route
``*`` to a local ``smtp-sink``), drives it with ``smtp-source -s 1`` (no
``-d``: one connection per message, as in relay_vs_postfix.py), and times
each transaction with bench-only wrappers around the relay's own functions
(nothing in spool/ or mta/ knows about them):

- ``to DATA``: connection accepted -> DATA (greeting, EHLO, MAIL, RCPT: the
  client's round trips and the relay's parsing);
- ``body``: DATA -> end of data (the body's bytes, parsed and written into the spool);
- ``envelope``: end of data -> the commit asked for (the envelope appended);
- ``group-commit wait``: commit asked for -> the committer starts writing;
- ``write + fsync``: the batch's write and fdatasync, in a worker thread or (a lone commit) the loop's;
- ``wake-up``: fsync done -> the session's enqueue returns (thread hand-off, trio's scheduler);
- ``reply``: enqueue returned -> the 250 handed to the socket (log line, reply);
- ``QUIT``: 250 -> the connection closed;
- ``total``: accepted -> closed; ``cycle``: one accept to the next (the message's share of the run).

``PYTHONPATH=DIR`` measures another code tree (DIR holds spool/ and mta/, as for relay_ab.py).

A trio Instrument adds the CPU time of the event loop's task steps per
component (SMTP sessions, delivery, the committer, runners and the rest), in
ms per message. Every figure is a median over the messages of a run, then the
median over ``--runs``; load average and the fsync probe are printed with them.
Needs root (smtp-sink runs as ``postfix``), ``smtp-source`` and ``smtp-sink``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common
from disk_probe import describe_machine
from relay_vs_postfix import LOGSPOOL_TOML, RECIPIENT, SENDER, Sink, free_port, tool

# Another code tree to measure (``PYTHONPATH=DIR``, DIR holding spool/ and mta/, as relay_ab.py takes them)
# goes before this checkout, which the imports above put first.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
from mta.config.loader import parse_config  # noqa: E402  (after the code tree to measure is first)
from mta.inbound import server as inbound  # noqa: E402
from mta.inbound import session as inbound_session  # noqa: E402
from mta.process.relay import Relay  # noqa: E402
from spool.aio import group_commit  # noqa: E402
from spool.write.log import Batch, LogWriter  # noqa: E402

PHASES = ("to DATA", "body", "envelope", "group-commit wait", "write + fsync", "wake-up", "reply", "QUIT")
MARKS = ("accept", "data", "eod", "commit", "write", "synced", "enqueued", "replied", "closed")


class Timeline:
    """The marks of the transaction under way (one session at a time: a lone client)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.done: list[dict[str, float]] = []
        self.recording = False
        self.syncs = 0  # sync batches written so far (the worker thread counts)
        self.inline_syncs = 0  # of which written in the event loop's thread (a lone commit on a fast disk)

    def mark(self, name: str) -> None:
        if self.recording and name not in self.current:
            self.current[name] = time.perf_counter()

    def open(self) -> dict[str, float]:
        """A connection was accepted: its transaction is the current one from now on."""
        self.current = {"accept": time.perf_counter()}
        return self.current

    def close(self, record: dict[str, float]) -> None:
        """That connection ended (perhaps after the next one was accepted)."""
        record["closed"] = time.perf_counter()
        if self.recording:
            self.done.append(record)
        if self.current is record:
            self.current = {}

    def phases(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = defaultdict(list)
        whole = sorted((t for t in self.done if all(m in t for m in MARKS)), key=lambda t: t["accept"])
        for prev, t in zip([None, *whole], whole, strict=False):
            for name, (a, b) in zip(PHASES, itertools.pairwise(MARKS), strict=False):
                out[name].append(1000 * (t[b] - t[a]))
            if prev is not None:  # from one accept to the next: the client's share is cycle - total
                out["cycle"].append(1000 * (t["accept"] - prev["accept"]))
            out["total"].append(1000 * (t["closed"] - t["accept"]))
            out["fsyncs waited"].append(t.get("syncs_waited", 0))
        return out


class StepClock(trio.abc.Instrument):
    """CPU time (thread time) of the event loop's task steps, by component (``by_task``: the delivery's and the
    rest's by task, ``Scheduler._feeder``, ``DeliveryWorkers._keep``...)."""

    def __init__(self, line: Timeline, by_task: bool = False) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self._t0 = 0.0
        self.recording = False
        self.line = line
        self.by_task = by_task

    def component(self, task: trio.lowlevel.Task) -> str:
        part = self._component(task)
        if self.by_task and part in ("delivery", "other"):
            return f"{part}: {'.'.join(task.name.rsplit('.', 2)[-2:])}"
        return part

    @staticmethod
    def _component(task: trio.lowlevel.Task) -> str:
        name = task.name
        if "inbound" in name or "serve_listeners" in name or "_run_handler" in name:
            return "SMTP sessions"
        if "delivery" in name or "scheduler" in name.lower() or "smtp_transport" in name:
            return "delivery"
        if "_committer" in name or "_lazy_committer" in name:
            return "committer"
        if "to_thread" in name or "thread" in name:
            return "thread hand-offs"
        return "other"

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._t0 = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.recording:
            spent = time.thread_time() - self._t0
            component = self.component(task)
            self.cpu[component] += spent
            current = self.line.current
            if "synced" in current and "replied" not in current and component != "SMTP sessions":
                # Work of other tasks that ran between the fsync and the 250: on the lone client's path.
                self.cpu[f"{component}, before the 250"] += spent
            elif "replied" in current and component != "SMTP sessions":
                # Between the 250 and the close: the client's QUIT waits behind it.
                self.cpu[f"{component}, during QUIT"] += spent


def instrument(line: Timeline) -> Callable[[], None]:
    """Wrap the relay's functions with marks; returns the undo."""
    undo: list[Callable[[], None]] = []

    def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        undo.append(lambda: setattr(owner, name, original))

    def handle(fn: Any) -> Any:
        @functools.wraps(fn)
        async def wrapper(self: Any, stream: Any, *rest: Any) -> None:
            record = line.open()
            try:
                await fn(self, stream, *rest)
            finally:
                line.close(record)
        return wrapper

    def before(mark: str) -> Callable[[Any], Any]:
        def make(fn: Any) -> Any:
            @functools.wraps(fn)
            def wrapper(*a: Any, **k: Any) -> Any:
                line.mark(mark)
                return fn(*a, **k)
            return wrapper
        return make

    def async_before(mark: str) -> Callable[[Any], Any]:
        def make(fn: Any) -> Any:
            @functools.wraps(fn)
            async def wrapper(*a: Any, **k: Any) -> Any:
                line.mark(mark)
                return await fn(*a, **k)
            return wrapper
        return make

    def enqueue(fn: Any) -> Any:
        @functools.wraps(fn)
        async def wrapper(*a: Any, **k: Any) -> Any:
            result = await fn(*a, **k)
            line.mark("enqueued")
            return result
        return wrapper

    def flush(fn: Any) -> Any:
        @functools.wraps(fn)
        async def wrapper(self: Any) -> None:
            if "enqueued" in line.current:
                line.mark("replied")
            await fn(self)
        return wrapper

    def write_batch(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(self: Any, batch: Batch) -> None:
            current = line.current
            if batch.sync and "commit" in current:
                line.mark("write")
            fn(self, batch)
            if batch.sync:
                line.syncs += 1
                if threading.current_thread() is threading.main_thread():
                    line.inline_syncs += 1
                if "write" in current:
                    line.mark("synced")
        return wrapper

    def commit(fn: Any) -> Any:
        @functools.wraps(fn)
        async def wrapper(self: Any, **k: Any) -> None:
            current = line.current
            if "eod" in current and "commit" not in current:
                line.mark("commit")
                current["syncs_before"] = line.syncs
                await fn(self, **k)
                current["syncs_waited"] = line.syncs - current["syncs_before"]
                return
            await fn(self, **k)
        return wrapper

    wrap(inbound.SmtpServer, "handle", handle)
    wrap(inbound_session._Session, "_data_start", before("data"))
    wrap(inbound_session._Session, "_end_of_data", async_before("eod"))
    wrap(inbound_session._Session, "_flush", flush)
    wrap(group_commit.GroupCommit, "enqueue", enqueue)
    wrap(group_commit.GroupCommit, "commit", commit)
    # The batch's work itself, in whichever thread runs it (a lone commit writes in the event loop's);
    # an older tree has only write_batch.
    wrap(LogWriter, "_write_locked" if hasattr(LogWriter, "_write_locked") else "write_batch", write_batch)

    def restore() -> None:
        for fn in reversed(undo):
            fn()
    return restore


async def one_run(relay: Relay, sink: Sink, line: Timeline, clock: StepClock, messages: int,
                  size: int, sessions: int = 1) -> dict[str, Any]:
    port = relay.ports[0]
    cmd = [tool("smtp-source") or "smtp-source", "-s", str(sessions), "-m", str(messages), "-l", str(size),
           "-f", SENDER, "-t", RECIPIENT, f"127.0.0.1:{port}"]
    base = sink.count
    line.done, line.recording, clock.recording = [], True, True
    clock.cpu.clear()
    t0, cpu0, syncs0, inline0 = time.perf_counter(), time.process_time(), line.syncs, line.inline_syncs
    await trio.run_process(cmd, capture_stdout=True, capture_stderr=True)
    with trio.fail_after(120):
        while sink.count < base + messages:
            await trio.sleep(0.01)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    line.recording = clock.recording = False
    phases = line.phases()
    return {"msg_per_s": round(messages / wall, 1), "process_cpu_ms_per_msg": round(1000 * cpu / messages, 3),
            "transactions": len(phases.get("total", [])), "incomplete": len(line.done) - len(phases.get("total", [])),
            "phase_ms": {k: round(statistics.median(v), 3) for k, v in phases.items() if v and k != "fsyncs waited"},
            "fsyncs_waited_mean": round(statistics.mean(phases["fsyncs waited"]), 3)
            if phases["fsyncs waited"] else None,
            "fsyncs_per_msg": round((line.syncs - syncs0) / messages, 3),
            "inline_syncs_per_msg": round((line.inline_syncs - inline0) / messages, 3),
            "loop_cpu_ms_per_msg": {k: round(1000 * v / messages, 3) for k, v in sorted(clock.cpu.items())},
            "loadavg": common.load_average()}


async def bench(args: argparse.Namespace, work: str) -> list[dict[str, Any]]:
    sink = Sink(free_port())
    try:
        # relay_vs_postfix's relay, in this process (port 0: the listener's own port is read back).
        text = LOGSPOOL_TOML.format(port=0, dir=work, sink_port=sink.port, max_sessions=200, processes="",
                                    delivery=f"processes = {args.delivery_processes}\n" if args.delivery_processes
                                    else "")
        config = parse_config(text, source=os.path.join(work, "bench.toml"), base_dir=work)
        line = Timeline()
        clock = StepClock(line, args.by_task)
        undo = instrument(line)
        trio.lowlevel.add_instrument(clock)
        try:
            async with trio.open_nursery() as nursery:
                relay: Relay = await nursery.start(Relay(config).run)
                await one_run(relay, sink, line, clock, 20, args.size)  # warm-up
                results = []
                for r in range(args.runs):
                    res = await one_run(relay, sink, line, clock, args.messages, args.size, args.sessions)
                    common.say(f"run {r + 1}: {json.dumps(res)}")
                    results.append(res)
                nursery.cancel_scope.cancel()
        finally:
            undo()
        return results
    finally:
        sink.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=1,
                    help="concurrent sessions (above 1 the phases mix sessions: read the CPU figures only)")
    ap.add_argument("--delivery-processes", type=int, default=0,
                    help="[delivery] processes: SMTP deliveries in this many worker processes (default 0)")
    ap.add_argument("--by-task", action="store_true",
                    help="split the loop CPU of the delivery and of the rest by task (the scheduler's feeder and "
                         "workers, the delivery workers' conversation)")
    ap.add_argument("--profile", metavar="FILE", help="also cProfile the event loop's thread on its CPU clock "
                    "(time.thread_time: other processes' load does not show) into FILE (pstats)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not tool("smtp-source") or not tool("smtp-sink"):
        print("transaction_split: needs root, smtp-source and smtp-sink (Debian: postfix)", file=sys.stderr)
        return 2
    common.exit_on_sigterm()
    machine = describe_machine(1.0)
    common.say(f"machine: {json.dumps(machine)}")
    work = tempfile.mkdtemp(prefix="txsplit-", dir=common.bench_root())
    os.chmod(work, 0o755)
    try:
        if args.profile:
            profiler = cProfile.Profile(time.thread_time)
            results = profiler.runcall(trio.run, bench, args, work)
            profiler.dump_stats(args.profile)
            stats = pstats.Stats(args.profile)
            stats.sort_stats("tottime").print_stats(40)
        else:
            results = trio.run(bench, args, work)
    finally:
        with contextlib.suppress(OSError):
            import shutil
            shutil.rmtree(work)
    names = [*PHASES, "total", "cycle"]
    rows = [[n, *(r["phase_ms"].get(n, float("nan")) for r in results),
             round(statistics.median([r["phase_ms"].get(n, float("nan")) for r in results]), 3)] for n in names]
    comps = sorted({c for r in results for c in r["loop_cpu_ms_per_msg"]})
    rows += [[f"loop CPU: {c}", *(r["loop_cpu_ms_per_msg"].get(c, 0.0) for r in results),
              round(statistics.median([r["loop_cpu_ms_per_msg"].get(c, 0.0) for r in results]), 3)] for c in comps]
    rows += [[key.replace("_", " "), *(r[key] for r in results), round(statistics.median([r[key] for r in results]), 3)]
             for key in ("fsyncs_waited_mean", "fsyncs_per_msg")]
    rows += [["process CPU ms/msg", *(r["process_cpu_ms_per_msg"] for r in results),
              round(statistics.median([r["process_cpu_ms_per_msg"] for r in results]), 3)],
             ["msg/s", *(r["msg_per_s"] for r in results),
              round(statistics.median([r["msg_per_s"] for r in results]), 1)]]
    headers = ["ms per message (median)", *(f"run {i + 1}" for i in range(len(results))), "median"]
    common.say(common.table(headers, rows))
    common.emit_json({"benchmark": "transaction_split", "machine": machine, "size": args.size,
                      "sessions": args.sessions,
                      "messages": args.messages, "runs": results, "loadavg_end": common.load_average()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
