"""The bodies decision (docs/design.md, "Bodies: inline DATA records"): DATA records inline in the queue log,
or append-only data segments beside it, or (reference only) one file per message.

    .venv/bin/python tools/bench/bodies_bench.py [--quick] [--runs N]

1. Durable messages/s at group-commit batch sizes 1, 10 and 100, 4 KiB and
   100 KiB bodies. Every variant uses the engine's framing (``encode_frame``:
   16-byte header, CRC-32C, CBOR envelope) and one pwrite per file per batch:
   - ``inline``: body frame + envelope frame in the queue file, one fdatasync;
   - ``segments-seq``: body frame in a data file, envelope (naming the body's
     data segment and offset) in the queue file, fdatasync data then queue;
   - ``segments-2thr``: the same, the two fdatasyncs issued at once from two threads;
   - ``file-per-msg``: the body in its own file (create, write, fdatasync, close),
     the envelope in the queue file, one directory fsync + queue fdatasync per batch;
   - ``engine-inline``: the real engine, ``Spool.enqueue_many`` (bodies inline today).
2. A runner pass over a garbage-heavy queue log (as in spool_bench: units of
   DATA, ENVELOPE (garbage), START, DELIVERY, FINISH; 2% hold a live deferred
   envelope) with bodies inline vs. without (bodies in data segments), with the
   page cache warm and cold (the log's pages dropped with POSIX_FADV_DONTNEED).
3. A deferral with the engine as it is (the replacement envelope gets a fresh
   copy of the body): bytes appended per deferral, vs. a reference to the body.

Medians of several runs, variants interleaved within each run. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cbor2
import common
from common import fmt, median, say

from spool.config.engine import SpoolConfig
from spool.engine.runner import Runner
from spool.engine.spool import Attempt, Spool
from spool.format.record import (
    Delivery,
    Envelope,
    Finish,
    Outcome,
    RecordType,
    Start,
    Status,
    encode_frame,
    make_pos,
)
from spool.format.segment import SEGMENT_HEADER_SIZE

SENDER = "alice@example.org"
RCPTS = ("bob@example.net",)
NO_CHECKPOINTS = SpoolConfig(checkpoint_interval=math.inf)
DEFERRED = Outcome(RCPTS[0], Status.DEFERRED, 451, "4.3.0", "451 4.3.0 try again later", "mx.example.net")
VARIANTS = ["inline", "segments-seq", "segments-2thr", "file-per-msg", "engine-inline"]
_DATA = int(RecordType.DATA)
_ENV = int(RecordType.ENVELOPE)


def _envelope(pos: int, body_ref: list[int], size: int, ms: int) -> bytes:
    # The same map as Envelope.to_payload; key 3 names the body: queue positions
    # when inline, [data segment, offset, length] in a data segment.
    return cbor2.dumps({0: pos, 1: SENDER, 2: list(RCPTS), 3: body_ref, 4: size, 5: ms, 6: 0})


class Proto:
    """A minimal prototype of one layout: append a batch of messages, make it durable."""

    def __init__(self, path: str, kind: str) -> None:
        self.kind = kind
        self.path = path
        self.q = os.open(os.path.join(path, "queue.log"), os.O_RDWR | os.O_CREAT, 0o600)
        self.q_off = 0
        self.d = -1
        self.d_off = 0
        self.fsyncs = 0
        self.n = 0
        if kind.startswith("segments"):
            self.d = os.open(os.path.join(path, "data.seg"), os.O_RDWR | os.O_CREAT, 0o600)
        if kind == "file-per-msg":
            self.msg_dir = os.path.join(path, "msgs")
            os.mkdir(self.msg_dir)
        self.pool = ThreadPoolExecutor(1) if kind == "segments-2thr" else None

    def close(self) -> None:
        os.close(self.q)
        if self.d >= 0:
            os.close(self.d)
        if self.pool is not None:
            self.pool.shutdown()

    def _sync(self, fd: int) -> None:
        os.fdatasync(fd)
        self.fsyncs += 1

    def batch(self, body: bytes, count: int) -> None:
        ms = int(time.time() * 1000)
        now = ms // 1000
        qbuf = bytearray()
        dbuf = bytearray()
        for _ in range(count):
            self.n += 1
            if self.kind == "inline":
                body_pos = self.q_off + len(qbuf)
                qbuf += encode_frame(1, _DATA, body, time=now)
                pos = self.q_off + len(qbuf)
                qbuf += encode_frame(1, _ENV, _envelope(pos, [body_pos], len(body), ms), time=now)
            elif self.kind == "file-per-msg":
                fd = os.open(os.path.join(self.msg_dir, f"{self.n:x}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, body)
                    self._sync(fd)
                finally:
                    os.close(fd)
                pos = self.q_off + len(qbuf)
                qbuf += encode_frame(1, _ENV, _envelope(pos, [self.n], len(body), ms), time=now)
            else:
                frame = encode_frame(1, _DATA, body, time=now)
                ref = [1, self.d_off + len(dbuf), len(frame)]
                dbuf += frame
                pos = self.q_off + len(qbuf)
                qbuf += encode_frame(1, _ENV, _envelope(pos, ref, len(body), ms), time=now)
        if dbuf:
            os.pwrite(self.d, dbuf, self.d_off)
            self.d_off += len(dbuf)
        os.pwrite(self.q, qbuf, self.q_off)
        self.q_off += len(qbuf)
        if self.kind == "segments-seq":
            self._sync(self.d)
            self._sync(self.q)
        elif self.kind == "segments-2thr":
            assert self.pool is not None
            fut = self.pool.submit(self._sync, self.d)
            self._sync(self.q)
            fut.result()
        elif self.kind == "file-per-msg":
            dfd = os.open(self.msg_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
                self.fsyncs += 1
            finally:
                os.close(dfd)
            self._sync(self.q)
        else:
            self._sync(self.q)


def durable_cell(kind: str, body: bytes, batch: int, duration: float, max_bytes: int) -> dict[str, float]:
    """Append batches for about ``duration`` seconds; messages/s with everything durable."""
    max_msgs = max(batch, max_bytes // len(body) // batch * batch)
    lat: list[float] = []
    with common.temp_dir(f"bodies-{kind}") as d:
        if kind == "engine-inline":
            sp = Spool.open(d, NO_CHECKPOINTS)
            msgs = [(SENDER, RCPTS, body)] * batch
            f0 = sp.writer.fsyncs
            n = 0
            t0 = time.perf_counter()
            while n < max_msgs and (n == 0 or time.perf_counter() - t0 < duration):
                tb = time.perf_counter()
                sp.enqueue_many(msgs)
                lat.append(time.perf_counter() - tb)
                n += batch
            dt = time.perf_counter() - t0
            fsyncs = sp.writer.fsyncs - f0
            sp.close()
        else:
            p = Proto(d, kind)
            t0 = time.perf_counter()
            while p.n < max_msgs and (p.n == 0 or time.perf_counter() - t0 < duration):
                tb = time.perf_counter()
                p.batch(body, batch)
                lat.append(time.perf_counter() - tb)
            dt = time.perf_counter() - t0
            n, fsyncs = p.n, p.fsyncs
            p.close()
    # Throughput over the cell is a mean, at the mercy of one fsync stall on a shared
    # disk; batch / median batch latency is the typical rate and far steadier.
    return {"mps": n / dt, "fsync_per_msg": fsyncs / n, "messages": n, "typical_mps": batch / median(lat)}


def bench_durable(sizes: list[int], batches: list[int], runs: int, duration: float,
                  max_bytes: int) -> dict[str, dict[int, dict[int, dict[str, float]]]]:
    raw: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    bodies = {s: os.urandom(s) for s in sizes}
    for r in range(runs):
        for size in sizes:
            for b in batches:
                line = []
                for kind in VARIANTS:
                    out = durable_cell(kind, bodies[size], b, duration, max_bytes)
                    raw.setdefault((kind, size, b), []).append(out)
                    line.append(f"{kind} {fmt(out['mps'])} ({fmt(out['typical_mps'])})")
                say(f"  run {r + 1} {size // 1024} KiB batch {b}: " + ", ".join(line)
                    + " msg/s (typical: batch / median batch latency)")
    res: dict[str, dict[int, dict[int, dict[str, float]]]] = {}
    for (kind, size, b), outs in raw.items():
        res.setdefault(kind, {}).setdefault(size, {})[b] = {
            "mps": median([o["mps"] for o in outs]), "fsync_per_msg": median([o["fsync_per_msg"] for o in outs]),
            "typical_mps": median([o["typical_mps"] for o in outs])}
    return res


# -- runner scan with and without inline bodies -------------------------------------------


def build_log(sp: Spool, units: int, body: bytes | None) -> tuple[int, int]:
    """As spool_bench.build_scan_log; ``body=None`` leaves the bodies out (they live in data segments)."""
    w = sp.writer
    now = time.time()
    ms = int(now * 1000)
    env = Envelope(make_pos(1, 64), SENDER, RCPTS, (make_pos(1, 32),), 4096, ms).to_payload()
    start = Start(make_pos(1, 64), ms).to_payload()
    delivery = Delivery(make_pos(1, 96), ms, (DEFERRED,)).to_payload()
    finish = Finish(make_pos(1, 96), ms, make_pos(1, 128)).to_payload()
    records = 0
    for u in range(units):
        if body is not None:
            w.append(RecordType.DATA, body, now=now)
            records += 1
        if u % 50 == 0:
            w.append(RecordType.ENVELOPE, env, klass=2, now=now)
            records += 1
        else:
            w.mark_after_sync(w.append(RecordType.ENVELOPE, env, klass=1, now=now))
            w.append(RecordType.START, start, now=now)
            w.append(RecordType.DELIVERY, delivery, now=now)
            w.append(RecordType.FINISH, finish, now=now)
            records += 4
        if w.pending_bytes > 32 * 2**20:
            sp.commit()
    sp.commit()
    w.sync_all()
    return records, (units + 49) // 50


def scan_pass(sp: Spool, cold: bool) -> tuple[float, int]:
    if cold:
        common.drop_tree_cache(sp.log_dir)
    r = Runner(sp.io, sp.log_dir, 2, 0.0, make_pos(1, SEGMENT_HEADER_SIZE))
    try:
        t0 = time.perf_counter()
        r.scan(sp.writer, 1e12, 10**9, ())
        return time.perf_counter() - t0, r.bytes_read
    finally:
        r.close()


def bench_scan(layouts: list[tuple[str, int | None, int]], runs: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, size, units in layouts:
        with common.temp_dir("bodies-scan") as d:
            sp = Spool.open(d, SpoolConfig(checkpoint_interval=math.inf, segment_size=64 * 2**20))
            try:
                body = None if size is None else os.urandom(size)
                records, _live = build_log(sp, units, body)
                disk = sum(os.path.getsize(os.path.join(sp.log_dir, f)) for f in os.listdir(sp.log_dir))
                res: dict[str, list[float]] = {"warm": [], "cold": []}
                read = 0
                for _ in range(runs):
                    for mode in ("warm", "cold"):
                        dt, read = scan_pass(sp, mode == "cold")
                        res[mode].append(dt)
                out[name] = {"units": units, "records": records, "log_mib": disk / 2**20, "read_mib": read / 2**20,
                             **{f"{m}_msgs_per_s": units / median(v) for m, v in res.items()},
                             **{f"{m}_records_per_s": records / median(v) for m, v in res.items()}}
                o = out[name]
                say(f"  {name}: log {o['log_mib']:.0f} MiB, runner read {o['read_mib']:.0f} MiB; "
                    f"warm {fmt(o['warm_msgs_per_s'])} msg/s ({fmt(o['warm_records_per_s'])} rec/s), "
                    f"cold {fmt(o['cold_msgs_per_s'])} msg/s ({fmt(o['cold_records_per_s'])} rec/s)")
            finally:
                sp.close()
    return out


# -- deferral: copy the body forward, or reference it ---------------------------------------


def bench_defer(sizes: list[int], n: int) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for size in sizes:
        with common.temp_dir("bodies-defer") as d:
            sp = Spool.open(d, NO_CHECKPOINTS)
            try:
                sp.enqueue_many([(SENDER, RCPTS, os.urandom(size))] * n)
                attempts: list[Attempt] = []
                while len(attempts) < n:
                    attempts += sp.poll_due(limit=n - len(attempts))
                w = sp.writer
                b0 = w.appended_bytes
                t0 = time.perf_counter()
                for a in attempts:
                    sp.record_delivery(a, (DEFERRED,))
                sp.commit()
                for a in attempts:
                    sp.finish(a)
                sp.commit()
                dt = time.perf_counter() - t0
                per = (w.appended_bytes - b0) / n
            finally:
                sp.close()
        ref = len(_envelope(0, [1, 0, size], size, 0)) + 16
        out[size] = {"bytes_per_deferral_inline": per, "bytes_envelope_only": ref, "defers_per_s": n / dt}
        say(f"  {size // 1024} KiB: engine appends {fmt(per)} bytes per deferral (body copied forward), "
            f"{fmt(n / dt)} deferrals/s; a replacement naming the body in a data segment: ~{ref} bytes")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=0, help="runs per figure (default 3, quick 1)")
    ap.add_argument("--only", default="durable,scan,defer", help="comma-separated sections (default: all)")
    args = ap.parse_args()
    common.exit_on_sigterm()
    quick = args.quick
    runs = args.runs or (1 if quick else 3)
    sizes = [4096, 100 * 1024]
    batches = [1, 10, 100]
    duration = 0.7 if quick else 2.0
    max_bytes = (64 if quick else 256) * 2**20
    mach = common.machine()
    t_start = time.perf_counter()
    say(f"bodies_bench {'--quick' if quick else '(full)'}: {runs} runs; machine {mach}")

    only = set(args.only.split(","))
    summary: dict[str, Any] = {"quick": quick, "runs": runs, "machine": mach}

    if "durable" in only:
        say(f"\n[1] durable messages/s, {duration}s per cell")
        dur = bench_durable(sizes, batches, runs, duration, max_bytes)
        for key, title in (("typical_mps", "typical durable msg/s = batch / median batch latency"),
                           ("mps", "durable msg/s over the whole cell (mean; hit by fsync stalls)")):
            say(f"\n{title} (fsyncs per message), medians of {runs} runs")
            say(common.table(["body", "batch", *VARIANTS], [
                [f"{size // 1024} KiB", b, *[f"{fmt(dur[k][size][b][key])} ({dur[k][size][b]['fsync_per_msg']:.2f})"
                                            for k in VARIANTS]]
                for size in sizes for b in batches]))

        def ratio(a: str, b: str, size: int, batch: int) -> float:
            return dur[a][size][batch]["typical_mps"] / dur[b][size][batch]["typical_mps"]

        summary.update({
            "durable_typical_mps": {k: {str(s): {str(b): round(v["typical_mps"], 1) for b, v in bs.items()}
                                        for s, bs in ss.items()} for k, ss in dur.items()},
            "durable_mps": {k: {str(s): {str(b): round(v["mps"], 1) for b, v in bs.items()} for s, bs in ss.items()}
                            for k, ss in dur.items()},
            "fsync_per_msg": {k: {str(s): {str(b): round(v["fsync_per_msg"], 3) for b, v in bs.items()}
                                  for s, bs in ss.items()} for k, ss in dur.items()},
            "segments2thr_over_inline": {f"{s}/{b}": round(ratio("segments-2thr", "inline", s, b), 2)
                                         for s in sizes for b in batches},
            "segmentsseq_over_inline": {f"{s}/{b}": round(ratio("segments-seq", "inline", s, b), 2)
                                        for s in sizes for b in batches},
        })

    if "scan" in only:
        say("\n[2] runner pass over a garbage-heavy log, bodies inline vs. in data segments")
        scale = 4 if quick else 1
        layouts: list[tuple[str, int | None, int]] = [
            ("no bodies (data segments)", None, 40_000 // scale),
            ("inline 4 KiB", 4096, 40_000 // scale),
            ("inline 100 KiB", 100 * 1024, 4_000 // scale),
        ]
        scan = bench_scan(layouts, max(runs, 3))
        say(common.table(["queue log", "log MiB", "runner read MiB", "warm msg/s", "cold msg/s", "warm rec/s"], [
            [k, fmt(v["log_mib"]), fmt(v["read_mib"]), fmt(v["warm_msgs_per_s"]), fmt(v["cold_msgs_per_s"]),
             fmt(v["warm_records_per_s"])] for k, v in scan.items()]))
        summary["scan"] = {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in scan.items()}

    if "defer" in only:
        say("\n[3] deferral cost with the engine as it is")
        defer = bench_defer(sizes, 200 if quick else 1000)
        summary["defer"] = {str(k): {kk: round(vv, 1) for kk, vv in v.items()} for k, v in defer.items()}

    say(f"\nelapsed {time.perf_counter() - t_start:.0f}s, load average now {common.load_average()}")
    common.emit_json(summary)


if __name__ == "__main__":
    main()
