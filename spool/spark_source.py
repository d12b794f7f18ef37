"""A PySpark data source over segment files: ``spark.read.format("logspool")``.

Theory of operation. The driver expands the paths it is given (segment files,
``log/`` directories, spool directories, archive directories, globs of any of
these; a spool directory gives both its ``log/`` and its ``archive/``) into a
sorted list of segment files and makes **one partition per
file**. A worker reads its file whole, walks the frames with the spool's own
codec (:func:`spool.record.decode_frame`, :func:`spool.record.decode_payload`;
there is no second implementation of the format here) and yields Arrow record
batches, one row per record. Arrow batches were measured the fastest way into
Spark (docs/benchmarks.md); building one tuple per record and transposing the
list with ``zip`` keeps the Python work per record small.

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

import glob
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from spool.errors import CorruptRecord, SpoolError
from spool.record import (
    Delivery,
    Envelope,
    Finish,
    RecordType,
    Start,
    decode_frame,
    decode_payload,
    make_pos,
)
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


_NO_ENVELOPE: Final = (None,) * 8
_NO_REF: Final = (None,) * 6


def _row(pos: int, rtype: int, flags: int, klass: int, time: int, p: Any) -> tuple[Any, ...]:
    head = (pos, rtype, bool(flags & 1), klass, time)
    if isinstance(p, Envelope):
        env = (p.message_id, p.sender, list(p.recipients), p.body_size, p.arrival_ms, p.attempts, p.replaces, p.held)
        return head + env + _NO_REF + (None,)
    if isinstance(p, Delivery):
        outs = [(o.recipient, int(o.status), o.code, o.enhanced, o.reply, o.next_hop) for o in p.outcomes]
        return head + _NO_ENVELOPE + (p.start, p.time_ms, None, None, p.duration_ms, outs, None)
    if isinstance(p, Start):
        return head + _NO_ENVELOPE + (p.envelope, p.time_ms, int(p.kind), None, None, None, None)
    if isinstance(p, Finish):
        return head + _NO_ENVELOPE + (p.start, p.time_ms, None, p.replacement, None, None, None)
    raise TypeError(f"unexpected payload {type(p).__name__}")


def _error_row(pos: int, message: str) -> tuple[Any, ...]:
    return (pos, ERROR_TYPE, None, None, None, *_NO_ENVELOPE, *_NO_REF, message)


def segment_rows(path: str) -> Iterator[tuple[Any, ...]]:
    """Rows (without relay and file) for every record of one segment file.

    Damage gives an error row and the walk resumes at the next valid frame;
    never raises for the contents of the file (an unreadable file still
    raises OSError).
    """
    with open(path, "rb") as f:
        data = f.read()
    name_id = parse_segment_name(os.path.basename(path))
    try:
        seg_id, _created = decode_segment_header(data, path, name_id)
    except SpoolError as exc:
        yield _error_row(make_pos(name_id or 0, 0), f"unreadable segment header: {exc}")
        return
    off = SEGMENT_HEADER_SIZE
    n = len(data)
    data_type = int(RecordType.DATA)
    while off < n:
        try:
            frame = decode_frame(seg_id, data, off)
            if frame.rtype != data_type:
                payload = decode_payload(frame.rtype, frame.payload, path=path, offset=off)
                yield _row(frame.pos, frame.rtype, frame.flags, frame.klass, frame.time, payload)
            off += frame.size
        except CorruptRecord as exc:
            resume = _damage(seg_id, data, off, path, exc)
            yield _error_row(make_pos(seg_id, off), resume[1])
            if resume[0] is None:
                return
            off = resume[0]


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


def segment_batches(path: str, relay: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[Any]:
    """Arrow record batches for one segment file (see :data:`SCHEMA_DDL`)."""
    import pyarrow as pa

    schema = _arrow_schema()
    rows: list[tuple[Any, ...]] = []
    for row in segment_rows(path):
        rows.append(row)
        if len(rows) >= batch_rows:
            yield _to_batch(pa, schema, rows, relay, path)
            rows = []
    if rows:
        yield _to_batch(pa, schema, rows, relay, path)


def _to_batch(pa: Any, schema: Any, rows: list[tuple[Any, ...]], relay: str, path: str) -> Any:
    columns = list(zip(*rows))
    n = len(rows)
    arrays = [pa.array([relay] * n, pa.string()), pa.array([path] * n, pa.string())]
    arrays.extend(pa.array(col, field.type) for col, field in zip(columns, list(schema)[2:]))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


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
