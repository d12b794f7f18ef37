"""The report on a fleet's archive: records/s of the read and wall time of the whole report,
for local[1], local[2] and a standalone cluster, beside the plain Python reader of the same data.

    .venv/bin/python tools/bench/fleet_sim.py /tmp/fleet --messages 200000      # once
    .venv/bin/python tools/bench/report_bench.py /tmp/fleet [--repeat 3] [--configs local[1],local[2],cluster]

For each configuration, a child process (JVM options are fixed per JVM)
starts its SparkSession (timed apart: ``session_start_s``), warms the Python
workers with a ``count()``, then ``--repeat`` times runs the plain reader
(one process: the log reader and ``decode_payload`` over every segment, as
``spark_bench.plain_reader``) and right after it the ``logspool`` data source
as the job reads it (``mta.report.job.read_records``) written to Spark's
``noop`` sink, so every ratio comes from a pair measured together (A B A B),
each with its CPU per record (``--stage decode``: the Spark side of a pair is
instead the job's first stage, ``mta.report.job.decode_records``, the
segments into ``records/`` as Parquet, its rows counted after the timing;
a first decode warms it); ``--java-options`` replaces local mode's JVM
options for A/B runs; then ``--reports`` times the whole report job
(``mta.report.job.run_report``: decode into Parquet, the three tables, the
figures, report.txt and report.html). ``cluster`` starts a standalone master
and one worker (2 cores) from the pyspark install on 127.0.0.1
(tests/support/spark_cluster.py) and runs the driver against it; its
executors get the project through the zip the job ships. ``python`` times the
tests' plain-Python computation of every figure (tests/support/report_reference.py)
on the same segments: the report without Spark.

Rates count the non-DATA records, which every reader decodes. With each
read, its CPU seconds: the plain reader's process, and for Spark every
process under the child (driver, JVM, Python workers, and on the cluster the
daemons and executors it started), which the load on a shared machine moves
far less than the wall clock. Medians of the
repeats; the ratio is the median of the per-pair ratios. The 1-minute load
average is recorded with each figure. The last line of output is JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "support"))

from spark_bench import plain_read, timed

from spool.export.rows import expand_paths


def fleet_inputs(directory: str) -> list[str]:
    """The relays' spool directories under ``directory`` (``mx01``, ...), as ``--input``s."""
    return sorted(d for d in glob.glob(os.path.join(directory, "*")) if os.path.isdir(d))


