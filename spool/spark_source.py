"""A PySpark data source over segment files: ``spark.read.format("logspool")``.

Theory of operation. The driver expands the paths it is given (segment files,
``log/`` directories, spool directories, archive directories, globs of any of
these; a spool directory gives both its ``log/`` and its ``archive/``) into a
sorted list of segment files and makes **one partition per
file**. A worker reads its file whole, walks the frames with the spool's own
codec (:func:`spool.record.check_frame`, :func:`spool.record.decode_fields`;
there is no second implementation of the format here) and yields Arrow record
batches, one row per record, in file order. Arrow batches were measured the
fastest way into Spark; the columns are built in bulk (see "decoding one
segment" below), because making a record object and a row tuple per record
cost several times the CBOR decoding (docs/bench_spark.md).

DATA records (message bodies) are checksummed like every frame but give no
row: analytics never needs the bytes.

Damage does not stop the job. When a frame fails, the worker emits an *error
row* (``rtype`` 0, ``pos`` at the bad frame, ``error`` saying what and whether
it is a torn tail) and carries on at the next frame whose checksum passes, if
any. A segment whose header is unreadable gives one error row. The relay name
is the ``relay`` option, or else taken from the directory: ``NAME/log/*.seg``,
``NAME/archive/*.seg`` and ``NAME/*.seg`` all give ``NAME``.

Options: ``path`` / ``paths`` (as ``load()`` passes them), ``relay``,
``batchRows`` (rows per Arrow batch, default 65536).
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from spool.errors import CorruptRecord, SpoolError
from spool.record import HEADER_SIZE, RecordType, check_frame, decode_fields, make_pos
from spool.segment import (
    SEGMENT_HEADER_SIZE,
    SUFFIX,
    decode_segment_header,
    find_end,
    parse_segment_name,
    valid_frame_after,
)

FORMAT_NAME: Final = "logspool"
ERROR_TYPE: Final = 0  # rtype of an error row; real record types start at 1
DEFAULT_BATCH_ROWS: Final = 65536

SCHEMA_DDL: Final = (
    "relay STRING, file STRING, pos BIGINT, rtype INT, garbage BOOLEAN, klass INT, time BIGINT, "
    "message_id BIGINT, sender STRING, recipients ARRAY<STRING>, body_size BIGINT, arrival_ms BIGINT, "
    "attempts INT, replaces BIGINT, held BOOLEAN, "
    "ref BIGINT, time_ms BIGINT, kind INT, replacement BIGINT, duration_ms BIGINT, "
    "outcomes ARRAY<STRUCT<recipient: STRING, status: INT, code: INT, enhanced: STRING, reply: STRING, "
    "next_hop: STRING>>, "
    "error STRING"
)
"""One row per record. Envelope columns are null on other types and so on:
``ref`` is what the record names (START: its envelope; DELIVERY and FINISH:
their start). ``time`` is the frame header's append time in seconds."""


def _arrow_schema() -> Any:
    import pyarrow as pa

    outcome = pa.struct(
        [
            ("recipient", pa.string()),
            ("status", pa.int32()),
            ("code", pa.int32()),
            ("enhanced", pa.string()),
            ("reply", pa.string()),
            ("next_hop", pa.string()),
        ]
    )
    return pa.schema(
        [
            ("relay", pa.string()),
            ("file", pa.string()),
            ("pos", pa.int64()),
            ("rtype", pa.int32()),
            ("garbage", pa.bool_()),
            ("klass", pa.int32()),
            ("time", pa.int64()),
            ("message_id", pa.int64()),
            ("sender", pa.string()),
            ("recipients", pa.list_(pa.string())),
            ("body_size", pa.int64()),
            ("arrival_ms", pa.int64()),
            ("attempts", pa.int32()),
            ("replaces", pa.int64()),
            ("held", pa.bool_()),
            ("ref", pa.int64()),
            ("time_ms", pa.int64()),
            ("kind", pa.int32()),
            ("replacement", pa.int64()),
            ("duration_ms", pa.int64()),
            ("outcomes", pa.list_(outcome)),
            ("error", pa.string()),
        ]
    )


# -- finding segment files ---------------------------------------------------


SPOOL_SUBDIRS: Final = ("log", "archive")


def relay_name_for(file: str) -> str:
    """``NAME/log/0000….seg``, ``NAME/archive/0000….seg`` and ``NAME/0000….seg``
    belong to relay ``NAME``."""
    parent = os.path.dirname(os.path.abspath(file))
    if os.path.basename(parent) in SPOOL_SUBDIRS:
        parent = os.path.dirname(parent)
    return os.path.basename(parent) or "-"


def _segments_in(directory: str) -> list[str]:
    """A spool directory gives its ``log/`` and ``archive/``; any other directory, itself."""
    subdirs = [os.path.join(directory, d) for d in SPOOL_SUBDIRS if os.path.isdir(os.path.join(directory, d))]
    out: list[str] = []
    for d in subdirs or [directory]:
        out.extend(os.path.join(d, n) for n in os.listdir(d) if parse_segment_name(n) is not None)
    return out


