"""logspool's storage engine: an append-only log of mail queue records.

No SMTP knowledge lives here. This module is the public face: what a user of
the engine (the relay in ``mta``, a script) imports, by name, from ``spool``;
the packages behind it are the machinery, in layers (``tools`` on top, then
``aio`` and ``export``, ``engine``, ``damage`` and ``write``, ``read``,
``config``, ``format``, and ``errors`` and ``fileio`` at the bottom).

The synchronous ``Spool`` (``spool.engine``: core, claims, admin changes,
reclaim, opened by recovery) serves the CLI, the Spark reader and property
tests; ``AsyncSpool`` (``spool.aio``) puts group commit, runners and
checkpoints on trio for the relay. The format is ``spool.format`` (records,
segments, checkpoints); the log is read through ``spool.read.reader``, its
anomalies classified by ``spool.read.anomaly``. The report reads segments
through ``spool.export``, the one other package that ``mta`` imports.

A delivery worker makes its point of no return durable in a marks file of its
own (``spool.format.marks``, written by ``spool.write.marks``); recovery reads
those files and the relay collects them (``spool.read.marks``), all through
the names here.

Two modules are on the face as namespaces, for their many small names:
``listing`` (the queue as listed, counted and shown, read side) and
``remote`` (paths that may be URLs of an object store).

The names are resolved when first used (PEP 562), so ``import spool`` (and
every ``import spool.format...`` below it, in spoolctl and in Spark's
workers) loads neither trio nor the engine until a name needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from spool.aio.async_spool import AsyncSpool, StoredBody
    from spool.aio.inline_commit import INLINE_SYNC_FAST
    from spool.config.engine import SpoolConfig
    from spool.config.settings import (
        Boolean,
        Derived,
        Duration,
        Integer,
        Kind,
        ListOf,
        OneOf,
        Optional,
        Path,
        Resolver,
        Setting,
        Size,
        Text,
        TomlValue,
        expect,
        resolve_path,
        setting,
        settings_of,
        type_name,
    )
    from spool.config.units import format_age, parse_duration, parse_size
    from spool.engine.core import DAMAGED_BODY, LOG_DIR
    from spool.engine.gauges import NEVER, QueueGauges, oldest_live
    from spool.engine.spool import Attempt, BodyWriter, Spool
    from spool.errors import (
        CheckpointFailed,
        ConfigError,
        CorruptRecord,
        CorruptSegment,
        DamagedBody,
        DiskFull,
        FormatVersionError,
        MessageBusy,
        MessageMoved,
        NotFound,
        SpoolError,
        SpoolLocked,
        SyncFailed,
    )
    from spool.export import remote
    from spool.export.events import Event, EventBatch, EventStream, NotARecord
    from spool.fileio import FileIO, OsFileIO, write_all
    from spool.format.cursor import CursorError, check_cursor_name, list_cursors, load_cursor, store_cursor
    from spool.format.marks import MARKS_DIR, Mark, MarksRead, marks_dir
    from spool.format.record import (
        HELD_CLASS,
        Delivery,
        Envelope,
        Finish,
        Outcome,
        RecordType,
        Start,
        StartKind,
        Status,
        format_id,
        format_pos,
        make_pos,
        parse_id,
        parse_pos,
        pos_offset,
        pos_segment,
    )
    from spool.format.segment import SEGMENT_HEADER_SIZE, parse_segment_name, read_frame_at, segment_path
    from spool.read import listing
    from spool.read.marks import MarksCollector, marks_of, read_marks_dir
    from spool.write.marks import MarksWriter

# Each name on the face and the module it lives in.
_HOMES: Final[dict[str, str]] = {
    # the engines, sync and on trio, and what their callers hand them or get back
    "Spool": "spool.engine.spool",
    "Attempt": "spool.engine.spool",
    "BodyWriter": "spool.engine.spool",
    "LOG_DIR": "spool.engine.core",
    "DAMAGED_BODY": "spool.engine.core",
    "QueueGauges": "spool.engine.gauges",
    "NEVER": "spool.engine.gauges",
    "oldest_live": "spool.engine.gauges",
    "AsyncSpool": "spool.aio.async_spool",
    "StoredBody": "spool.aio.async_spool",
    "INLINE_SYNC_FAST": "spool.aio.inline_commit",
    # configuration: the engine's settings, the toolkit that defines settings, units
    "SpoolConfig": "spool.config.engine",
    "Setting": "spool.config.settings",
    "setting": "spool.config.settings",
    "settings_of": "spool.config.settings",
    "Kind": "spool.config.settings",
    "Boolean": "spool.config.settings",
    "Derived": "spool.config.settings",
    "Duration": "spool.config.settings",
    "Integer": "spool.config.settings",
    "ListOf": "spool.config.settings",
    "OneOf": "spool.config.settings",
    "Optional": "spool.config.settings",
    "Path": "spool.config.settings",
    "Resolver": "spool.config.settings",
    "Size": "spool.config.settings",
    "Text": "spool.config.settings",
    "TomlValue": "spool.config.settings",
    "expect": "spool.config.settings",
    "resolve_path": "spool.config.settings",
    "type_name": "spool.config.settings",
    "format_age": "spool.config.units",
    "parse_duration": "spool.config.units",
    "parse_size": "spool.config.units",
    # errors
    "SpoolError": "spool.errors",
    "ConfigError": "spool.errors",
    "CorruptRecord": "spool.errors",
    "CorruptSegment": "spool.errors",
    "DamagedBody": "spool.errors",
    "FormatVersionError": "spool.errors",
    "SpoolLocked": "spool.errors",
    "NotFound": "spool.errors",
    "MessageBusy": "spool.errors",
    "MessageMoved": "spool.errors",
    "SyncFailed": "spool.errors",
    "DiskFull": "spool.errors",
    "CheckpointFailed": "spool.errors",
    # records, their payloads, ids and positions
    "RecordType": "spool.format.record",
    "Envelope": "spool.format.record",
    "Start": "spool.format.record",
    "StartKind": "spool.format.record",
    "Delivery": "spool.format.record",
    "Outcome": "spool.format.record",
    "Status": "spool.format.record",
    "Finish": "spool.format.record",
    "HELD_CLASS": "spool.format.record",
    "format_id": "spool.format.record",
    "parse_id": "spool.format.record",
    "make_pos": "spool.format.record",
    "pos_segment": "spool.format.record",
    "pos_offset": "spool.format.record",
    "format_pos": "spool.format.record",
    "parse_pos": "spool.format.record",
    # segments: their files and one frame read at a position
    "segment_path": "spool.format.segment",
    "SEGMENT_HEADER_SIZE": "spool.format.segment",
    "parse_segment_name": "spool.format.segment",
    "read_frame_at": "spool.format.segment",
    # file I/O, the one interface every write goes through
    "FileIO": "spool.fileio",
    "OsFileIO": "spool.fileio",
    "write_all": "spool.fileio",
    # the event stream: the log's durable records as delivery events
    "Event": "spool.export.events",
    "EventBatch": "spool.export.events",
    "EventStream": "spool.export.events",
    "NotARecord": "spool.export.events",
    "CursorError": "spool.format.cursor",
    "check_cursor_name": "spool.format.cursor",
    "list_cursors": "spool.format.cursor",
    "load_cursor": "spool.format.cursor",
    "store_cursor": "spool.format.cursor",
    # workers' marks: their files, written by a delivery worker, read by recovery, collected by the relay
    "MARKS_DIR": "spool.format.marks",
    "marks_dir": "spool.format.marks",
    "Mark": "spool.format.marks",
    "MarksRead": "spool.format.marks",
    "MarksWriter": "spool.write.marks",
    "MarksCollector": "spool.read.marks",
    "read_marks_dir": "spool.read.marks",
    "marks_of": "spool.read.marks",
    # namespaces
    "listing": "spool.read.listing",
    "remote": "spool.export.remote",
}

__all__ = [
    "DAMAGED_BODY",
    "HELD_CLASS",
    "INLINE_SYNC_FAST",
    "LOG_DIR",
    "MARKS_DIR",
    "NEVER",
    "SEGMENT_HEADER_SIZE",
    "AsyncSpool",
    "Attempt",
    "BodyWriter",
    "Boolean",
    "CheckpointFailed",
    "ConfigError",
    "CorruptRecord",
    "CorruptSegment",
    "CursorError",
    "DamagedBody",
    "Delivery",
    "Derived",
    "DiskFull",
    "Duration",
    "Envelope",
    "Event",
    "EventBatch",
    "EventStream",
    "FileIO",
    "Finish",
    "FormatVersionError",
    "Integer",
    "Kind",
    "ListOf",
    "Mark",
    "MarksCollector",
    "MarksRead",
    "MarksWriter",
    "MessageBusy",
    "MessageMoved",
    "NotARecord",
    "NotFound",
    "OneOf",
    "Optional",
    "OsFileIO",
    "Outcome",
    "Path",
    "QueueGauges",
    "RecordType",
    "Resolver",
    "Setting",
    "Size",
    "Spool",
    "SpoolConfig",
    "SpoolError",
    "SpoolLocked",
    "Start",
    "StartKind",
    "Status",
    "StoredBody",
    "SyncFailed",
    "Text",
    "TomlValue",
    "check_cursor_name",
    "expect",
    "format_age",
    "format_id",
    "format_pos",
    "list_cursors",
    "listing",
    "load_cursor",
    "make_pos",
    "marks_dir",
    "marks_of",
    "oldest_live",
    "parse_duration",
    "parse_id",
    "parse_pos",
    "parse_segment_name",
    "parse_size",
    "pos_offset",
    "pos_segment",
    "read_frame_at",
    "read_marks_dir",
    "remote",
    "resolve_path",
    "segment_path",
    "setting",
    "settings_of",
    "store_cursor",
    "type_name",
    "write_all",
]


def __getattr__(name: str) -> object:
    """A name of the face, imported from its home on first use and kept."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'spool' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home.rsplit(".", 1)[1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
