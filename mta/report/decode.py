"""The job's first stage: segments → ``records/`` (Parquet), written by the Python tasks themselves.

Theory of operation. The driver plans the inputs (``spool.export.rows.plan``: it
only lists), packs the segment files into runs by their sizes, the largest
runs first and ever smaller ones after (:func:`balanced_runs`), and makes one
Spark task per run, an RDD of ``(index, run, relays)`` with one element per
partition. Each task walks its segments into Arrow record batches of one
record type each (``spool.export.rows.segment_parts``: the data source's rows,
from its own code, not put back in file order) and writes them
with pyarrow's Parquet writer to a file of its own attempt under
``records/_temporary/JOB/``; what comes back to the driver is the file's
name, the run's index and the row count. The driver then **commits**: it
renames the file of each partition's attempt that Spark counted (the one
result per partition that ``collect`` returns) to ``part-INDEX-JOB.parquet``,
drops ``_temporary/`` with every other attempt's file in it, and writes
``_SUCCESS``. The tables are then read from ``records/`` by Spark's own
Parquet reader (vectorized, with column pruning and filter push-down).

Why not ``spark.read.format("logspool")…write.parquet()``, which the job did
before: that sends every batch over Arrow IPC into the JVM, which turns it
into rows (each of the 22 columns of each record read through Arrow's
vectors, then copied once more) and encodes the rows to Parquet again: about
1.5-2 µs of JVM CPU a record, more than a third of the whole read, for bytes
that pyarrow's C++ writer encodes straight from the batches the task already
holds in 0.3-0.5 µs (docs/benchmarks.md, "The report on a fleet"). The data
source stays for whoever wants a DataFrame of the segments.

Why the temporary names: Spark may run a task more than once (a retry after
a lost executor, a speculative copy of a slow one), and every attempt writes
a whole file. Only the attempt whose result Spark kept is renamed into the
table, by the driver, after the job; a file of another attempt, whole or
cut off, stays under ``_temporary/`` until the driver removes it, and
readers skip names that begin with ``_`` (Spark's and pyarrow's alike). So
no row is read twice and none is missing, as with Spark's own file committer.

Where it writes: ``out`` is a local path (on a cluster, one every host sees
at the same path, as for Spark's own tables) or a URL, through the same
file-system layer as the inputs (``spool.export.remote``: fsspec).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

from mta.report.errors import ReportError
from mta.report.spark_source import MAX_FILES_PER_PARTITION, freeze_worker_heap
from spool.export import remote
from spool.export.remote import PlaceError
from spool.export.rows import DEFAULT_BATCH_ROWS, SegmentTask, arrow_schema, plan, relay_name_for, segment_parts

__all__ = ["decode_records", "write_run"]

RECORDS: Final = "records"
STAGING: Final = "_temporary"

PARQUET_OPTIONS: Final[dict[str, Any]] = {
    "compression": "snappy",
    # Statistics only where the job filters (``rtype``, ``time``): Spark skips row groups by them; for the
    # other columns they cost writing time and are never read.
    "write_statistics": ["pos", "rtype", "time"],
    # Dictionaries only for the strings, which repeat (relay, file, domains, replies); numbers rarely do.
    "use_dictionary": ["relay", "file", "sender", "recipients.list.element", "outcomes.list.element.recipient",
                       "outcomes.list.element.enhanced", "outcomes.list.element.reply",
                       "outcomes.list.element.next_hop", "error"],
}
"""pyarrow's Parquet writer options for ``records/`` (snappy, as Spark's own default). Measured on 4
segments of the benchmark fleet, writing alone, medians of 7: pyarrow's defaults 0.53 µs a record, these
0.45; without compression 0.39, but files 2.8x as large (docs/benchmarks.md, "The report on a fleet")."""

GUIDED_SHARE: Final = 2
"""A run takes about 1/(GUIDED_SHARE × cores) of the bytes not yet packed (see :func:`balanced_runs`)."""
MIN_RUN_BYTES: Final = 4 << 20
"""No run is made smaller than this while files are left to add: Spark's cost of a task (about 10 ms of
CPU, ``mta.report.spark_source.group_tasks``) is what reading some 2 MiB of segments costs."""
MAX_RUN_BYTES: Final = 128 << 20
"""No run grows past this (Spark's own ``spark.sql.files.maxPartitionBytes``): a failed task repeats at
most this much."""

Item = tuple[int, Sequence[SegmentTask], Sequence[str]]  # (index of the run, its segment files, their relays)
Written = tuple[int, str, int]  # (index of the run, the file this attempt wrote, rows)


# -- files, local or at a URL ------------------------------------------------


def _makedirs(place: str) -> None:
    if remote.is_remote(place):
        remote.filesystem(place).makedirs(place, exist_ok=True)
    else:
        os.makedirs(remote.local_path(place), exist_ok=True)


def _remove_tree(place: str) -> None:
    if remote.is_remote(place):
        fs = remote.filesystem(place)
        if fs.exists(place):
            fs.rm(place, recursive=True)
    else:
        # Not ignore_errors: a previous run's files left in place would be read with this run's.
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(remote.local_path(place))


def _rename(src: str, dst: str) -> None:
    if remote.is_remote(src):
        remote.filesystem(src).mv(src, dst)
    else:
        os.replace(remote.local_path(src), remote.local_path(dst))


def _touch(place: str) -> None:
    if remote.is_remote(place):
        remote.filesystem(place).pipe(place, b"")
    else:
        with open(remote.local_path(place), "wb"):
            pass


# -- in the tasks ------------------------------------------------------------


def write_run(tasks: Iterable[SegmentTask], relays: Iterable[str], dest: str,
              batch_rows: int = DEFAULT_BATCH_ROWS) -> int:
    """Write the rows of ``tasks`` to the Parquet file ``dest`` (file after file, each file's by record
    type in row groups of one type each); returns how many. The file is written even with no row (the
    schema alone), so a table of an empty input still reads. Spark-free: it is what each task runs,
    and tests call it in process."""
    import pyarrow.parquet as pq

    _makedirs(remote.dirname(dest))
    rows = 0
    if remote.is_remote(dest):
        sink: Any = remote.filesystem(dest).open(dest, "wb")
    else:
        sink = remote.local_path(dest)
    try:
        with pq.ParquetWriter(sink, arrow_schema(), **PARQUET_OPTIONS) as writer:
            for task, relay in zip(tasks, relays, strict=True):
                for batch in segment_parts(task, relay, batch_rows):
                    writer.write_batch(batch)
                    rows += batch.num_rows
    finally:
        if not isinstance(sink, str):
            sink.close()
    return rows


def _write_partition(items: Iterator[Item], staging: str, batch_rows: int) -> Iterator[Written]:
    """One Spark task: its run of segments into a file named for this attempt."""
    import pyarrow.parquet  # noqa: F401  # imported before the heap is frozen, like the walk's modules
    from pyspark import TaskContext

    freeze_worker_heap()
    ctx = TaskContext.get()
    attempt = ctx.taskAttemptId() if ctx is not None else 0
    for index, tasks, relays in items:
        dest = remote.join(staging, f"part-{index:05d}-attempt-{attempt}.parquet")
        yield index, dest, write_run(tasks, relays, dest, batch_rows)


# -- on the driver -----------------------------------------------------------


def _task_bytes(task: SegmentTask) -> int:
    """The size of a task's file, as the packing weighs it: 0 for a segment missing from its log (one error
    row) or a file that cannot be asked its size here (its task names why, where it runs)."""
    if task.missing is not None:
        return 0
    try:
        if remote.is_remote(task.path):
            with remote.store_errors(task.path, OSError):
                return int(remote.filesystem(task.path).size(task.path))
        return os.path.getsize(remote.local_path(task.path))
    except (OSError, PlaceError):
        return 0


def balanced_runs(tasks: Sequence[SegmentTask], cores: int, sizes: Sequence[int] | None = None
                  ) -> list[list[SegmentTask]]:
    """The tasks packed into runs for ``cores`` cores, the largest runs first (guided self-scheduling).

    Why: the stage ends when its last task does, and Spark hands the tasks to
    the cores in the order of their partitions. Runs of consecutive files of
    equal count (the data source's packing, ``group_tasks``) leave one core
    idle while the other reads a whole run at the end, a run that may hold
    three full segments where another held one and two tails: on a fleet of
    10 relays and 2 cores, about a run's time in eight. Here files are taken
    largest first, and each run takes files until it holds about
    ``1/(GUIDED_SHARE × cores)`` of the bytes not yet packed (at least
    :data:`MIN_RUN_BYTES`, at most :data:`MAX_RUN_BYTES` and
    ``MAX_FILES_PER_PARTITION`` files): a few large tasks, then ever smaller
    ones, so the cores finish within a small file of each other, whatever
    the load that slows one of them meanwhile. Within a run the files keep
    the plan's order. ``sizes`` (bytes per task, by default each file's size)
    is for tests.
    """
    weights = list(sizes) if sizes is not None else [_task_bytes(t) for t in tasks]
    order = sorted(range(len(tasks)), key=lambda i: -weights[i])  # stable: the plan's order among equals
    left = sum(weights)
    runs: list[list[SegmentTask]] = []
    i = 0
    while i < len(order):
        target = min(MAX_RUN_BYTES, max(MIN_RUN_BYTES, left / (GUIDED_SHARE * max(1, cores))))
        run: list[int] = []
        held = 0
        while i < len(order) and len(run) < MAX_FILES_PER_PARTITION and (
                not run or (held < target and held + weights[order[i]] <= MAX_RUN_BYTES)):
            run.append(order[i])
            held += weights[order[i]]
            i += 1
        left -= held
        runs.append([tasks[j] for j in sorted(run)])
    return runs



def decode_records(spark: Any, inputs: Sequence[str], out: str, relay: str | None = None,
                   batch_rows: int = DEFAULT_BATCH_ROWS) -> str:
    """Decode the segments that ``inputs`` name into ``out/records`` (Parquet, the data source's schema:
    ``spool.export.rows.SCHEMA_DDL``), replacing what was there; returns its path.

    Raises ReportError if Spark returns other than one result per run (it never should).
    """
    sc = spark.sparkContext
    runs = balanced_runs(plan(inputs), sc.defaultParallelism)
    items: list[Item] = [(i, run, [relay or relay_name_for(t.path) for t in run]) for i, run in enumerate(runs)]
    if not items:
        items = [(0, [], [])]  # one empty file: the table still has its schema
    path = remote.join(out, RECORDS)
    job = uuid.uuid4().hex[:12]
    staging = remote.join(path, f"{STAGING}/{job}")
    _remove_tree(path)
    _makedirs(staging)
    write = functools.partial(_write_partition, staging=staging, batch_rows=batch_rows)
    written: list[Written] = sc.parallelize(items, len(items)).mapPartitions(write).collect()
    if sorted(index for index, _f, _n in written) != list(range(len(items))):
        raise ReportError(f"decoding into {path}: Spark returned {len(written)} results for {len(items)} tasks")
    for index, file, _rows in written:
        _rename(file, remote.join(path, f"part-{index:05d}-{job}.parquet"))
    _remove_tree(remote.join(path, STAGING))
    _touch(remote.join(path, "_SUCCESS"))
    return path