def expand_paths(patterns: Iterable[str]) -> list[str]:
    """Every segment file that ``patterns`` name, sorted, without repeats.

    A pattern is a segment file, a directory of segments, a spool directory
    (with ``log/``), or a glob of any of these. A pattern that matches nothing
    contributes nothing; the caller decides whether an empty result is an error.
    """
    found: set[str] = set()
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern))) or []
        for m in matches:
            if os.path.isdir(m):
                found.update(os.path.abspath(f) for f in _segments_in(m))
            elif m.endswith(SUFFIX) and os.path.isfile(m):
                found.add(os.path.abspath(m))
    return sorted(found)


def paths_from_options(options: dict[str, str]) -> list[str]:
    """``load(p)`` passes ``path``; ``load([p, q])`` passes ``paths`` as a JSON list."""
    out: list[str] = []
    if options.get("paths"):
        value = json.loads(options["paths"])
        out.extend([value] if isinstance(value, str) else value)
    if options.get("path"):
        out.append(options["path"])
    return out


# -- decoding one segment ----------------------------------------------------
#
# Columns are built in bulk: the walk appends each record's header fields and
# its payload's field tuple (spool.record.decode_fields: the codec's own checks,
# no record objects) to lists per record type; a batch is then one Arrow array
# per column and type, the types' parts concatenated and put back in file order
# by Arrow (sort by pos). Per record, Python does only the frame check, the CBOR
# decode with its schema checks and two appends.

_DATA: Final = int(RecordType.DATA)
_RECORD_TYPES: Final = (int(RecordType.ENVELOPE), int(RecordType.START), int(RecordType.DELIVERY),
                        int(RecordType.FINISH))


class _Chunk:
    """Up to ``batch_rows`` rows of one segment, by record type, not yet Arrow."""

    __slots__ = ("errors", "fields", "heads", "rows")

    def __init__(self) -> None:
        self.heads: dict[int, list[tuple[int, int, int, int]]] = {t: [] for t in _RECORD_TYPES}
        self.fields: dict[int, list[tuple[Any, ...]]] = {t: [] for t in _RECORD_TYPES}
        self.errors: list[tuple[int, str]] = []
        self.rows = 0