def tree_cpu_s() -> float:
    """CPU seconds of this process and every process below it (the JVM, the Python workers), the
    reaped ones included (their parents' cutime/cstime): what the work cost, whatever the load."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(name)] = int(fields[1])
        cpu[int(name)] = sum(int(x) for x in fields[11:15]) / ticks  # utime stime cutime cstime
    me = os.getpid()

    def below(pid: int) -> bool:
        for _ in range(64):
            if pid == me:
                return True
            if pid not in parents or pid <= 1:
                return False
            pid = parents[pid]
        return False

    return sum(t for pid, t in cpu.items() if below(pid))


def child(directory: str, config: str, expect: int, repeat: int, reports: int, java_options: str | None = None,
          stage: str = "read") -> dict[str, Any]:
    from mta.report import job
    from mta.report.job import run_report
    from mta.report.session import make_session

    inputs = fleet_inputs(directory)
    files = expand_paths(inputs)
    cluster = None
    workdir = tempfile.mkdtemp(prefix="report-bench-")
    if config == "cluster":
        from spark_cluster import start_cluster

        cluster = start_cluster(os.path.join(workdir, "cluster"), cores=2, memory="2g")
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        # The executors' Python: this one (it has the workers' libraries); the project still comes in the zip.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        master = cluster.master_url
    else:
        master = config
    try:
        t0 = time.perf_counter()
        conf = {} if java_options is None else {"spark.driver.extraJavaOptions": java_options}
        spark = make_session(master, app="logspool-report-bench", conf=conf)
        started = time.perf_counter() - t0
        # As the job reads them (a checkout before read_records: the data source's defaults, for A/B runs).
        read = getattr(job, "read_records", None)
        df = read(spark, inputs) if read is not None else spark.read.format("logspool").load(inputs)
        first, n = timed(df.count)
        if n != expect:
            raise SystemExit(f"{config}: {n} rows, expected {expect}")
        decoded = os.path.join(workdir, "decoded")

        def spark_side() -> int:
            if stage == "decode":  # the job's first stage: the segments into records/ (Parquet)
                job.decode_records(spark, inputs, decoded)
            else:
                df.write.format("noop").mode("overwrite").save()
            return 0

        if stage == "decode":
            spark_side()  # the first decode warms what it uses apart from the data source's read
        pairs = []
        for _ in range(repeat):
            c0 = time.process_time()
            tp, _n = timed(lambda: plain_read(files))
            plain_cpu = time.process_time() - c0
            c0 = tree_cpu_s()
            ts, _zero = timed(spark_side)
            spark_cpu = tree_cpu_s() - c0
            got = spark.read.parquet(os.path.join(decoded, "records")).where("rtype > 0").count() \
                if stage == "decode" else expect  # checked apart from the timing, as the count above
            if got != expect:
                raise SystemExit(f"{config}: {got} records decoded, expected {expect}")
            pairs.append({"plain_rps": expect / tp, "spark_rps": expect / ts, "load_avg_1m": os.getloadavg()[0],
                          "plain_cpu_s": plain_cpu, "spark_cpu_s": spark_cpu})
        walls = []
        for i in range(reports):
            out = os.path.join(workdir, f"out{i}")
            t = time.perf_counter()
            run_report(spark, inputs, out)
            walls.append({"report_s": time.perf_counter() - t, "load_avg_1m": os.getloadavg()[0]})
        spark.stop()
    finally:
        if cluster is not None:
            cluster.stop()
    return {"config": config, "stage": stage, "session_start_s": started, "first_count_s": first, "pairs": pairs,
            "reports": walls}


def python_report(directory: str) -> dict[str, Any]:
    """The tests' plain-Python computation of every figure over the same segments."""
    import report_reference as ref

    relays = {os.path.basename(d): d for d in fleet_inputs(directory)}
    t = time.perf_counter()
    ref.figures(ref.plain_records(relays))
    return {"config": "python", "report_s": time.perf_counter() - t, "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a fleet made by fleet_sim.py")
    ap.add_argument("--repeat", type=int, default=3, help="read pairs (plain, Spark) per configuration")
    ap.add_argument("--reports", type=int, default=1, help="whole report runs per configuration")
    ap.add_argument("--configs", default="local[1],local[2],cluster,python")
    ap.add_argument("--java-options", default=None,
                    help="the driver JVM's options instead of mta.report.session.LOCAL_JAVA_OPTIONS (A/B runs)")
    ap.add_argument("--stage", choices=("read", "decode"), default="read",
                    help="the Spark side of a pair: read = the data source into the noop sink; decode = the job's "
                         "decode_records, the segments into records/ (Parquet), then a count of its records")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    files = expand_paths(fleet_inputs(args.dir))
    if not files:
        raise SystemExit(f"report_bench: no segments under {args.dir} (make them with fleet_sim.py)")
    if args.child:
        config, expect = args.child.rsplit(":", 1)
        print(json.dumps(child(args.dir, config, int(expect), args.repeat, args.reports, args.java_options,
                               args.stage)))
        return
    tp, n = timed(lambda: plain_read(files))
    size = sum(os.path.getsize(f) for f in files)
    print(f"{len(files)} segments, {size / 1e6:.0f} MB, {n} records (non-DATA); plain reader {n / tp:,.0f} records/s "
          f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"records": n, "segments": len(files), "bytes": size, "cpus": os.cpu_count(),
                              "results": []}
    for config in args.configs.split(","):
        if config == "python":
            r = python_report(args.dir)
            print(f"python (no Spark): report {r['report_s']:.1f} s (load {r['load_avg_1m']:.1f})", file=sys.stderr)
            result["results"].append(r)
            continue
        extra = [] if args.java_options is None else [f"--java-options={args.java_options}"]
        proc = subprocess.run([sys.executable, __file__, args.dir, "--repeat", str(args.repeat), "--reports",
                               str(args.reports), *extra, "--stage", args.stage, "--child", f"{config}:{n}"],
                              stdout=subprocess.PIPE, text=True, check=True)
        c = json.loads(proc.stdout.strip().splitlines()[-1])
        pairs = c["pairs"]
        c["rps"] = statistics.median(p["spark_rps"] for p in pairs)
        c["ratio_vs_plain"] = statistics.median(p["spark_rps"] / p["plain_rps"] for p in pairs)
        c["plain_rps_same_run"] = statistics.median(p["plain_rps"] for p in pairs)
        c["report_s"] = statistics.median(w["report_s"] for w in c["reports"]) if c["reports"] else None
        ratios = ", ".join(f"{p['spark_rps'] / p['plain_rps']:.2f}" for p in pairs)
        cpus = ", ".join(f"{p['spark_cpu_s'] / n * 1e6:.2f} ({p['plain_cpu_s'] / n * 1e6:.2f})" for p in pairs)
        print(f"{config}: read {c['rps']:,.0f} records/s, {c['ratio_vs_plain']:.2f}x plain (pairs "
              f"{ratios}); CPU us/record {cpus}; session start "
              f"{c['session_start_s']:.1f} s; report {c['report_s'] or 0:.1f} s; load "
              f"{statistics.median(p['load_avg_1m'] for p in pairs):.1f}", file=sys.stderr, flush=True)
        result["results"].append(c)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
