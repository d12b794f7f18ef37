"""Rows of segment files for analytics: the columns, the walk and the Arrow batches, without Spark.

Theory of operation. The Spark data source (``mta.report.spark_source``, the
only module that imports pyspark) gives each task its segment files; this
module turns each into Arrow record batches, one row per record, in file order. The
frames are read through the log reader (``spool.read.reader``: there is no second
implementation of the format or of its damage rules here), and the columns
are built in bulk (see "decoding one segment" below), because making a record
object and a row tuple per record cost several times the CBOR decoding
(docs/bench_spark.md). pyarrow is imported where batches are built, so that
``spool`` imports without the analytics extra.

DATA records (message bodies) are checksummed like every frame but give no
row: analytics never needs the bytes.

Damage does not stop the job. Every anomaly the reader names becomes an
*error row* (``rtype`` 0, ``pos`` where the anomaly begins, ``error`` saying
what) and the walk carries on where the reader resumes: after a damaged
record at the next frame whose checksum passes, after a damaged segment
header at the first frame. The driver knows where each file stands in its
log (``plan``): the newest segment of a log may end in a torn tail, every
other one is checked against the size its successor recorded, and a gap in a
directory's sequence of segments gives an error row for each missing one.
The relay name is the ``relay`` option, or else taken from the directory:
``NAME/log/*.seg``, ``NAME/archive/*.seg`` and ``NAME/*.seg`` all give ``NAME``
(shard K's ``NAME-K``). Files may be local or at a URL (``spool.export.remote``):
the driver lists, and each task opens its own file where it runs.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
from collections.abc import Generator, Iterable, Iterator
from typing import Any, Final

import attrs
import cbor2

from spool.errors import CorruptRecord, SpoolError
from spool.export import remote
from spool.export.remote import PlaceError
from spool.fileio import read_exact
from spool.format.record import FIELD_READERS, RecordType, decode_fields, make_pos
from spool.format.segment import SEGMENT_HEADER_SIZE, SUFFIX, parse_segment_name, segment_header_fields
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import LogReader

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


def arrow_schema() -> Any:
    """The Arrow schema of :data:`SCHEMA_DDL`: the batches' and the Parquet files'."""
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
SHARDS_DIR: Final = "shards"  # a relay's shard K: spool ``DIR/shards/K``, archive ``ARCHIVE/shards/K`` (mta.shards)


def _is_shard(name: str) -> bool:
    return name.isdigit() and not name.startswith("0")


def _absolute(place: str) -> str:
    return place if remote.is_remote(place) else os.path.abspath(remote.local_path(place))


def _where(file: str) -> tuple[str, str]:
    """``(relay directory, shard)`` of a segment file: ``NAME/log/S``, ``NAME/archive/S`` and ``NAME/S`` are
    ``(NAME, "")``; shard K's ``NAME/shards/K/log/S`` and ``NAME/archive/shards/K/S`` (its archive inside the
    spool's, as ``mta.shards`` lays it out) and ``NAME/shards/K/S`` are ``(NAME, "K")``."""
    parent = remote.dirname(_absolute(file))
    if remote.basename(parent) in SPOOL_SUBDIRS:
        parent = remote.dirname(parent)
    shard = remote.basename(parent)
    if not (_is_shard(shard) and remote.basename(remote.dirname(parent)) == SHARDS_DIR):
        return parent, ""
    parent = remote.dirname(remote.dirname(parent))
    if remote.basename(parent) in SPOOL_SUBDIRS:
        parent = remote.dirname(parent)
    return parent, shard


def relay_name_for(file: str) -> str:
    """``NAME/log/0000….seg``, ``NAME/archive/0000….seg`` and ``NAME/0000….seg`` belong to relay ``NAME``,
    locally or at a URL (``s3://fleet/NAME/0000….seg``); shard K of relay ``NAME`` (``NAME/shards/K/…``) is
    ``NAME-K``, as its queue ids end in ``-K``."""
    parent, shard = _where(file)
    name = remote.basename(parent) or "-"
    return f"{name}-{shard}" if shard else name


def same_named_relays(files: Iterable[str]) -> dict[str, list[str]]:
    """Names that ``relay_name_for`` gives to more than one relay directory among ``files``, with those
    directories (sorted): two relays whose spools have the same directory name, whose queue ids the report
    would take for one relay's."""
    where: dict[str, set[str]] = {}
    for file in files:
        parent, _shard = _where(file)
        where.setdefault(relay_name_for(file), set()).add(parent)
    return {name: sorted(dirs) for name, dirs in sorted(where.items()) if len(dirs) > 1}


