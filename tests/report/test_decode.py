"""The job's decode stage (``mta.report.decode``): Spark tasks write ``records/`` themselves.

Every row must be the data source's, once: across the runs of segments the
tasks share, when a task's Python worker dies while it writes (Spark runs the
task again, and the dead attempt's file must not reach the table), and when
the output is a bucket reached through the same file-system layer as the inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import fsspec
import pyarrow.parquet as pq
import pytest
import s3_server

from mta.report.decode import MAX_RUN_BYTES, MIN_RUN_BYTES, balanced_runs, decode_records
from mta.report.job import read_records
from mta.report.spark_source import MAX_FILES_PER_PARTITION
from spool.export.rows import SegmentTask, arrow_schema, plan

pytestmark = pytest.mark.timeout(1800)


def keyed(rows: list[dict[str, Any]]) -> list[str]:
    """Rows as sorted, comparable strings (every column)."""
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def source_rows(spark: Any, inputs: list[str]) -> list[str]:
    return keyed([r.asDict(recursive=True) for r in read_records(spark, inputs).collect()])


def test_records_are_the_data_sources_rows_once_in_one_file_per_run(spark: Any, fleet: dict[str, str],
                                                                    tmp_path: Any) -> None:
    inputs = list(fleet.values())
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "records"))
    with open(os.path.join(out, "records", "part-stale.parquet"), "wb") as f:  # a previous run's: replaced
        f.write(b"old")
    path = decode_records(spark, inputs, out)
    assert path == os.path.join(out, "records")
    runs = balanced_runs(plan(inputs), spark.sparkContext.defaultParallelism)
    assert len(runs) > 1
    names = sorted(os.listdir(path))
    assert names[0] == "_SUCCESS" and len(names) == 1 + len(runs)
    assert all(n.startswith(f"part-{i:05d}-") and n.endswith(".parquet") for i, n in enumerate(names[1:]))
    table = pq.read_table(path)
    assert table.schema == arrow_schema()
    got = [r.asDict(recursive=True) for r in spark.read.parquet(path).collect()]
    assert keyed(got) == source_rows(spark, inputs)
    # Each file holds its run's segments, each row group rows of one record type (so a reader's filter on
    # rtype skips the others by their statistics), each type's rows in file order.
    for name, run in zip(names[1:], runs, strict=True):
        meta = pq.ParquetFile(os.path.join(path, name)).metadata
        rtype = meta.schema.names.index("rtype")
        stats = [meta.row_group(g).column(rtype).statistics for g in range(meta.num_row_groups)]
        assert all(s is not None and s.min == s.max for s in stats)
        part = pq.read_table(os.path.join(path, name), columns=["file", "pos", "rtype"]).to_pylist()
        assert {r["file"] for r in part} <= {t.path for t in run}
        for t in {r["rtype"] for r in part}:
            keys = [(r["file"], r["pos"]) for r in part if r["rtype"] == t]
            assert keys == sorted(keys)


def test_records_in_a_bucket_go_through_the_inputs_file_system_layer(spark: Any, fleet: dict[str, str]) -> None:
    """``out`` at an S3 URL: the tasks write through fsspec, the driver renames there and removes the
    attempts' staging; the table read back from the bucket holds every row once."""
    bucket = f"out-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    inputs = [fleet["mx1"]]
    path = decode_records(spark, inputs, f"s3://{bucket}/report")
    assert path == f"s3://{bucket}/report/records"
    keys = sorted(o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"])
    assert keys[0] == "report/records/_SUCCESS" and all(k.endswith(".parquet") for k in keys[1:])
    assert not [k for k in keys if "_temporary" in k]
    fs = fsspec.filesystem("s3")
    got = pq.read_table(path.removeprefix("s3://"), filesystem=fs).to_pylist()
    assert keyed(got) == source_rows(spark, inputs)


WRITER = """
import json, sys
from mta.report.decode import MAX_RUN_BYTES, MIN_RUN_BYTES, balanced_runs, decode_records
from mta.report.session import make_session
spark = make_session(sys.argv[1], app="decode-retry")
decode_records(spark, json.loads(sys.argv[2]), sys.argv[3], batch_rows=1)
print("done")
"""


def _writers_of(staging_root: str) -> list[tuple[int, str]]:
    """``(pid, file)`` of every process that has a file under ``staging_root`` open."""
    staging_root = os.path.realpath(staging_root)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(staging_root + "/"):
                    found.append((int(pid), target))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_a_task_whose_worker_dies_while_writing_runs_again_and_its_file_stays_out(
        fleet: dict[str, str], tmp_path: Any) -> None:
    """A job of its own (local mode, 4 attempts a task); one Python worker is killed (SIGKILL) while it
    has its attempt's file open. The job still succeeds, and the table is every row once: the dead
    attempt's partial file is not in it."""
    out = str(tmp_path / "out")
    inputs = list(fleet.values())
    staging = os.path.join(out, "records", "_temporary")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, "local[1,4]", json.dumps(inputs), out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: tuple[int, str] | None = None
    try:
        deadline = time.monotonic() + 300
        for _ in range(30_000):  # bounded: the job's end, a writer seen, or the deadline, whichever comes first
            writers = _writers_of(staging) if os.path.isdir(staging) else []
            if writers:
                killed = writers[0]
                os.kill(killed[0], signal.SIGKILL)
                break
            if time.monotonic() > deadline:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.01)  # returns at once if the job ends: then there is no writer to catch
                break
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed is not None, "the job ended before a writer was seen"
    assert proc.returncode == 0, stderr[-4000:]
    assert stdout.strip().endswith("done")
    assert not os.path.exists(staging)
    path = os.path.join(out, "records")
    assert len([n for n in os.listdir(path) if n.endswith(".parquet")]) == len(balanced_runs(plan(inputs), 1))
    got = keyed(pq.read_table(path).to_pylist())
    want = keyed([r for p in plan(inputs) for r in _rows(p)])
    assert got == want