class _SegmentWalk:
    """Walks one segment file into chunks; damage becomes an error row and the
    walk resumes at the next valid frame. Never raises for the contents of the
    file (an unreadable file still raises OSError).

    A class, not a generator: a suspended generator would keep the chunk it
    just yielded alive until resumed, and the collector, once re-enabled,
    would scan every tuple of it (see ``_collector_paused``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.data = f.read()
        name_id = parse_segment_name(os.path.basename(path))
        self.off = SEGMENT_HEADER_SIZE
        self.header_error: str | None = None
        try:
            self.seg_id, _created = decode_segment_header(self.data, path, name_id)
        except SpoolError as exc:
            self.seg_id = name_id or 0
            self.header_error = f"unreadable segment header: {exc}"

    def take(self, batch_rows: int) -> _Chunk | None:
        """The next chunk of up to ``batch_rows`` rows; None at the end of the file."""
        chunk = _Chunk()
        if self.header_error is not None:
            chunk.errors.append((make_pos(self.seg_id, 0), self.header_error))
            chunk.rows = 1
            self.header_error, self.off = None, len(self.data)
            return chunk
        data, path, seg_id = self.data, self.path, self.seg_id
        view = memoryview(data)
        base = make_pos(seg_id, 0)
        off, n = self.off, len(data)
        heads, fields = chunk.heads, chunk.fields
        rows = 0
        while off < n and rows < batch_rows:
            try:
                rtype, flags, klass, time, end = check_frame(seg_id, view, off)
                if rtype != _DATA:
                    fields[rtype].append(decode_fields(rtype, view[off + HEADER_SIZE : end], path=path, offset=off))
                    heads[rtype].append((base | off, flags, klass, time))
                    rows += 1
                off = end
            except CorruptRecord as exc:
                resume, message = _damage(seg_id, data, off, path, exc)
                chunk.errors.append((base | off, message))
                rows += 1
                off = n if resume is None else resume
        self.off = off
        if not rows:
            return None
        chunk.rows = rows
        return chunk


def _damage(seg_id: int, data: bytes, off: int, path: str, exc: CorruptRecord) -> tuple[int | None, str]:
    """Classify a bad frame at ``off``: (where to resume or None, message).

    The classification is the segment module's own (``find_end``): a torn tail
    is what a crash leaves at the end of the log; anything else is corruption.
    """
    later = valid_frame_after(seg_id, data, off)
    if later is not None:
        return later, f"corrupt record ({_reason(exc)}); skipped {later - off} bytes to the next valid record"
    try:
        find_end(seg_id, data, off, path, last=True)
    except CorruptRecord as exc2:
        return None, f"corrupt record ({_reason(exc2)}); {len(data) - off} bytes to the end of the file unread"
    return None, f"torn tail: {len(data) - off} bytes of an interrupted write at the end of the file"


def _reason(exc: CorruptRecord) -> str:
    return str(exc).rsplit(": ", 1)[-1]


# Which field of each type's decode_fields tuple fills which column.
_COLUMNS: Final[dict[int, tuple[tuple[str, int], ...]]] = {
    int(RecordType.ENVELOPE): (("message_id", 0), ("sender", 1), ("recipients", 2), ("body_size", 4),
                               ("arrival_ms", 5), ("attempts", 6), ("replaces", 7), ("held", 8)),
    int(RecordType.START): (("ref", 0), ("time_ms", 1), ("kind", 2)),
    int(RecordType.DELIVERY): (("ref", 0), ("time_ms", 1), ("outcomes", 2), ("duration_ms", 3)),
    int(RecordType.FINISH): (("ref", 0), ("time_ms", 1), ("replacement", 2)),
}


def _part(pa: Any, schema: Any, n: int, given: dict[str, Any]) -> Any:
    """A batch of ``n`` rows: the ``given`` columns (Python lists or arrays), nulls elsewhere."""
    arrays = []
    for field in schema:
        v = given.get(field.name)
        if v is None:
            arrays.append(pa.nulls(n, field.type))
        elif isinstance(v, list | tuple):
            arrays.append(pa.array(v, field.type))
        else:
            arrays.append(v)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _to_batch(pa: Any, schema: Any, chunk: _Chunk, relay: str, path: str) -> Any:
    import pyarrow.compute as pc

    parts = []
    for rtype in _RECORD_TYPES:
        heads = chunk.heads[rtype]
        if not heads:
            continue
        n = len(heads)
        pos, flags, klass, time = zip(*heads)
        flag_array = pa.array(flags, pa.int32())
        given: dict[str, Any] = {
            "pos": pos, "rtype": pa.repeat(pa.scalar(rtype, pa.int32()), n),
            "garbage": pc.not_equal(pc.bit_wise_and(flag_array, 1), 0), "klass": klass, "time": time,
        }
        columns = list(zip(*chunk.fields[rtype]))
        given.update((name, columns[i]) for name, i in _COLUMNS[rtype])
        parts.append(_part(pa, schema, n, given))
    if chunk.errors:
        pos, message = zip(*chunk.errors)
        parts.append(_part(pa, schema, len(pos), {"pos": pos, "rtype": [ERROR_TYPE] * len(pos), "error": message}))
    batch = parts[0] if len(parts) == 1 else pa.concat_batches(parts)
    batch = batch.take(pc.sort_indices(batch.column("pos")))
    n = batch.num_rows
    batch = batch.set_column(0, "relay", pa.repeat(pa.scalar(relay, pa.string()), n))
    return batch.set_column(1, "file", pa.repeat(pa.scalar(path, pa.string()), n))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a batch is built.

    Why: a chunk is hundreds of thousands of small tuples and strings that
    the collector scans again and again as they accumulate (measured 2 to 6 of
    about 15 us per row, docs/bench_spark.md) and never finds garbage in: they
    form no cycles and are freed by reference counting once the batch is built.
    The collector runs as usual whenever control is outside this block (Spark's
    serializer, other code in the worker).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def segment_batches(path: str, relay: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[Any]:
    """Arrow record batches for one segment file (see :data:`SCHEMA_DDL`), rows in file order."""
    import pyarrow as pa

    schema = _arrow_schema()
    walk = _SegmentWalk(path)
    while True:
        with _collector_paused():
            chunk = walk.take(batch_rows)
            if chunk is None:
                return
            batch = _to_batch(pa, schema, chunk, relay, path)
            del chunk  # its tuples go now, by reference counting, while the collector is still paused
        yield batch


def segment_rows(path: str, relay: str = "") -> Iterator[dict[str, Any]]:
    """The rows of one segment file as dicts, in file order (for tests and debugging)."""
    for batch in segment_batches(path, relay):
        yield from batch.to_pylist()


# -- the Spark data source ---------------------------------------------------


class SegmentPartition(InputPartition):  # type: ignore[misc]
    """One segment file and the relay it belongs to."""

    def __init__(self, file: str, relay: str) -> None:
        super().__init__(file)
        self.file = file
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
        self.files = expand_paths(paths_from_options(options))
        self.relay = options.get("relay") or ""
        self.batch_rows = int(options.get("batchRows") or DEFAULT_BATCH_ROWS)

    def partitions(self) -> Sequence[SegmentPartition]:
        return [SegmentPartition(f, self.relay or relay_name_for(f)) for f in self.files]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, SegmentPartition)
        yield from segment_batches(partition.file, partition.relay, self.batch_rows)