def _entries(directory: str, listing: remote.Listing) -> list[tuple[str, bool]]:
    """``(path, is a directory)`` in a local directory or at a URL."""
    if remote.is_remote(directory):
        return listing.entries(directory)
    return [(os.path.join(directory, n), os.path.isdir(os.path.join(directory, n))) for n in os.listdir(directory)]


def _segments_in(directory: str, listing: remote.Listing) -> list[str]:
    """A spool directory gives its ``log/`` and ``archive/``; any other directory, itself. Each gives its
    shards' too (``shards/K``, laid out the same way)."""
    entries = _entries(directory, listing)
    dirs = {remote.basename(p): p for p, is_dir in entries if is_dir}
    subdirs = [dirs[d] for d in SPOOL_SUBDIRS if d in dirs]
    out: list[str] = []
    for d in subdirs:
        out.extend(_segments_in(d, listing))
    if not subdirs:
        out.extend(p for p, is_dir in entries if not is_dir and parse_segment_name(remote.basename(p)) is not None)
    if SHARDS_DIR in dirs:
        for shard, is_dir in _entries(dirs[SHARDS_DIR], listing):
            if is_dir and _is_shard(remote.basename(shard)):
                out.extend(_segments_in(shard, listing))
    return out


def _matches(pattern: str, listing: remote.Listing) -> list[tuple[str, bool]]:
    """``(path, is a directory)`` for each match of a path, URL or glob of either."""
    if remote.is_remote(pattern):
        return listing.matches(pattern)
    found = sorted(glob.glob(os.path.expanduser(remote.local_path(pattern))))
    return [(m, os.path.isdir(m)) for m in found if os.path.isdir(m) or os.path.isfile(m)]


@attrs.frozen
class SegmentTask:
    """One segment file to read and where it stands in its log (picklable: a Spark partition carries it).

    ``last``: the newest segment of its log, whose tail may be torn.
    ``successor``: the next segment's file, whose header records this one's
    sealed size. ``missing``: the segment is not there at all (the reader's
    anomaly for it), and the task gives one error row.
    """

    path: str
    segment: int
    last: bool = True
    successor: str | None = None
    missing: Anomaly | None = None

    @classmethod
    def alone(cls, path: str) -> SegmentTask:
        """A file read on its own: the last of its log, with no successor to check it against."""
        return cls(path, _segment_id(path))


def _segment_id(path: str) -> int:
    """The id in the file's name, or (a file named otherwise) in its header, or 0."""
    seg = parse_segment_name(remote.basename(path))
    if seg is not None:
        return seg
    try:
        io = remote.file_io(path)
        fd = io.open_read(path)
        try:
            return segment_header_fields(read_exact(io, fd, SEGMENT_HEADER_SIZE, 0), path)[0]
        finally:
            io.close(fd)
    except (OSError, SpoolError):
        return 0


def _log_of(file: str) -> str:
    """What names a file's whole log: its spool (``log/`` and ``archive/`` together), or its shard's."""
    parent, shard = _where(file)
    return remote.join(parent, f"{SHARDS_DIR}/{shard}") if shard else parent


def plan(patterns: Iterable[str]) -> list[SegmentTask]:
    """Every segment file that ``patterns`` name, as tasks sorted by path, plus one task per segment
    missing from the sequence of a directory that was named whole.

    A pattern is a segment file, a directory of segments, a spool directory
    (with ``log/`` and ``archive/``), or a glob of any of these, local or at a
    URL (``s3://fleet/mx*``: ``spool.export.remote``). Files of one log are placed
    against each other (last, successor) whichever way they were named; gaps
    count only where a whole directory was named (a hand-picked set of files
    may leave out what it likes). Only the listing happens here: each file is
    opened where its task runs.

    Raises PlaceError for a URL no installed library reads, OSError when a store cannot be listed.
    """
    listing = remote.Listing()
    found: dict[str, bool] = {}  # file -> it came from a directory named whole
    for pattern in patterns:
        for m, is_dir in _matches(pattern, listing):
            if is_dir:
                found.update((_absolute(f), True) for f in _segments_in(m, listing))
            elif m.endswith(SUFFIX):
                found.setdefault(_absolute(m), False)
    logs: dict[str, dict[int, str]] = {}
    whole: set[str] = set()
    for file, from_dir in found.items():
        key = _log_of(file)
        logs.setdefault(key, {})[_segment_id(file)] = file
        if from_dir:
            whole.add(key)
    tasks: list[SegmentTask] = []
    for key, files in logs.items():
        ids = sorted(files)
        tasks.extend(SegmentTask(files[s], s, s == ids[-1], files.get(s + 1)) for s in ids)
        if key in whole:
            reader = LogReader(remote.file_io(key), remote.dirname(files[ids[0]]), segments=ids, paths=files)
            tasks.extend(SegmentTask(a.path, a.segment, False, None, a) for a in reader.missing())
    return sorted(tasks, key=lambda t: (t.path, t.segment))


