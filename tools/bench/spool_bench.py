"""Spool engine benchmarks: batched appends, group commit, runner scan, recovery.

    .venv/bin/python tools/bench/spool_bench.py [--quick] [--runs N] [--profile]

What it measures (benchmarks, never timed tests: docs/benchmarks.md), each as the median
of several runs:

1. Envelope records appended durably in batches of 1,000 through the engine's
   append path (fields -> CBOR -> frame -> LogWriter, one fdatasync per
   batch), next to a bare loop that does only CBOR (cbor2.dumps) + framing +
   pwrite + fdatasync of records of the same size and shape; plus
   ``Spool.enqueue_many`` (body + envelope) for reference.
2. One-at-a-time durable enqueue through ``AsyncSpool`` (trio group commit) at
   concurrency 1, 10 and 100: messages/s and fsyncs per message.
3. A runner pass over a garbage-heavy log (bodies, garbage envelopes, START,
   DELIVERY, FINISH; 2% of the units hold a live deferred envelope).
4. Recovery: a queue of N deferred messages is built in a child process, then
   ``Spool.open`` is timed in fresh child processes, with their peak RSS.

The last line printed is one JSON object (see ``main``). Temp dirs live on the
real disk ($BENCH_DIR, else the temp dir unless it is tmpfs) and are removed.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import math
import os
import pstats
import subprocess
import sys
import time
from typing import Any

import cbor2
import common
import trio
from common import fmt, median, say
from crc32c import crc32c

from spool.aio.async_spool import AsyncSpool
from spool.config.engine import SpoolConfig
from spool.engine.runner import Runner
from spool.engine.spool import Attempt, Spool
from spool.fileio import OsFileIO
from spool.format.record import (
    HEADER,
    Delivery,
    Envelope,
    Finish,
    Outcome,
    RecordType,
    Start,
    Status,
    encode_frame,
    envelope_payload,
    make_pos,
)
from spool.format.segment import SEGMENT_HEADER_SIZE

SENDER = "alice@example.org"
RCPTS = ("bob@example.net",)
BATCH = 1000
NO_CHECKPOINTS = SpoolConfig(checkpoint_interval=math.inf)
DEFERRED = Outcome(RCPTS[0], Status.DEFERRED, 451, "4.3.0", "451 4.3.0 try again later", "mx.example.net")


# -- 1. batched durable appends -------------------------------------------------


def bare_append(path: str, n: int) -> tuple[float, float, float]:
    """CBOR + framing + pwrite + fdatasync per 1,000 records, no engine: the floor.

    The records are the engine's, byte for byte in size and shape: the ids are
    positions (segment 1, so 9-byte CBOR integers, as the engine's are), not file
    offsets (which made each record 8 bytes shorter than the engine's). One id
    per batch, computed once: that costs the bare loop nothing per record.

    Returns (records/s, seconds spent in commit: pwrite + fdatasync, as the engine's is
    timed, records per CPU-second)."""
    fd = os.open(os.path.join(path, "bare.log"), os.O_RDWR | os.O_CREAT, 0o600)
    pack = HEADER.pack
    off = 0
    now = int(time.time())
    ms = now * 1000
    t_sync = 0.0
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(n // BATCH):
        buf = bytearray()
        pos = make_pos(1, SEGMENT_HEADER_SIZE + off)
        for _ in range(BATCH):
            payload = cbor2.dumps({0: pos, 1: SENDER, 2: list(RCPTS), 3: [pos], 4: 1024, 5: ms, 6: 0})
            head = pack(0, len(payload), 1, 0, 0, 0, now)
            crc = crc32c(payload, crc32c(head[10:], crc32c(head[4:9])))
            buf += pack(crc, len(payload), 1, 0, 0, 0, now)
            buf += payload
        ts = time.perf_counter()
        os.pwrite(fd, buf, off)
        off += len(buf)
        os.fdatasync(fd)
        t_sync += time.perf_counter() - ts
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    os.close(fd)
    return n / dt, t_sync, n / cpu


def engine_append(path: str, n: int) -> tuple[float, float, float]:
    """Envelope records through the engine: envelope_payload, LogWriter.append, Spool.commit (the path
    ``SpoolCore.append_message`` takes for a new message's envelope).

    Returns (records/s, seconds spent in commit: pwrite + fdatasync, records per CPU-second)."""
    sp = Spool.open(path, NO_CHECKPOINTS)
    try:
        w = sp.writer
        ms = int(time.time() * 1000)
        clock = time.time
        t_sync = 0.0
        c0 = time.process_time()
        t0 = time.perf_counter()
        fsyncs = w.fsyncs
        for _ in range(n // BATCH):
            now = clock()  # once per batch, as a batch API takes it: the records share their second
            for _ in range(BATCH):
                head = w.head
                w.append(RecordType.ENVELOPE, envelope_payload(head, SENDER, RCPTS, (head,), 1024, ms), klass=0,
                         now=now)
            ts = time.perf_counter()
            sp.commit()
            t_sync += time.perf_counter() - ts
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        # The same fsync count as the bare loop's: one fdatasync a batch, nothing else (no directory sync).
        assert w.fsyncs - fsyncs == n // BATCH, (w.fsyncs - fsyncs, n // BATCH)
        return n / dt, t_sync, n / cpu
    finally:
        sp.close()


def engine_enqueue_many(path: str, n: int, body: bytes = b"x" * 100) -> float:
    """``Spool.enqueue_many`` of 1,000 messages per commit (a DATA and an ENVELOPE record each)."""
    sp = Spool.open(path, NO_CHECKPOINTS)
    try:
        msgs = [(SENDER, RCPTS, body)] * BATCH
        t0 = time.perf_counter()
        for _ in range(n // BATCH):
            sp.enqueue_many(msgs)
        return n / (time.perf_counter() - t0)
    finally:
        sp.close()


def bench_append(n: int, runs: int) -> dict[str, Any]:
    bare: list[float] = []
    eng: list[float] = []
    many: list[float] = []
    ratios: list[float] = []
    bare_cpu: list[float] = []
    eng_cpu: list[float] = []
    syncs: list[float] = []
    bare_syncs: list[float] = []
    bare_pcpu: list[float] = []
    eng_pcpu: list[float] = []
    for r in range(runs):
        # Interleaved, so that load from elsewhere hits the variants alike.
        with common.temp_dir("bare") as d:
            b, b_sync, b_cpu = bare_append(d, n)
        with common.temp_dir("append") as d:
            e, e_sync, e_cpu = engine_append(d, n)
        with common.temp_dir("many") as d:
            m = engine_enqueue_many(d, n)
        bare.append(b)
        eng.append(e)
        many.append(m)
        ratios.append(e / b)
        # The same figures without the time spent in commit (pwrite + fdatasync, timed alike on both sides).
        bare_cpu.append(n / (n / b - b_sync))
        eng_cpu.append(n / (n / e - e_sync))
        bare_pcpu.append(b_cpu)
        eng_pcpu.append(e_cpu)
        bare_syncs.append(b_sync / (n // BATCH) * 1000)
        syncs.append(e_sync / (n // BATCH) * 1000)
        say(f"  run {r + 1}: bare {fmt(b)}/s  engine {fmt(e)}/s  enqueue_many {fmt(m)} msg/s; "
            f"without commit time: bare {fmt(bare_cpu[-1])}/s engine {fmt(eng_cpu[-1])}/s; "
            f"per CPU-second: bare {fmt(b_cpu)} engine {fmt(e_cpu)}; "
            f"commit (pwrite+fdatasync) per batch: bare {bare_syncs[-1]:.2f} engine {syncs[-1]:.2f} ms "
            f"(load {common.load_average()})")
    return {"bare_rps": median(bare), "engine_rps": median(eng), "enqueue_many_mps": median(many),
            "ratio": median(ratios), "bare_best": max(bare), "engine_best": max(eng),
            "bare_rps_nosync": median(bare_cpu), "engine_rps_nosync": median(eng_cpu),
            "ratio_nosync": median([e / b for e, b in zip(eng_cpu, bare_cpu)]), "sync_ms": median(syncs),
            "bare_sync_ms": median(bare_syncs),
            "bare_rps_cpu": median(bare_pcpu), "engine_rps_cpu": median(eng_pcpu),
            "ratio_cpu": median([e / b for e, b in zip(eng_pcpu, bare_pcpu)])}


def probe_file(path: str, kind: str, batches: int, size: int) -> float:
    """Median fdatasync (ms) after each write of ``size`` bytes appended to a file that is ``kind``:
    "growing" (the spool's segments, and the bare loop's file), "fallocated" (posix_fallocate: unwritten
    extents), "keep_size" (the same with FALLOC_FL_KEEP_SIZE: blocks held, the size still grows with the
    writes, so a reader sees what it sees now) or "zeroed" (every block written and synced first)."""
    name = os.path.join(path, kind)
    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        total = batches * size
        if kind == "fallocated":
            os.posix_fallocate(fd, 0, total)
        elif kind == "keep_size":
            libc = ctypes.CDLL(None, use_errno=True)
            libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
            if libc.fallocate(fd, 1, 0, total) != 0:  # 1: FALLOC_FL_KEEP_SIZE
                raise OSError(ctypes.get_errno(), "fallocate(FALLOC_FL_KEEP_SIZE)")
        elif kind == "zeroed":
            zeros = bytes(1 << 20)
            for off in range(0, total, len(zeros)):
                os.pwrite(fd, zeros, off)
        os.fsync(fd)
        dfd = os.open(path, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        data = os.urandom(size)
        lat = []
        for i in range(batches):
            os.pwrite(fd, data, i * size)
            t = time.perf_counter()
            os.fdatasync(fd)
            lat.append(time.perf_counter() - t)
        return median(lat) * 1000
    finally:
        os.close(fd)
        os.unlink(name)


def bench_file_probe(runs: int, batches: int = 60, size: int = 91_000) -> dict[str, float]:
    """Why a commit costs what it does on this disk: the fdatasync after a 1,000-envelope batch (91 kB) into
    a growing, a fallocated, a fallocated-keeping-its-size and a zero-filled file, interleaved."""
    kinds = ("growing", "fallocated", "keep_size", "zeroed")
    res: dict[str, list[float]] = {k: [] for k in kinds}
    with common.temp_dir("probe") as d:
        for r in range(runs):
            for k in kinds:
                res[k].append(probe_file(d, k, batches, size))
            say(f"  run {r + 1}: median fdatasync after a {size:,}-byte write: "
                + ", ".join(f"{k} {res[k][-1]:.3f} ms" for k in kinds) + f" (load {common.load_average()})")
    return {f"fdatasync_ms_{k}": median(v) for k, v in res.items()}


# -- 2. group commit: one-at-a-time enqueue at concurrency c --------------------------


async def _concurrent(path: str, concurrency: int, duration: float, body: bytes) -> dict[str, float]:
    asp = await AsyncSpool.open(path, SpoolConfig())
    try:
        async with trio.open_nursery() as outer:
            await outer.start(asp.run)
            await asp.enqueue(SENDER, RCPTS, body)  # warm up
            w = asp.core.writer
            f0, c0 = w.fsyncs, w.commits
            count = 0
            lat: list[float] = []
            deadline = time.perf_counter() + duration

            async def client() -> None:
                nonlocal count
                while time.perf_counter() < deadline:
                    t = time.perf_counter()
                    await asp.enqueue(SENDER, RCPTS, body)
                    lat.append(time.perf_counter() - t)
                    count += 1

            cpu0 = time.process_time()
            t0 = time.perf_counter()
            async with trio.open_nursery() as clients:
                for _ in range(concurrency):
                    clients.start_soon(client)
            dt = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            fsyncs, commits = w.fsyncs - f0, w.commits - c0
            outer.cancel_scope.cancel()
    finally:
        asp.core.close()
    return {"mps": count / dt, "fsync_per_msg": fsyncs / count, "msgs_per_commit": count / max(commits, 1),
            "messages": count, "p50_ms": median(lat) * 1000, "cpu_us_per_msg": cpu / count * 1e6}


def bench_concurrency(levels: list[int], duration: float, runs: int, body: bytes) -> dict[int, dict[str, float]]:
    res: dict[int, list[dict[str, float]]] = {c: [] for c in levels}
    for r in range(runs):
        for c in levels:
            with common.temp_dir(f"c{c}") as d:
                out = trio.run(_concurrent, d, c, duration, body)
            res[c].append(out)
            say(f"  run {r + 1} c={c}: {fmt(out['mps'])} msg/s, {out['fsync_per_msg']:.3f} fsync/msg, "
                f"{out['msgs_per_commit']:.1f} msg/commit, p50 latency {out['p50_ms']:.1f} ms, "
                f"{out['cpu_us_per_msg']:.0f} CPU-us/msg")
    return {c: {k: median([o[k] for o in outs]) for k in outs[0]} for c, outs in res.items()}


# -- 3. runner scan over a garbage-heavy log -------------------------------------------


def build_scan_log(sp: Spool, units: int, body: bytes) -> tuple[int, int]:
    """Message units: DATA, ENVELOPE (garbage), START, DELIVERY, FINISH; every 50th unit
    is DATA + a live ENVELOPE of class 2 instead. Returns (records, live envelopes)."""
    w = sp.writer
    now = time.time()
    ms = int(now * 1000)
    env = Envelope(make_pos(1, 64), SENDER, RCPTS, (make_pos(1, 32),), len(body), ms).to_payload()
    start = Start(make_pos(1, 64), ms).to_payload()
    delivery = Delivery(make_pos(1, 96), ms, (DEFERRED,)).to_payload()
    finish = Finish(make_pos(1, 96), ms, make_pos(1, 128)).to_payload()
    records = live = 0
    for u in range(units):
        w.append(RecordType.DATA, body, now=now)
        if u % 50 == 0:
            w.append(RecordType.ENVELOPE, env, klass=2, now=now)
            records += 2
            live += 1
        else:
            w.mark_after_sync(w.append(RecordType.ENVELOPE, env, klass=1, now=now))
            w.append(RecordType.START, start, now=now)
            w.append(RecordType.DELIVERY, delivery, now=now)
            w.append(RecordType.FINISH, finish, now=now)
            records += 5
        if u % 20000 == 19999:
            sp.commit()
    sp.commit()
    w.sync_all()
    return records, live


def scan_once(sp: Spool, klass: int) -> tuple[float, int, int]:
    origin = make_pos(1, SEGMENT_HEADER_SIZE)
    r = Runner(sp.io, sp.log_dir, klass, 0.0, origin)
    try:
        c0 = time.process_time()
        t0 = time.perf_counter()
        found = r.scan(sp.writer, 1e12, 10**9, ())
        dt = time.perf_counter() - t0
        scan_once.cpu = time.process_time() - c0  # type: ignore[attr-defined]
        return dt, r.records_scanned, len(found)
    finally:
        r.close()


def bench_scan(units: int, runs: int) -> dict[str, Any]:
    with common.temp_dir("scan") as d:
        sp = Spool.open(d, NO_CHECKPOINTS)
        try:
            t_build, (records, live) = common.timed(lambda: build_scan_log(sp, units, b"b" * 200))
            size = sum(os.path.getsize(os.path.join(sp.log_dir, f)) for f in os.listdir(sp.log_dir))
            say(f"  built {fmt(records)} records ({live} live envelopes, {size / 2**20:.0f} MiB) in {t_build:.1f}s")
            gar: list[float] = []
            dfr: list[float] = []
            dfr_cpu: list[float] = []
            for r in range(runs):
                dt0, n0, f0 = scan_once(sp, 0)  # nothing of its class: passes everything
                dt2, _n2, f2 = scan_once(sp, 2)  # decodes the 2% live deferred envelopes
                dfr_cpu.append(records / scan_once.cpu)  # type: ignore[attr-defined]
                assert f0 == 0 and f2 == live and n0 <= records, (n0, records, f0, f2, live)
                gar.append(records / dt0)
                dfr.append(records / dt2)
                say(f"  run {r + 1}: pass with nothing due {fmt(records / dt0)} rec/s; "
                    f"pass returning {f2} due envelopes {fmt(records / dt2)} rec/s "
                    f"({fmt(dfr_cpu[-1])} per CPU-second)")
        finally:
            sp.close()
    return {"records": records, "live": live, "bytes": size, "scan_rps": median(dfr), "scan_rps_nothing_due":
            median(gar), "scan_rps_cpu": median(dfr_cpu)}


# -- 4. recovery time and RSS vs. queue size ---------------------------------------------


def child_build_direct(path: str, n: int) -> dict[str, Any]:
    """The record stream ``child_build`` makes, appended straight through the LogWriter.

    Why: on a loaded 2-core machine the engine's per-message Python work makes a
    1M-message build take most of an hour. Per 10,000-message chunk this writes
    what the engine writes, in its order and with its commits: DATA + ENVELOPE
    (class 0) per message; START per message (its envelope marked garbage after
    the sync) and DELIVERY (DEFERRED); then DATA (the body copied forward) +
    replacement ENVELOPE (class 1) + FINISH. Then the new-mail runner is put at
    the head (it has passed everything) and a checkpoint is taken.
    """
    sp = Spool.open(path, SpoolConfig(checkpoint_interval=math.inf))
    w = sp.writer
    body = b"m" * 100
    dumps = cbor2.dumps
    t0 = time.perf_counter()
    done = 0
    while done < n:
        k = min(10_000, n - done)
        now = time.time()
        ms = int(now * 1000)
        envs = []
        for _ in range(k):
            data = w.append(RecordType.DATA, body, now=now)
            mid = w.head
            envs.append((mid, data))
            w.append(RecordType.ENVELOPE, dumps({0: mid, 1: SENDER, 2: list(RCPTS), 3: [data], 4: 100, 5: ms, 6: 0}),
                     klass=0, now=now)
        sp.commit()
        starts = []
        for mid, _data in envs:
            st = w.append(RecordType.START, dumps({0: mid, 1: ms}), now=now)
            w.mark_after_sync(mid)
            starts.append(st)
            w.append(RecordType.DELIVERY, dumps({0: st, 1: ms, 2: [DEFERRED.to_list()]}), now=now)
        sp.commit()
        for (mid, _data), st in zip(envs, starts):
            data = w.append(RecordType.DATA, body, now=now)
            rep = w.append(RecordType.ENVELOPE, dumps({0: mid, 1: SENDER, 2: list(RCPTS), 3: [data], 4: 100,
                                                       5: ms, 6: 1, 7: mid, 10: {}}), klass=1, now=now)
            w.append(RecordType.FINISH, dumps({0: st, 1: ms, 2: rep}), now=now)
        sp.commit()
        done += k
    sp.runners[0].pos = w.head
    sp.checkpoint()
    dt = time.perf_counter() - t0
    sp.close()
    log_dir = os.path.join(path, "log")
    size = sum(os.path.getsize(os.path.join(log_dir, f)) for f in os.listdir(log_dir))
    return {"build_s": dt, "bytes": size, "segments": len(os.listdir(log_dir))}


def child_build_synthetic(path: str, n: int) -> dict[str, Any]:
    """Segments of the same shape as ``child_build_direct`` writes, made by repeating one
    message's seven encoded frames (DATA, garbage ENVELOPE, START, DELIVERY, DATA,
    class-1 ENVELOPE, FINISH) per segment, plus a checkpoint at the head.

    Why: on a machine shared by a dozen busy processes the record-stream build of 1M
    messages takes over an hour. Recovery reads segment names, the checkpoint and the
    working suffix, never the deferred records themselves (the ``records_read`` column
    shows it), so frames with valid checksums, types, classes and sizes stand in for
    them; the references inside their payloads are not meaningful (``spoolctl verify``
    would say so).
    """
    from spool.format import checkpoint as ckpt
    from spool.format.record import GARBAGE
    from spool.format.segment import encode_segment_header, segment_path

    seg_size = SpoolConfig().segment_size
    sp = Spool.open(path, SpoolConfig(checkpoint_interval=math.inf))
    log_dir = sp.log_dir
    sp.close()
    t0 = time.perf_counter()
    now = int(time.time())
    ms = now * 1000
    body = b"m" * 100
    seg = 0
    done = 0
    end = SEGMENT_HEADER_SIZE
    while done < n:
        seg += 1
        base = SEGMENT_HEADER_SIZE
        mid, st, rep_pos = make_pos(seg, base + 16 + len(body)), make_pos(seg, base + 300), make_pos(seg, base + 500)
        env = cbor2.dumps({0: mid, 1: SENDER, 2: list(RCPTS), 3: [make_pos(seg, base)], 4: 100, 5: ms, 6: 0})
        frames = [
            encode_frame(seg, RecordType.DATA, body, time=now),
            encode_frame(seg, RecordType.ENVELOPE, env, klass=0, time=now, flags=GARBAGE),
            encode_frame(seg, RecordType.START, cbor2.dumps({0: mid, 1: ms}), time=now),
            encode_frame(seg, RecordType.DELIVERY, cbor2.dumps({0: st, 1: ms, 2: [DEFERRED.to_list()]}), time=now),
            encode_frame(seg, RecordType.DATA, body, time=now),
            encode_frame(seg, RecordType.ENVELOPE, cbor2.dumps({0: mid, 1: SENDER, 2: list(RCPTS), 3: [mid], 4: 100,
                                                                5: ms, 6: 1, 7: mid, 10: {}}), klass=1, time=now),
            encode_frame(seg, RecordType.FINISH, cbor2.dumps({0: st, 1: ms, 2: rep_pos}), time=now),
        ]
        block = b"".join(frames)
        k = min(n - done, (seg_size - SEGMENT_HEADER_SIZE) // len(block))
        fd = os.open(segment_path(log_dir, seg), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, encode_segment_header(seg, now), 0)
            off = SEGMENT_HEADER_SIZE
            step = max(1, (8 << 20) // len(block))
            for i in range(0, k, step):
                chunk = block * min(step, k - i)
                os.pwrite(fd, chunk, off)
                off += len(chunk)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        end = off
        done += k
    head = make_pos(seg, end)
    origin = make_pos(1, SEGMENT_HEADER_SIZE)
    cfg = SpoolConfig()
    runners = (head, *([origin] * (cfg.classes - 1)))
    ckpt.store(OsFileIO(), path, ckpt.Checkpoint(head, head, origin, runners, ms, 2))
    dt = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(log_dir, f)) for f in os.listdir(log_dir))
    return {"build_s": dt, "bytes": size, "segments": len(os.listdir(log_dir))}


def child_build(path: str, n: int) -> dict[str, Any]:
    """N messages, each enqueued, attempted, DEFERRED and finished (a class-1 replacement)."""
    cfg = SpoolConfig(checkpoint_interval=math.inf)
    sp = Spool.open(path, cfg)
    body = b"m" * 100
    chunk = min(cfg.active_limit, 10_000)
    t0 = time.perf_counter()
    done = 0
    while done < n:
        k = min(chunk, n - done)
        sp.enqueue_many([(SENDER, RCPTS, body)] * k)
        attempts: list[Attempt] = []
        while len(attempts) < k:
            got = sp.poll_due(limit=k - len(attempts))
            if not got:
                raise RuntimeError("runner found fewer new messages than were enqueued")
            attempts += got
        for a in attempts:
            sp.record_delivery(a, (DEFERRED,))
        sp.commit()
        for a in attempts:
            sp.finish(a)
        sp.commit()
        done += k
    sp.checkpoint()
    dt = time.perf_counter() - t0
    sp.close()
    size = sum(os.path.getsize(os.path.join(path, "log", f)) for f in os.listdir(os.path.join(path, "log")))
    return {"build_s": dt, "bytes": size, "segments": len(os.listdir(os.path.join(path, "log")))}


def child_open(path: str) -> dict[str, Any]:
    base = common.peak_rss_mb()
    c0 = time.process_time()
    t0 = time.perf_counter()
    sp = Spool.open(path, SpoolConfig())
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    st = sp.recovery_stats
    out = {"open_s": dt, "cpu_s": cpu, "rss_mb": common.peak_rss_mb(), "rss_base_mb": base,
           "records_read": st.records_read, "bytes_read": st.bytes_read, "in_flight": st.in_flight}
    sp.close()
    return out


def _child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def bench_recovery(sizes: list[int], runs: int, build: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for n in sizes:
        with common.temp_dir(f"rec{n}") as d:
            built = _child(f"--child-build-{build}", d, str(n))
            say(f"  queue of {fmt(n)} deferred: built in {built['build_s']:.1f}s, "
                f"{built['bytes'] / 2**20:.0f} MiB in {built['segments']} segments")
            opens = []
            for r in range(runs):
                o = _child("--child-open", d)
                opens.append(o)
                say(f"    open {r + 1}: {o['open_s'] * 1000:.1f} ms ({o['cpu_s'] * 1000:.1f} ms CPU), "
                    f"peak RSS {o['rss_mb']:.1f} MB "
                    f"(after imports {o['rss_base_mb']:.1f}), read {o['records_read']} records")
            out[n] = {"recovery_s": median([o["open_s"] for o in opens]),
                      "recovery_cpu_s": median([o["cpu_s"] for o in opens]),
                      "rss_mb": median([o["rss_mb"] for o in opens]),
                      "rss_base_mb": median([o["rss_base_mb"] for o in opens]),
                      "records_read": median([o["records_read"] for o in opens]),
                      "bytes_read": median([o["bytes_read"] for o in opens]),
                      "build_s": built["build_s"], "bytes": built["bytes"]}
    return out


# -- 5. CPU cost per record, best of many short repeats ---------------------------------------


def bench_micro(repeats: int) -> dict[str, float]:
    """The minimum over many short repeats (the timeit convention): what one record costs
    on a core that nobody else wants, without fsync. On a loaded machine the medians
    above measure the load as much as the code; these minima are the code's ceiling."""
    now = int(time.time())
    ms = now * 1000
    pack = HEADER.pack

    def bare() -> None:
        buf = bytearray()
        pos = make_pos(1, SEGMENT_HEADER_SIZE)
        for _ in range(BATCH):
            payload = cbor2.dumps({0: pos, 1: SENDER, 2: list(RCPTS), 3: [pos], 4: 1024, 5: ms, 6: 0})
            head = pack(0, len(payload), 1, 0, 0, 0, now)
            crc = crc32c(payload, crc32c(head[10:], crc32c(head[4:9])))
            buf += pack(crc, len(payload), 1, 0, 0, 0, now)
            buf += payload

    out: dict[str, float] = {}
    with common.temp_dir("micro") as d:
        sp = Spool.open(d, NO_CHECKPOINTS)
        try:
            w = sp.writer
            clock = time.time

            def engine() -> None:
                now = clock()
                for _ in range(BATCH):
                    head = w.head
                    w.append(RecordType.ENVELOPE, envelope_payload(head, SENDER, RCPTS, (head,), 1024, ms),
                             klass=0, now=now)

            for name, fn in (("bare", bare), ("engine", engine)):
                best = math.inf
                for _ in range(repeats):
                    dt, _r = common.timed(fn)
                    best = min(best, dt)
                    if name == "engine":
                        sp.commit()
                out[f"{name}_us_per_record"] = best / BATCH * 1e6
        finally:
            sp.close()
    with common.temp_dir("micro-scan") as d:
        sp = Spool.open(d, NO_CHECKPOINTS)
        try:
            records, _live = build_scan_log(sp, 10_000, b"b" * 200)
            out["scan_rps_best"] = records / min(scan_once(sp, 2)[0] for _ in range(max(3, repeats // 5)))
            out["scan_rps_nothing_due_best"] = records / min(scan_once(sp, 0)[0] for _ in range(max(3, repeats // 5)))
        finally:
            sp.close()
    say(f"  per record: bare {out['bare_us_per_record']:.2f} us, engine {out['engine_us_per_record']:.2f} us "
        f"(ratio {out['engine_us_per_record'] / out['bare_us_per_record']:.2f}); runner pass best "
        f"{fmt(out['scan_rps_best'])} rec/s, with nothing due {fmt(out['scan_rps_nothing_due_best'])} rec/s")
    return out


# -- profiling -------------------------------------------------------------------------------


def profile(label: str, fn: Any) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    say(f"\n--- cProfile: {label} (by own time) ---")
    say("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])


def run_profiles(n: int, units: int) -> None:
    with common.temp_dir("prof") as d:
        profile(f"engine_append {n} records", lambda: engine_append(d, n))
    with common.temp_dir("prof") as d:
        profile("AsyncSpool enqueue, concurrency 100, 3 s",
                lambda: trio.run(_concurrent, d, 100, 3.0, b"x" * 1024))
    with common.temp_dir("prof") as d:
        sp = Spool.open(d, NO_CHECKPOINTS)
        build_scan_log(sp, units, b"b" * 200)
        profile("runner pass, class 2", lambda: scan_once(sp, 2))
        sp.close()


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, about a minute")
    ap.add_argument("--runs", type=int, default=0, help="runs per figure (default 3)")
    ap.add_argument("--only", default="append,commit,scan,recovery,micro",
                    help="comma-separated sections to run (default: all but probe; also: probe, fdatasync into "
                         "growing / fallocated / zero-filled files)")
    ap.add_argument("--sizes", default="", help="recovery queue sizes, comma-separated (default by mode)")
    ap.add_argument("--profile", action="store_true", help="cProfile the hot paths instead of benchmarking")
    ap.add_argument("--child-build-engine", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-build-synthetic", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-build-direct", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--child-open", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--build", choices=["engine", "direct", "synthetic"], default="synthetic",
                    help="how recovery queues are built: the engine's API (slowest), its record stream through "
                         "the LogWriter, or repeated pre-encoded frames (default; see child_build_synthetic)")
    ap.add_argument("--records", type=int, default=0, help="records per run of the batched-append figure")
    args = ap.parse_args()
    common.exit_on_sigterm()
    if args.child_build_engine:
        common.emit_json(child_build(args.child_build_engine[0], int(args.child_build_engine[1])))
        return
    if args.child_build_synthetic:
        common.emit_json(child_build_synthetic(args.child_build_synthetic[0], int(args.child_build_synthetic[1])))
        return
    if args.child_build_direct:
        common.emit_json(child_build_direct(args.child_build_direct[0], int(args.child_build_direct[1])))
        return
    if args.child_open:
        common.emit_json(child_open(args.child_open))
        return

    quick = args.quick
    runs = args.runs or 3
    n_append = args.records or (50_000 if quick else 100_000)
    levels = [1, 10, 100]
    duration = 1.5 if quick else 3.0
    scan_units = 60_000 if quick else 120_000
    sizes = [10_000, 50_000] if quick else [10_000, 100_000, 1_000_000]
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
    only = set(args.only.split(","))
    if args.profile:
        run_profiles(n_append, scan_units)
        return

    t_start = time.perf_counter()
    mach = common.machine()
    say(f"spool_bench {'--quick' if quick else '(full)'}: {runs} runs per figure, sections {sorted(only)}; "
        f"machine {mach}")
    rows: list[list[Any]] = []
    result: dict[str, Any] = {"quick": quick, "runs": runs, "machine": mach}
    targets: dict[str, bool] = {}

    if "append" in only:
        say(f"\n[1] durable appends in batches of {BATCH} ({fmt(n_append)} records per run)")
        app = bench_append(n_append, runs)
        targets["batched_append_200k"] = app["engine_rps"] >= 200_000
        rows += [
            ["bare CBOR+fdatasync loop, records/s", fmt(app["bare_rps"]), "(reference)", ""],
            ["engine envelope appends, records/s", fmt(app["engine_rps"]), ">= 200,000",
             targets["batched_append_200k"]],
            ["engine / bare (median of paired runs)", f"{app['ratio']:.2f}", "", ""],
            ["same without time in commit: bare, engine, ratio",
             f"{fmt(app['bare_rps_nosync'])}, {fmt(app['engine_rps_nosync'])}, {app['ratio_nosync']:.2f}", "", ""],
            ["same per CPU-second: bare, engine, ratio",
             f"{fmt(app['bare_rps_cpu'])}, {fmt(app['engine_rps_cpu'])}, {app['ratio_cpu']:.2f}", "", ""],
            ["commit (pwrite+fdatasync) per 1,000-record batch, ms: bare, engine",
             f"{app['bare_sync_ms']:.2f}, {app['sync_ms']:.2f}", "", ""],
            ["enqueue_many (body+envelope), msg/s", fmt(app["enqueue_many_mps"]), "", ""],
        ]
        result.update({
            "batched_append_rps": round(app["engine_rps"]),
            "bare_append_rps": round(app["bare_rps"]),
            "append_ratio": round(app["ratio"], 3),
            "batched_append_rps_nosync": round(app["engine_rps_nosync"]),
            "bare_append_rps_nosync": round(app["bare_rps_nosync"]),
            "append_ratio_nosync": round(app["ratio_nosync"], 3),
            "commit_ms_per_batch": round(app["sync_ms"], 2),
            "bare_commit_ms_per_batch": round(app["bare_sync_ms"], 2),
            "batched_append_rps_cpu": round(app["engine_rps_cpu"]),
            "bare_append_rps_cpu": round(app["bare_rps_cpu"]),
            "append_ratio_cpu": round(app["ratio_cpu"], 3),
            "enqueue_many_mps": round(app["enqueue_many_mps"]),
        })

    if "probe" in only:
        say("\n[1b] fdatasync after appending into a growing, a fallocated (with and without its size) and a "
            "zero-filled file")
        probe = bench_file_probe(runs)
        rows.append(["fdatasync after a 91 kB write, ms: growing, fallocated, keep-size, zero-filled file",
                     ", ".join(f"{probe[f'fdatasync_ms_{k}']:.3f}"
                               for k in ("growing", "fallocated", "keep_size", "zeroed")),
                     "", ""])
        result.update({k: round(v, 3) for k, v in probe.items()})

    if "commit" in only:
        say(f"\n[2] one-at-a-time durable enqueue via AsyncSpool, 1 KiB body, {duration:.0f}s per run")
        conc = bench_concurrency(levels, duration, runs, b"x" * 1024)
        targets["fsync_per_msg_c100_le_0.1"] = conc[100]["fsync_per_msg"] <= 0.1
        rows += [[f"AsyncSpool c={c}: msg/s, fsync/msg, msg/commit, p50 ms",
                  f"{fmt(conc[c]['mps'])}, {conc[c]['fsync_per_msg']:.3f}, {conc[c]['msgs_per_commit']:.1f}, "
                  f"{conc[c]['p50_ms']:.1f}",
                  "<= 0.1 fsync/msg" if c == 100 else "", targets["fsync_per_msg_c100_le_0.1"] if c == 100 else ""]
                 for c in levels]
        result.update({
            **{f"enqueue_mps_c{c}": round(conc[c]["mps"], 1) for c in levels},
            **{f"fsync_per_msg_c{c}": round(conc[c]["fsync_per_msg"], 4) for c in levels},
            **{f"enqueue_p50_ms_c{c}": round(conc[c]["p50_ms"], 2) for c in levels},
            **{f"enqueue_cpu_us_per_msg_c{c}": round(conc[c]["cpu_us_per_msg"], 1) for c in levels},
        })

    if "scan" in only:
        say(f"\n[3] runner pass over a garbage-heavy log ({fmt(scan_units)} message units)")
        scan = bench_scan(scan_units, runs)
        targets["scan_1M"] = scan["scan_rps"] >= 1_000_000
        rows += [
            ["runner pass returning due envelopes, records/s", fmt(scan["scan_rps"]), ">= 1,000,000",
             targets["scan_1M"]],
            ["runner pass with nothing due, records/s", fmt(scan["scan_rps_nothing_due"]), "", ""],
            ["runner pass returning due envelopes, records per CPU-second", fmt(scan["scan_rps_cpu"]), "", ""],
        ]
        result.update({"scan_rps": round(scan["scan_rps"]), "scan_rps_nothing_due": round(scan["scan_rps_nothing_due"]),
                       "scan_rps_cpu": round(scan["scan_rps_cpu"]), "scan_records": scan["records"]})

    if "recovery" in only:
        say(f"\n[4] recovery (Spool.open in a fresh process) vs. deferred queue size {sizes}, "
            f"built by: {args.build}")
        rec = bench_recovery(sizes, runs, args.build)
        biggest = sizes[-1]
        rec_times = [rec[n]["recovery_s"] for n in sizes]
        spread = max(rec_times) / min(rec_times)
        cpu_times = [rec[n]["recovery_cpu_s"] for n in sizes]
        targets.update({
            "recovery_lt_1s": max(rec_times) < 1.0,
            "recovery_within_2x": spread <= 2.0,
            "rss_lt_150MB_at_largest": rec[biggest]["rss_mb"] < 150,
        })
        rows += [*[[f"recovery with {fmt(n)} deferred: ms, CPU ms, peak RSS MB, records read",
                    f"{rec[n]['recovery_s'] * 1000:.1f}, {rec[n]['recovery_cpu_s'] * 1000:.1f}, "
                    f"{rec[n]['rss_mb']:.1f}, {fmt(rec[n]['records_read'])}",
                    "< 1 s, < 150 MB" if n == biggest else "< 1 s", ""] for n in sizes],
                 ["recovery spread max/min (wall; CPU)", f"{spread:.2f}; {max(cpu_times) / min(cpu_times):.2f}",
                  "<= 2", targets["recovery_within_2x"]]]
        result.update({
            "recovery": {str(n): {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec[n].items()}
                         for n in sizes},
            "recovery_s": round(rec[biggest]["recovery_s"], 4),
            "recovery_cpu_s": round(rec[biggest]["recovery_cpu_s"], 4),
            "recovery_spread": round(spread, 2),
            "rss_mb": round(rec[biggest]["rss_mb"], 1),
            "queue_size": biggest,
        })

    if "micro" in only:
        say("\n[5] CPU cost per record without fsync: best of many short repeats")
        mic = bench_micro(30 if not quick else 15)
        rows += [["best-case CPU per envelope record, us: bare, engine",
                  f"{mic['bare_us_per_record']:.2f}, {mic['engine_us_per_record']:.2f}", "<= 5 (= 200k/s)", ""],
                 ["best runner pass returning due envelopes, records/s", fmt(mic["scan_rps_best"]), ">= 1,000,000",
                  ""]]
        result.update({k: round(v, 3) for k, v in mic.items()})

    say("\nSummary (medians)")
    say(common.table(["figure", "value", "target", "met"], rows))
    say(f"elapsed {time.perf_counter() - t_start:.0f}s, load average now {common.load_average()}")
    result["targets_met"] = targets
    common.emit_json(result)

if __name__ == "__main__":
    main()
