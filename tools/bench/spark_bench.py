"""Records/s of the ``logspool`` Spark data source against a plain Python reader.

    .venv/bin/python tools/bench/spark_bench.py [--records 1000000] [--segments 20] [--repeat 3]

Builds a spool-shaped log (per message: DATA, ENVELOPE, START, DELIVERY,
FINISH, and a replacement ENVELOPE for one message in four) with the spool's
own encoder, then times:

- ``plain``: one process walking every segment with the log reader and
  ``decode_payload`` (the spool's sequential reader), counting records;
- ``inproc``: the data source's own read path (``segment_batches``) in this
  process, without Spark: what Spark adds is the difference;
- for each ``--configs`` entry (default local[1] and local[2] with
  mta.report.session's JVM options, then local[2] with the JVM's defaults), a child
  process with its own SparkSession (JVM options are fixed per JVM) times
  ``spark.read.format("logspool")`` written to Spark's ``noop`` sink (every row
  produced and handed to the JVM), each run right after a plain-reader run, so
  every ratio comes from a pair measured together (A B A B).

Spark's session start (seconds, printed apart) is not in the rate; a first
``count()`` warms the Python workers. Figures are medians of ``--repeat``
runs (default 3); ratios are medians of the per-pair ratios. The machine's load
average is printed with each figure: on a shared machine it moves the numbers
more than any change to the code. Records counted are the non-DATA records,
which every reader decodes. The last line of output is JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from spool.fileio import OsFileIO
from spool.format.record import (
    Delivery,
    Envelope,
    Finish,
    Outcome,
    RecordType,
    Start,
    Status,
    decode_payload,
    encode_frame,
    make_pos,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, encode_segment_header, parse_segment_name, segment_path
from spool.read.reader import LogReader

DOMAINS = ["ok.example", "grey.example", "bad.example", "far.example"]


def _add(buf: bytearray, seg: int, t: int, rtype: RecordType, payload: bytes, klass: int = 0) -> int:
    pos = make_pos(seg, len(buf))
    buf += encode_frame(seg, rtype, payload, klass=klass, time=t)
    return pos


def build(directory: str, records: int, segments: int) -> int:
    """Write about ``records`` non-DATA records in ``segments`` files; return the exact count."""
    log = os.path.join(directory, "log")
    os.makedirs(log, exist_ok=True)
    rng = random.Random(7)
    per_segment = records // segments
    count = 0
    t = 1_700_000_000
    for seg in range(1, segments + 1):
        buf = bytearray(encode_segment_header(seg, t))
        n = 0

        while n < per_segment:
            ms = t * 1000 + rng.randrange(1000)
            rcpts = tuple(f"user{rng.randrange(1000)}@{rng.choice(DOMAINS)}" for _ in range(rng.choice((1, 1, 2, 3))))
            data = _add(buf, seg, t, RecordType.DATA, b"x" * rng.randrange(300, 4000))
            env = Envelope(make_pos(seg, len(buf)), f"sender{rng.randrange(100)}@corp.example", rcpts, (data,),
                           2000, ms, extra={"client": "192.0.2.7", "helo": "client.example"})
            epos = _add(buf, seg, t, RecordType.ENVELOPE, env.to_payload())
            spos = _add(buf, seg, t, RecordType.START, Start(epos, ms + 5).to_payload())
            deferred = rng.random() < 0.25
            outs = tuple(Outcome(r, Status.DEFERRED if deferred else Status.DELIVERED, 451 if deferred else 250,
                                 "4.7.1" if deferred else "2.0.0", "try later" if deferred else "OK id=4F2A1",
                                 "mx." + r.split("@")[1]) for r in rcpts)
            _add(buf, seg, t, RecordType.DELIVERY, Delivery(spos, ms + 80, outs, 75).to_payload())
            repl = None
            n += 4
            if deferred:
                new = Envelope(env.message_id, env.sender, rcpts, (data,), 2000, ms, attempts=1, replaces=epos)
                repl = _add(buf, seg, t, RecordType.ENVELOPE, new.to_payload(), klass=1)
                n += 1
            _add(buf, seg, t, RecordType.FINISH, Finish(spos, ms + 81, repl).to_payload())
            t += 1
        with open(segment_path(log, seg), "wb") as f:
            f.write(buf)
        count += n
    return count


def plain_reader(directory: str) -> int:
    return plain_read(sorted(glob.glob(os.path.join(directory, "log", "*.seg"))))


def plain_read(paths: list[str]) -> int:
    """The non-DATA records of ``paths``, each decoded by the spool's sequential reader (report_bench too)."""
    io = OsFileIO()
    n = 0
    for path in paths:
        seg_id = parse_segment_name(os.path.basename(path))
        assert seg_id is not None
        reader = LogReader(io, os.path.dirname(path), segments=(seg_id,))
        for frame in reader.frames(make_pos(seg_id, SEGMENT_HEADER_SIZE)):
            if frame.rtype != RecordType.DATA:
                decode_payload(frame.rtype, frame.payload)
                n += 1
    return n