def expand_paths(patterns: Iterable[str]) -> list[str]:
    """Every segment file that ``patterns`` name (see ``plan``), sorted, without repeats.

    A pattern that matches nothing contributes nothing; the caller decides
    whether an empty result is an error.
    """
    return [t.path for t in plan(patterns) if t.missing is None]


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
# its payload's field tuple (spool.format.record.decode_fields: the codec's own checks,
# no record objects) to lists per record type; a batch is then one Arrow array
# per column and type, the types' parts concatenated and put back in file order
# by Arrow (sort by pos). Per record, Python does only the frame check, the CBOR
# decode with its schema checks and two appends.

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


_Record = tuple[tuple[int, int, int, int], int, bytes]  # (pos, flags, class, time), type, payload


def _record(pos: int, rtype: int, flags: int, klass: int, time: int, payload: bytes) -> _Record:
    return (pos, flags, klass, time), rtype, payload


class _SegmentWalk:
    """Walks one segment file into chunks through the log reader; each anomaly becomes an error row
    and the walk goes on where the reader resumes. Never raises for the file: one that cannot be
    opened, or stops being readable part way (a store that fails, an object moved to cold storage),
    gives an error row that names it and where the walk stopped, never a silent gap.

    A class, not a generator: a suspended generator would keep the chunk it
    just yielded alive until resumed, and the collector, once re-enabled,
    would scan every tuple of it (see ``_collector_paused``).
    """

    def __init__(self, task: SegmentTask) -> None:
        self.task = task
        self.at = make_pos(task.segment, 0)  # the last position given a row: where a failure to read is named
        self.failed: str | None = None  # why the file could not be read at all: its one error row
        if task.missing is not None:
            self.items: Iterator[_Record | Anomaly] = iter([task.missing])
            return
        seg = task.segment
        io = remote.file_io(task.path)
        try:
            io.close(io.open_read(task.path))  # one that is not there is named here, not taken as reclaimed
        except (OSError, PlaceError) as exc:
            self.items = iter(())
            self.failed = _unreadable(task, exc)
            return
        paths = {seg: task.path, **({seg + 1: task.successor} if task.successor else {})}
        reader = LogReader(io, remote.dirname(task.path), segments=(seg,) if task.last else (seg, seg + 1),
                           paths=paths)
        self.items = iter(reader.segment_as(seg, _record, types=_RECORD_TYPES))

    def take(self, batch_rows: int) -> _Chunk | None:
        """The next chunk of up to ``batch_rows`` rows; None at the end of the file."""
        chunk = _Chunk()
        heads, fields = chunk.heads, chunk.fields
        rows = 0
        if self.failed is not None:
            chunk.errors.append((self.at, self.failed))
            self.failed = None
            rows += 1
        # The good path calls cbor2 and the type's field checks itself (decode_fields' own steps, less two
        # calls a record); any failure is decoded again by decode_fields, which raises it as the reader names it.
        loads = cbor2.loads
        readers: list[Any] = [FIELD_READERS.get(t) for t in range(max(_RECORD_TYPES) + 1)]  # lists: indexed, not hashed
        add_fields: list[Any] = [fields[t].append if t in fields else None for t in range(len(readers))]
        add_head: list[Any] = [heads[t].append if t in heads else None for t in range(len(readers))]
        at = self.at
        try:
            for item in self.items:
                if type(item) is tuple:
                    head, rtype, payload = item
                    at = head[0]
                    try:
                        d = loads(payload)
                        if type(d) is not dict:
                            raise TypeError
                        values = readers[rtype](d)
                    except Exception:
                        try:
                            values = decode_fields(rtype, payload)
                        except CorruptRecord as exc:  # the checksum passed, the payload does not decode
                            chunk.errors.append((at, f"undecodable payload ({exc.reason})"))
                            rows += 1
                            if rows >= batch_rows:
                                break
                            continue
                    add_fields[rtype](values)
                    add_head[rtype](head)
                else:
                    assert isinstance(item, Anomaly)
                    chunk.errors.append((item.pos, error_text(item)))
                    at = item.pos
                rows += 1
                if rows >= batch_rows:
                    break
        except (OSError, PlaceError) as exc:
            self.at = at
            self.items = iter(())
            if self.at == make_pos(self.task.segment, 0):  # nothing read: the file as a whole cannot be
                chunk.errors.append((self.at, _unreadable(self.task, exc)))
            else:
                chunk.errors.append((self.at, f"unreadable: the file could not be read on from here ({_why(exc)})"))
            rows += 1
        self.at = at
        if not rows:
            return None
        chunk.rows = rows
        return chunk


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _unreadable(task: SegmentTask, exc: BaseException) -> str:
    """The ``error`` of a segment that was listed but cannot be read where its task runs."""
    if isinstance(exc, FileNotFoundError):
        return f"missing segment: segment {task.segment} was listed but is not there to read"
    return f"unreadable: segment {task.segment} cannot be read: {_why(exc)} ({type(exc).__name__})"


