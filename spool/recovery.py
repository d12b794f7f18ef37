"""Recovery: every start of the spool is one. The whole algorithm is in this file.

1. Read the checkpoint (none: scan from the first segment). Finish deleting
   segments that lie wholly behind its garbage-prefix end.
2. Find the end of the log: validate the last segment from where the working
   suffix (or the segment) begins; cut a torn tail, stop on anything else. A
   failure before the checkpoint's head is never a torn tail.
3. Make the log durable up to its end before acting on it (``sync_tail``).
   After a kill -9 the page cache still holds writes that were never synced;
   making them durable first means nothing below acts on a record that a
   later power cut could take back. Only what lies past the checkpoint's head
   can be unsynced (a checkpoint is stored only once its head is durable), so
   a log that ends at the head, which is every start after a clean stop, needs
   no sync at all.
4. Scan the working suffix. Every START's envelope gets its garbage mark (marks
   are written without fsync and may have been lost); every replacement
   envelope's predecessor too. STARTs without a FINISH are the attempts that
   were in flight; DELIVERY records give each recipient's outcome.
5. For each unfinished attempt: if a replacement was written, only the FINISH
   was lost. Otherwise write a replacement envelope with the recipients that
   have no final outcome (body copied forward, class kept) and a FINISH. A
   recipient of a delivery attempt with no DELIVERY record at all is *in
   doubt*: the remote may have taken it before the crash. It is logged, kept in
   the replacement's ``in_doubt`` list, and delivered again.
6. Commit, and let the caller write a fresh checkpoint.

Recovery reads the working suffix plus one envelope (and its body) per
in-flight attempt: its cost depends on what was in flight, never on how much
deferred mail the queue holds. ``RecoveryStats`` counts what it read.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import attrs

from spool.checkpoint import Checkpoint
from spool.errors import CorruptRecord, CorruptSegment
from spool.fileio import FileIO, read_exact
from spool.record import (
    Delivery,
    Envelope,
    Finish,
    RecordType,
    Start,
    StartKind,
    decode_payload,
    format_pos,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.segment import (
    SEGMENT_HEADER_SIZE,
    FrameReader,
    check_sealed_size,
    find_end,
    read_segment_header,
    segment_path,
)

log = logging.getLogger("spool.recovery")


@attrs.define
class RecoveryStats:
    bytes_read: int = 0
    records_read: int = 0
    segments_scanned: int = 0
    tail_cut_bytes: int = 0
    in_flight: int = 0
    in_doubt: int = 0
    replacements: int = 0
    marks: int = 0
    syncs: int = 0  # fdatasyncs and directory fsyncs made to secure the log's tail before acting on it
    seconds: float = 0.0


@attrs.define
class OpenAttempt:
    start_pos: int
    start: Start
    outcomes: dict[str, int] = attrs.field(factory=dict)
    replacement: int | None = None


@attrs.define
class SuffixScan:
    """What the scan of the working suffix found."""

    unfinished: dict[int, OpenAttempt] = attrs.field(factory=dict)
    replaced: dict[int, int] = attrs.field(factory=dict)  # old envelope -> replacement
    to_mark: list[int] = attrs.field(factory=list)
    body_span: int = 0  # envelopes written since the checkpoint: how far back their bodies reach


def find_log_end(io: FileIO, log_dir: str, last_seg: int, start_off: int, checkpoint_head: int | None,
                 stats: RecoveryStats) -> int:
    """Validate the last segment from ``start_off``; cut a torn tail. Returns the end offset."""
    path = segment_path(log_dir, last_seg)
    if checkpoint_head is not None and pos_segment(checkpoint_head) > last_seg:
        raise CorruptSegment(f"the checkpoint's head lies in segment {pos_segment(checkpoint_head)}, which is "
                             "missing: durable records are gone", segment_path(log_dir, pos_segment(checkpoint_head)),
                             pos_offset(checkpoint_head))
    fd = io.open(path)
    try:
        size = io.size(fd)
        if size < start_off:
            raise CorruptSegment(f"the segment ends at {size} bytes, before the checkpointed position {start_off}: "
                                 "durable records are gone", path, size)
        # Read from a 512-aligned offset so the torn-write test sees sector boundaries where they are.
        base = start_off - start_off % 512
        data = read_exact(io, fd, size - base, base) if size > base else b""
        stats.bytes_read += len(data)
        try:
            end = base + find_end(last_seg, data, start_off - base, path, last=True)
        except CorruptSegment as exc:
            raise CorruptSegment(exc.reason, path, exc.offset + base) from None
        if checkpoint_head is not None and pos_segment(checkpoint_head) == last_seg \
                and end < pos_offset(checkpoint_head):
            raise CorruptSegment(f"the log ends at offset {end}, before the checkpointed head "
                                 f"{pos_offset(checkpoint_head)}: records that were durable are damaged",
                                 path, end)
        if end < size:
            log.warning("cutting torn tail of %s: %d bytes at offset %d", path, size - end, end)
            stats.tail_cut_bytes = size - end
            io.truncate(fd, end)
            io.fsync(fd)
        return end
    finally:
        io.close(fd)


def scan_suffix(io: FileIO, log_dir: str, start: int, end: int, stats: RecoveryStats) -> SuffixScan:
    result = SuffixScan()
    seg = pos_segment(start)
    last = pos_segment(end)
    while seg <= last:
        path = segment_path(log_dir, seg)
        read_segment_header(io, path, seg)
        off = pos_offset(start) if seg == pos_segment(start) else SEGMENT_HEADER_SIZE
        seg_end = pos_offset(end) if seg == last else _file_size(io, path)
        if seg != last:
            check_sealed_size(io, log_dir, seg, seg_end)
        reader = FrameReader(io, path, seg, off, seg_end)
        try:
            for frame in reader.frames(verify=True):
                stats.records_read += 1
                _account(result, frame.pos, frame.rtype, decode_payload(frame.rtype, frame.payload, path=path,
                                                                        offset=pos_offset(frame.pos)))
        finally:
            stats.bytes_read += reader.bytes_read
            reader.close()
        stats.segments_scanned += 1
        seg += 1
    return result


def _file_size(io: FileIO, path: str) -> int:
    fd = io.open_read(path)
    try:
        return io.size(fd)
    finally:
        io.close(fd)


def _account(result: SuffixScan, pos: int, rtype: int, payload: object) -> None:
    if rtype == RecordType.START:
        assert isinstance(payload, Start)
        result.unfinished[pos] = OpenAttempt(pos, payload)
        result.to_mark.append(payload.envelope)
    elif rtype == RecordType.DELIVERY:
        assert isinstance(payload, Delivery)
        attempt = result.unfinished.get(payload.start)
        if attempt is not None:
            for o in payload.outcomes:
                attempt.outcomes[o.recipient] = int(o.status)
    elif rtype == RecordType.FINISH:
        assert isinstance(payload, Finish)
        result.unfinished.pop(payload.start, None)
    elif rtype == RecordType.ENVELOPE:
        assert isinstance(payload, Envelope)
        if payload.body:
            result.body_span = max(result.body_span, pos_segment(pos) - pos_segment(min(payload.body)))
        if payload.replaces is not None:
            result.replaced[payload.replaces] = pos
            result.to_mark.append(payload.replaces)


def sync_tail(io: FileIO, log_dir: str, checkpoint: Checkpoint | None, first_seg: int, end: int) -> int:
    """Make every record up to ``end`` durable, syncing only what may not be. Returns the syncs done.

    Why each sync is or is not needed:

    - Everything before the checkpoint's head was durable when the checkpoint
      was stored (``Spool.checkpoint_write`` refuses otherwise), and the only
      writes that land before a durable head later are garbage marks, which
      need no sync (a mark is only ever written after its START is durable, so
      a lost mark is re-inferred and a kept one is explained). So segments
      wholly before the head's segment are skipped, and when the log ends at
      the head there is nothing to sync.
    - Past the head, records may sit in the page cache only (a kill -9 after a
      write-only batch, or between a write and its fdatasync): each segment
      holding such bytes is fdatasynced.
    - A segment created after the head's segment may lack a durable directory
      entry (the writer syncs the directory with the next durable batch, which
      a kill -9 can pre-empt): then the log directory is fsynced too, or a
      power cut could take the whole segment back after recovery acted on it
      (marked envelopes for its STARTs, or checkpointed a head inside it).
    """
    if checkpoint is not None and end <= checkpoint.head:
        return 0
    head_seg = pos_segment(checkpoint.head) if checkpoint is not None else first_seg
    first = max(first_seg, head_seg)
    last = pos_segment(end)
    for seg in range(first, last + 1):
        fd = io.open(segment_path(log_dir, seg))
        try:
            io.fdatasync(fd)
        finally:
            io.close(fd)
    syncs = last + 1 - first
    if last > head_seg:
        io.fsync_dir(log_dir)
        syncs += 1
    return syncs


def in_doubt_recipients(envelope: Envelope, attempt: OpenAttempt) -> list[str]:
    if attempt.start.kind is not StartKind.DELIVERY:
        return []
    return [r for r in envelope.recipients if r not in attempt.outcomes]


def remaining_recipients(envelope: Envelope, attempt: OpenAttempt) -> list[str]:
    from spool.record import Status

    return [r for r in envelope.recipients
            if r not in attempt.outcomes or not Status(attempt.outcomes[r]).final]


def report_in_doubt(queue_id: str, recipients: list[str]) -> None:
    for r in recipients:
        log.warning("in doubt: queue id %s recipient %s: an attempt was in flight at the crash with no "
                    "outcome recorded; it will be delivered again", queue_id, r)


def describe(cp: Checkpoint | None) -> str:
    if cp is None:
        return "no checkpoint: scanning from the first segment"
    return f"checkpoint {cp.sequence}: working suffix from {format_pos(cp.working_start)}"


def now_ms(clock: float | None = None) -> int:
    return int((time.time() if clock is None else clock) * 1000)


def validate_segments(io: FileIO, log_dir: str, ids: list[int]) -> None:
    """The log is a contiguous run of segment ids; a gap means a lost file."""
    for a, b in itertools.pairwise(ids):
        if b != a + 1:
            raise CorruptSegment(f"segment {a + 1} is missing between {a} and {b}",
                                 os.path.join(log_dir, f"{a + 1:016x}.seg"), 0)


__all__ = [
    "CorruptRecord",
    "OpenAttempt",
    "RecoveryStats",
    "SuffixScan",
    "describe",
    "find_log_end",
    "in_doubt_recipients",
    "make_pos",
    "remaining_recipients",
    "report_in_doubt",
    "scan_suffix",
    "sync_tail",
    "validate_segments",
]
