"""A PySpark data source over segment files: ``spark.read.format("logspool")``.

Theory of operation. The driver plans the paths it is given (segment files,
``log/`` directories, spool directories, archive directories, globs of any of
these; a spool directory gives both its ``log/`` and its ``archive/``), local
or at a URL (``s3://``, ``hdfs://``, ``file://``: ``spool.remote``), into a
sorted list of segment files (``spool.rows.plan``) and makes **one partition
per file**, plus one per segment missing from a directory's sequence. The
driver only lists: a worker opens its own file (an object in a bucket too)
and turns it into Arrow record batches with ``spool.rows`` (which reads
through the spool's log reader, ``spool.reader``), one row per record and one
error row per anomaly, in file order; a file it cannot open is an error row.

It lives with the report rather than in ``spool``, because it is the only
piece of the pipeline that imports pyspark: ``spool``, the pure-Python walk
(``spool.rows``) included, imports without it.

Options: ``path`` / ``paths`` (as ``load()`` passes them), ``relay``,
``batchRows`` (rows per Arrow batch, default 65536).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from spool.rows import (
    DEFAULT_BATCH_ROWS,
    FORMAT_NAME,
    SCHEMA_DDL,
    SegmentTask,
    paths_from_options,
    plan,
    relay_name_for,
    segment_batches,
)

__all__ = ["LogspoolDataSource", "LogspoolReader", "SegmentPartition"]


# -- the Spark data source ---------------------------------------------------


class SegmentPartition(InputPartition):  # type: ignore[misc]
    """One segment file (where it stands in its log) and the relay it belongs to."""

    def __init__(self, task: SegmentTask, relay: str) -> None:
        super().__init__(task.path)
        self.task = task
        self.file = task.path
        self.relay = relay


class LogspoolDataSource(DataSource):  # type: ignore[misc]
    """``spark.read.format("logspool").load(paths)``; register it first with
    ``spark.dataSource.register(LogspoolDataSource)``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: Any) -> LogspoolReader:
        return LogspoolReader(dict(self.options))


class LogspoolReader(DataSourceReader):  # type: ignore[misc]
    def __init__(self, options: dict[str, str]) -> None:
        self.tasks = plan(paths_from_options(options))
        self.relay = options.get("relay") or ""
        self.batch_rows = int(options.get("batchRows") or DEFAULT_BATCH_ROWS)

    def partitions(self) -> Sequence[SegmentPartition]:
        return [SegmentPartition(t, self.relay or relay_name_for(t.path)) for t in self.tasks]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, SegmentPartition)
        _freeze_worker_heap()
        yield from segment_batches(partition.task, partition.relay, self.batch_rows)


_frozen = False


def _freeze_worker_heap() -> None:
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

    del pyarrow
    gc.collect()
    gc.freeze()
    _frozen = True