def error_text(a: Anomaly) -> str:
    """The ``error`` column for an anomaly the reader met (``spool.read.anomaly.Kind``)."""
    if a.kind is Kind.DAMAGED_RECORD:
        if a.resume is not None:
            return f"corrupt record ({a.reason}); skipped {a.length} bytes to the next valid record"
        return f"corrupt record ({a.reason}); {a.length} bytes to the end of the file unread"
    if a.torn:
        return f"torn tail: {a.length} bytes of an interrupted write at the end of the file"
    return f"{a.kind.value}: {a.reason}"


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


def _to_parts(pa: Any, schema: Any, chunk: _Chunk, relay: str, path: str) -> list[Any]:
    """The chunk's rows as batches of one record type each (the error rows last), each in file order."""
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
    relay_value, path_value = pa.scalar(relay, pa.string()), pa.scalar(path, pa.string())
    return [b.set_column(0, "relay", pa.repeat(relay_value, b.num_rows))
            .set_column(1, "file", pa.repeat(path_value, b.num_rows)) for b in parts]


def _to_batch(pa: Any, schema: Any, chunk: _Chunk, relay: str, path: str) -> Any:
    import pyarrow.compute as pc

    parts = _to_parts(pa, schema, chunk, relay, path)
    batch = parts[0] if len(parts) == 1 else pa.concat_batches(parts)
    return batch.take(pc.sort_indices(batch.column("pos")))


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


def segment_batches(path: str | SegmentTask, relay: str, batch_rows: int = DEFAULT_BATCH_ROWS
                    ) -> Generator[Any, None, None]:
    """Arrow record batches for one segment file (see :data:`SCHEMA_DDL`), rows in file order.

    ``path`` alone reads the file as the last of its log (a torn tail is
    possible, there is no successor to check its size against); a
    ``SegmentTask`` says where the file stands in its log.
    """
    import pyarrow as pa

    schema = arrow_schema()
    task = path if isinstance(path, SegmentTask) else SegmentTask.alone(path)
    walk = _SegmentWalk(task)
    while True:
        with _collector_paused():
            chunk = walk.take(batch_rows)
            if chunk is None:
                return
            batch = _to_batch(pa, schema, chunk, relay, task.path)
            del chunk  # its tuples go now, by reference counting, while the collector is still paused
        yield batch


def segment_parts(task: SegmentTask, relay: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> Generator[Any, None, None]:
    """The rows of ``segment_batches``, each batch of one record type (or of error rows), not in file order.

    Why: a writer of a table needs no file order, and putting the types' parts
    back in it costs a concatenation, a sort and a copy of every column (some
    0.2-0.3 µs of the 1.3-1.5 a row takes to build, timed in process on a loaded
    machine). A batch of one type is also what a Parquet row
    group of one type is made of, so a reader that filters on ``rtype`` skips
    the other types' row groups by their statistics.
    """
    import pyarrow as pa

    schema = arrow_schema()
    walk = _SegmentWalk(task)
    while True:
        with _collector_paused():
            chunk = walk.take(batch_rows)
            if chunk is None:
                return
            parts = _to_parts(pa, schema, chunk, relay, task.path)
            del chunk
        yield from parts
        del parts


def segment_rows(path: str | SegmentTask, relay: str = "") -> Iterator[dict[str, Any]]:
    """The rows of one segment file as dicts, in file order (for tests and debugging)."""
    for batch in segment_batches(path, relay):
        yield from batch.to_pylist()