def _rows(task: Any) -> list[dict[str, Any]]:
    from spool.export.rows import relay_name_for, segment_batches

    return [r for b in segment_batches(task, relay_name_for(task.path)) for r in b.to_pylist()]


def _tasks(n: int) -> list[SegmentTask]:
    return [SegmentTask(f"/fleet/mx{i // 3:02d}/log/{i % 3 + 1:016x}.seg", i % 3 + 1) for i in range(n)]


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_runs_are_packed_by_size_largest_first_and_the_cores_finish_together(cores: int) -> None:
    """24 files of a fleet (full segments and small tails, as fleet_sim makes them): every file in one
    run, the runs' sizes never growing, and with the runs handed out in order to the first free core
    the cores end within the last run's size of each other."""
    tasks = _tasks(24)
    sizes = [16 << 20 if i % 3 < 2 else (i * 37_000) % (3 << 20) for i in range(24)]
    weight = dict(zip((t.path for t in tasks), sizes, strict=True))
    runs = balanced_runs(tasks, cores, sizes)
    assert sorted(t.path for r in runs for t in r) == sorted(t.path for t in tasks)
    held = [sum(weight[t.path] for t in r) for r in runs]
    assert all(a >= b for a, b in itertools.pairwise(held)) and max(held) <= MAX_RUN_BYTES
    assert all(len(r) <= MAX_FILES_PER_PARTITION for r in runs)
    assert all([t.path for t in r] == sorted(t.path for t in r) for r in runs)  # the plan's order within
    assert len(runs) >= cores
    busy = [0] * cores
    for h in held:
        busy[busy.index(min(busy))] += h
    assert max(busy) - min(busy) <= max(held[-1], MIN_RUN_BYTES)


def test_runs_of_a_few_small_files_or_none() -> None:
    """Small files share a run up to MIN_RUN_BYTES; no task, no run."""
    tasks = _tasks(6)
    runs = balanced_runs(tasks, 2, [1 << 20] * 6)
    assert [len(r) for r in runs] == [4, 2]
    assert balanced_runs([], 2, []) == []


def test_runs_weigh_each_file_by_its_size_on_disk(tmp_path: Any) -> None:
    big, small = tmp_path / "0000000000000001.seg", tmp_path / "0000000000000002.seg"
    big.write_bytes(b"x" * (MAX_RUN_BYTES // 2 + 1))
    small.write_bytes(b"x")
    tasks = [SegmentTask(str(big), 1, False, str(small)), SegmentTask(str(small), 2)]
    assert balanced_runs(tasks, 1) == [[tasks[0]], [tasks[1]]]  # the big one is past a quarter of the bytes
    gone = SegmentTask(str(tmp_path / "0000000000000009.seg"), 9)
    assert balanced_runs([gone, *tasks], 4)[0][0] == tasks[0]  # the largest first; one not there weighs 0