def inproc_reader(directory: str) -> int:
    """The data source's own read path (``segment_batches``) in this process, without Spark."""
    from spool.export.rows import segment_batches

    return sum(b.num_rows for path in sorted(glob.glob(os.path.join(directory, "log", "*.seg")))
               for b in segment_batches(path, "bench"))


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn()
    return time.perf_counter() - t, n


def spark_child(directory: str, master: str, jvm: str, expect: int, repeat: int) -> dict[str, Any]:
    """One SparkSession (in its own process: JVM options are fixed per JVM). Each
    repeat times the plain reader and then the data source, so every Spark figure
    has a plain figure measured next to it (A B A B)."""
    from mta.report.session import make_session

    conf = {"spark.ui.showConsoleProgress": "false"}
    if jvm == "default":
        conf["spark.driver.extraJavaOptions"] = ""
    t0 = time.perf_counter()
    spark = make_session(master, app="logspool-bench", conf=conf)
    started = time.perf_counter() - t0
    df = spark.read.format("logspool").load(directory)
    t, n = timed(df.count)  # also the warm-up: starts the Python workers
    if n != expect:
        raise SystemExit(f"{master}: {n} rows, expected {expect}")
    pairs = []
    for _ in range(repeat):
        tp, _n = timed(lambda: plain_reader(directory))
        ts, _n = timed(lambda: (df.write.format("noop").mode("overwrite").save(), expect)[1])
        pairs.append({"plain_rps": expect / tp, "spark_rps": expect / ts, "load_avg_1m": os.getloadavg()[0]})
    return {"master": master, "jvm": jvm, "session_start_s": started, "first_count_s": t, "pairs": pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--segments", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="reuse or keep the generated log here")
    ap.add_argument("--configs", default="local[1]:report,local[2]:report,local[2]:default",
                    help="MASTER:JVM,... in the order run; JVM is 'report' (mta.report.session.LOCAL_JAVA_OPTIONS) "
                         "or 'default' (the JVM's own)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="spark-bench-")
    if not glob.glob(os.path.join(directory, "log", "*.seg")):
        print(f"building {args.records} records in {args.segments} segments under {directory}", file=sys.stderr)
        build(directory, args.records, args.segments)
    if args.child:
        master, jvm, expect = args.child.split(":")
        print(json.dumps(spark_child(directory, master, jvm, int(expect), args.repeat)))
        return
    plain_rates, inproc_rates, n = [], [], 0
    for _ in range(args.repeat):  # interleaved: plain, in-process data source, plain, ...
        tp, n = timed(lambda: plain_reader(directory))
        ti, ni = timed(lambda: inproc_reader(directory))
        if ni != n:
            raise SystemExit(f"data source read {ni} rows, plain reader {n} records")
        plain_rates.append(n / tp)
        inproc_rates.append(n / ti)
    plain, inproc = statistics.median(plain_rates), statistics.median(inproc_rates)
    load = os.getloadavg()[0]
    print(f"plain reader: {plain:,.0f} records/s; data source read path in process, no Spark: {inproc:,.0f} "
          f"records/s ({n} records; load {load:.1f})", file=sys.stderr)
    result: dict[str, Any] = {"records": n, "segments": args.segments, "cpus": os.cpu_count(),
                              "plain_rps": round(plain), "inproc_rps": round(inproc),
                              "plain_load_avg_1m": round(load, 2), "spark": []}
    for config in args.configs.split(","):
        master, jvm = config.split(":")
        out = subprocess.run([sys.executable, __file__, "--dir", directory, "--repeat", str(args.repeat),
                              "--child", f"{master}:{jvm}:{n}"], stdout=subprocess.PIPE, text=True, check=True)
        child = json.loads(out.stdout.strip().splitlines()[-1])
        pairs = child["pairs"]
        rate = statistics.median(p["spark_rps"] for p in pairs)
        ratio = statistics.median(p["spark_rps"] / p["plain_rps"] for p in pairs)
        load = statistics.median(p["load_avg_1m"] for p in pairs)
        result["spark"].append({"master": master, "jvm": jvm, "rps": round(rate), "ratio_vs_plain": round(ratio, 2),
                                "plain_rps_same_run": round(statistics.median(p["plain_rps"] for p in pairs)),
                                "session_start_s": round(child["session_start_s"], 1),
                                "load_avg_1m": round(load, 2), "pairs": pairs})
        print(f"{master} (JVM {jvm}): {rate:,.0f} records/s, {ratio:.2f}x plain (median of per-pair ratios; "
              f"session start {child['session_start_s']:.1f} s; load {load:.1f})", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
