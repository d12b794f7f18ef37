"""A PySpark data source over segment files: ``spark.read.format("logspool")``.

Theory of operation. The driver plans the paths it is given (segment files,
``log/`` directories, spool directories, archive directories, globs of any of
these; a spool directory gives both its ``log/`` and its ``archive/``), local
or at a URL (``s3://``, ``hdfs://``, ``file://``: ``spool.export.remote``), into a
sorted list of segment files (``spool.export.rows.plan``), plus one task per segment
missing from a directory's sequence, and makes **one partition per file**, or
with the ``cores`` option one partition per run of consecutive files (see
``group_tasks``). The driver only lists: a worker opens its own files (objects
in a bucket too) and turns each into Arrow record batches with ``spool.export.rows``
(which reads through the spool's log reader, ``spool.read.reader``), one row per
record and one error row per anomaly, in file order; a file it cannot open is
an error row.

It lives with the report rather than in ``spool``, because it is the only
piece of the pipeline that imports pyspark: ``spool``, the pure-Python walk
(``spool.export.rows``) included, imports without it.

Options: ``path`` / ``paths`` (as ``load()`` passes them), ``relay``,
``batchRows`` (rows per Arrow batch, default 65536), ``cores`` (the job's
parallelism: files are packed into about ``TASKS_PER_CORE`` partitions a core).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from spool.export.rows import (
    DEFAULT_BATCH_ROWS,
    FORMAT_NAME,
    SCHEMA_DDL,
    SegmentTask,
    paths_from_options,
    plan,
    relay_name_for,
    segment_batches,
)

__all__ = ["LogspoolDataSource", "LogspoolReader", "SegmentPartition", "freeze_worker_heap", "group_tasks"]

TASKS_PER_CORE: Final = 4
MAX_FILES_PER_PARTITION: Final = 8  # 128 MiB of 16 MiB segments: Spark's own spark.sql.files.maxPartitionBytes


def group_tasks(tasks: Sequence[SegmentTask], cores: int | None) -> list[list[SegmentTask]]:
    """The tasks as runs of consecutive ones, one run per Spark partition.

    Why: Spark pays about 10 ms of CPU per task of this data source (9 in the
    JVM, 2 in the Python worker: measured with a source that reads nothing,
    docs/benchmarks.md "The report on a fleet"), 0.4 µs per record on 16 MiB
    segments, a tenth of what decoding them costs. With ``cores`` given, a
    partition takes ``len(tasks) // (cores * TASKS_PER_CORE)`` files, at least
    one and at most ``MAX_FILES_PER_PARTITION``: about four partitions a core,
    so the cores still finish together, and a failed task repeats at most
    128 MiB. Without it (``cores`` None): one partition per file. Runs are
    consecutive in the plan's order, so a partition's rows are still in file
    order, file after file of one log.
    """
    per = 1 if not cores else max(1, min(MAX_FILES_PER_PARTITION, len(tasks) // (cores * TASKS_PER_CORE)))
    return [list(tasks[i:i + per]) for i in range(0, len(tasks), per)]


# -- the Spark data source ---------------------------------------------------


class SegmentPartition(InputPartition):
    """Segment files (each with where it stands in its log) and the relay each belongs to."""

    def __init__(self, tasks: Sequence[SegmentTask], relays: Sequence[str]) -> None:
        super().__init__(tasks[0].path)
        self.tasks = tuple(tasks)
        self.relays = tuple(relays)


class LogspoolDataSource(DataSource):
    """``spark.read.format("logspool").load(paths)``; register it first with
    ``spark.dataSource.register(LogspoolDataSource)``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: Any) -> LogspoolReader:
        return LogspoolReader(dict(self.options))


class LogspoolReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.paths = paths_from_options(options)
        self.relay = options.get("relay") or ""
        self.batch_rows = int(options.get("batchRows") or DEFAULT_BATCH_ROWS)
        self.cores = int(options.get("cores") or 0) or None

    def partitions(self) -> Sequence[SegmentPartition]:
        """The plan, listed here rather than in ``__init__``: pyspark pickles this reader into every task's
        command before it asks for the partitions, and a plan kept on it would go to every task, all of it."""
        return [SegmentPartition(run, [self.relay or relay_name_for(t.path) for t in run])
                for run in group_tasks(plan(self.paths), self.cores)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, SegmentPartition)
        freeze_worker_heap()
        for task, relay in zip(partition.tasks, partition.relays, strict=True):
            yield from segment_batches(task, relay, self.batch_rows)


_frozen = False


def freeze_worker_heap() -> None:
    """Once per Python worker: import what the walk needs and move every object then alive (modules,
    classes, pyspark's and pyarrow's tables) out of the cyclic collector's sight (``gc.freeze``).

    Why: pyspark's daemon runs a full ``gc.collect()`` after every task of a
    reused worker, and a full collection scans every tracked object of the
    process: some 80,000 after these imports, 13-17 ms each time on the
    project's machine, and about 35 ms of worker CPU between two tasks in a
    ``local[2]`` read (a quarter of a 16 MiB segment's own read, measured).
    Frozen objects are never scanned again; what becomes garbage later is
    collected as usual. The cost: a cycle among the objects alive at the
    first task is never freed, once, so the worker cannot grow by it.
    """
    global _frozen
    if _frozen:
        return
    import gc

    import pyarrow.compute  # the first batch would import it otherwise: after the freeze

    # The first ``pa.array`` of a process imports pandas when numpy is there (pyarrow asks pandas whether
    # its input is array-like): some 400 modules and 30,000 tracked objects, which after the freeze every
    # collection between tasks would scan again (3-5 ms each, docs/benchmarks.md "The report on a fleet").
    pyarrow.array((0,), pyarrow.int64())
    del pyarrow
    gc.collect()
    gc.freeze()
    _frozen = True
