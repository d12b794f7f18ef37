"""Records/s of the ``logspool`` Spark data source against a plain Python reader.

    .venv/bin/python tools/bench/spark_bench.py [--records 1000000] [--segments 20] [--repeat 3]

Builds a spool-shaped log (per message: DATA, ENVELOPE, START, DELIVERY,
FINISH, and a replacement ENVELOPE for one message in four) with the spool's
own encoder, then times:

- ``plain``: one process walking every segment with ``FrameReader`` and
  ``decode_payload`` (the spool's sequential reader), counting records;
- ``local[1]`` and ``local[2]``: ``spark.read.format("logspool")`` written to
  Spark's ``noop`` sink, so every row is produced and handed to the JVM.

Spark's session start (seconds, printed apart) is not in the rate. Every
figure is the median of ``--repeat`` runs (default 3); the Spark runs follow
one warm-up run that starts the Python workers. The machine's load average is
printed with each figure, since on a shared machine it moves the numbers more
than any change to the code. Records counted are the non-DATA records, which both readers
decode. The last line of output is JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import tempfile
import time

from spool.fileio import OsFileIO
from spool.record import (
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
from spool.segment import SEGMENT_HEADER_SIZE, FrameReader, encode_segment_header, parse_segment_name, segment_path

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
    io = OsFileIO()
    n = 0
    for path in sorted(glob.glob(os.path.join(directory, "log", "*.seg"))):
        seg_id = parse_segment_name(os.path.basename(path))
        assert seg_id is not None
        reader = FrameReader(io, path, seg_id, SEGMENT_HEADER_SIZE, os.path.getsize(path))
        try:
            for frame in reader.frames():
                if frame.rtype != RecordType.DATA:
                    decode_payload(frame.rtype, frame.payload)
                    n += 1
        finally:
            reader.close()
    return n


def spark_rate(directory: str, master: str, expect: int, repeat: int) -> tuple[float, float]:
    """(median records/s, session start seconds) for one master."""
    from mta.report import make_session

    t0 = time.perf_counter()
    spark = make_session(master, app="logspool-bench", conf={"spark.ui.showConsoleProgress": "false"})
    started = time.perf_counter() - t0
    try:
        df = spark.read.format("logspool").load(directory)
        assert df.count() == expect  # also the warm-up
        rates = []
        for _ in range(repeat):
            t = time.perf_counter()
            df.write.format("noop").mode("overwrite").save()
            rates.append(expect / (time.perf_counter() - t))
        return statistics.median(rates), started
    finally:
        spark.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--segments", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="reuse or keep the generated log here")
    args = ap.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="spark-bench-")
    if not glob.glob(os.path.join(directory, "log", "*.seg")):
        print(f"building {args.records} records in {args.segments} segments under {directory}", file=sys.stderr)
        build(directory, args.records, args.segments)
    plain_rates, n = [], 0
    for _ in range(args.repeat):
        t = time.perf_counter()
        n = plain_reader(directory)
        plain_rates.append(n / (time.perf_counter() - t))
    plain = statistics.median(plain_rates)
    load = os.getloadavg()[0]
    print(f"plain reader: {plain:,.0f} records/s ({n} records; load {load:.1f})", file=sys.stderr)
    result: dict[str, object] = {"records": n, "segments": args.segments, "cpus": os.cpu_count(),
                                 "plain_rps": round(plain), "plain_load_avg_1m": round(load, 2)}
    for master in ("local[1]", "local[2]"):
        rate, started = spark_rate(directory, master, n, args.repeat)
        key = master.replace("[", "").replace("]", "")
        load = os.getloadavg()[0]
        result[f"{key}_rps"] = round(rate)
        result[f"{key}_session_start_s"] = round(started, 1)
        result[f"{key}_load_avg_1m"] = round(load, 2)
        result[f"ratio_{key}_vs_plain"] = round(rate / plain, 2)
        print(f"{master}: {rate:,.0f} records/s, {rate / plain:.2f}x plain (session start {started:.1f} s; "
              f"load {load:.1f})", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
