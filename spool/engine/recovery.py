"""Recovery: every start of the spool is one. The whole algorithm is in this file, in the order it runs.

Read it beside docs/format.md ("Reading the log", "Checkpoint") and
docs/design.md ("Recovery"). ``Spool.open`` takes the lock and calls
``recover``; ``Recovery.run`` is the steps below, one method each.

1. **Checkpoint.** Remove a temporary checkpoint left by an interrupted write;
   read the checkpoint (none: scan from the first segment, and say so; a
   damaged one is moved to the quarantine and the whole log scanned, or the
   open refused with ``on_damage = "refuse"``). Finish deleting the segments
   that lie wholly behind its garbage-prefix end (a deletion the crash
   interrupted).
2. **Segments.** The log is a contiguous run of segment ids from the oldest
   one the checkpoint still needs to the one its head lies in: a gap, a
   missing first segment, or a missing segment where the head lies, is damage
   (``LogReader.missing``), reported once the end of the log is known. No
   segment and no checkpoint: a new spool, whose first segment is created
   here; no segment while a checkpoint names some: damage, and a new segment
   after the head's.
3. **The end of the log.** The last segment is walked from where the working
   suffix begins in it (or from its first record), every frame checked
   (``LogReader.segment``), and the reader is told the checkpoint's head is
   durable: nothing before it can be a torn tail. A torn tail is cut
   (truncated and fsynced), its bytes kept in the quarantine. Damage at or
   past the last position recovery can prove durable (the checkpoint's head,
   a garbage-marked record: docs/design.md, "Recovery") is an unacknowledged
   tail: cut likewise. Not a record that passes its checksum (one whose
   payload does not decode, or of a type this version does not know): it was
   written whole, so it is damage of that record alone, reported, and the
   records after it are kept. Damage before it is reported. A half-created last
   segment, a torn tail at offset 0 (its header never written, so nothing in
   it was ever promised), is removed and the segment before it is walked as
   the last. A log that ends before the checkpoint's head (durable records
   gone) goes on in a new segment, so that no queue id is given twice.
4. **Sync the tail** (``Recovery.sync_tail``): make the log durable up to its end
   before acting on it. After a kill -9 the page cache still holds writes that
   were never synced; making them durable first means nothing below acts on a
   record that a later power cut could take back.
5. **Scan the working suffix** (``LogReader.frames``): every START without a
   FINISH is an attempt that was in flight, with the outcomes its DELIVERY
   records give; every START's envelope and every replaced envelope needs its
   garbage mark; envelopes say how far back their bodies reach.
   Then the delivery workers' own marks (``read_marks``): each names an
   attempt and recipients past their point of no return, as a ``sending``
   does.
6. **Garbage marks.** Marks are written without fsync and may have been lost:
   each is written again (a one-byte write in place).
7. **Runners** start at the checkpoint's positions. Every sealed segment they
   will read is checked against the size its successor's header recorded, so
   a truncated segment is found at the open, not by a runner later.
8. **In flight.** For each unfinished attempt: if a replacement envelope was
   written, only the FINISH was lost. Otherwise a replacement envelope carries
   the recipients without a final outcome (body shared or copied forward,
   class and attempt count kept) and a FINISH ends the attempt. A recipient
   of a delivery attempt that a DELIVERY's ``sending`` names (the point of no
   return: durable before the final dot was written to the next hop) and no
   outcome covers is *in doubt*: the remote may have taken it before the
   crash. A claim alone is not doubt: a recipient never named in a
   ``sending`` is simply due again (docs/design.md, "The point of no
   return"; an attempt whose START lies in a segment of format version 2 or
   3, written before ``sending`` existed, keeps the old rule: every
   recipient without an outcome is in doubt). It is logged (one line per
   message) and kept in the replacement's ``in_doubt`` list; with
   ``in_doubt = "hold"`` (the default) the replacement is held (the held
   class and flag, as ``mta queue hold`` writes it) until the operator
   releases or deletes it, with ``"redeliver"`` it is delivered again.
9. **Commit** the replacement envelopes and FINISH records. On a full disk
   they wait in memory (safe: they need no fsync of their own, and a crash
   before they are written recovers the same attempts again;
   docs/design.md, "A full disk").
10. **The first checkpoint**, so that the next start scans only what is in
    flight then (skipped while records wait for room, and when the positions
    have not moved, as after a clean stop).

Damage. Every anomaly the reader finds other than a torn tail — a damaged
record, a damaged segment header, a segment of a newer format, a missing
segment, a sealed size that disagrees with the successor's header, a segment
that ends before the checkpoint's head — goes to one place:
``Recovery.report``, which hands each distinct anomaly once to the spool's
damage policy (``spool.damage.policy``; or the reporter ``recover`` was
given). With ``on_damage = "quarantine"`` (the default) the policy copies
the damaged bytes to the quarantine, names the messages lost and returns, and
recovery goes on with what the reader can read: the scan resynchronises on
the next valid frame, a missing segment is passed over, a sealed segment is
read up to the size its successor recorded. With ``refuse`` it raises
DamageRefused, saying what to run (a newer format is refused always). The
reads of one record at a known position go to the same policy: an in-flight
attempt's envelope that cannot be read (the message is named from its START
and DELIVERY records and the attempt ended with a FINISH), a body copied
forward (``DamagedBody``: the replacement carries no body and says why).

Cost. Recovery reads the working suffix (the last segment's part of it twice:
once to find the end, once to scan) plus one envelope (and its body, when it
is copied forward) per in-flight attempt, and one header per sealed segment
the runners will read: its cost depends on what was in flight, never on how
much deferred mail the queue holds. ``RecoveryStats`` counts what it read.
"""

from __future__ import annotations

import contextlib
import logging
import os

import attrs

from spool.engine.core import BODY_SLACK
from spool.engine.reclaim import Reclaim
from spool.engine.runner import Runner
from spool.errors import CheckpointFailed, CorruptRecord, DiskFull, FormatVersionError
from spool.fileio import FileIO, write_all
from spool.format import checkpoint as ckpt
from spool.format.marks import TMP_SUFFIX, marks_dir
from spool.format.record import (
    HELD_CLASS,
    Delivery,
    Envelope,
    Finish,
    Frame,
    RecordType,
    Start,
    StartKind,
    Status,
    decode_payload,
    format_pos,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import (
    FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    encode_segment_header,
    header_version,
    list_segments,
    segment_path,
)
from spool.read import lost
from spool.read.anomaly import Anomaly, Kind
from spool.read.lost import LogContext
from spool.read.marks import read_marks_dir
from spool.read.reader import LogReader, Reporter

log = logging.getLogger("spool.engine.recovery")

# The records the suffix scan decodes; DATA records are checked, not copied.
# The first format version whose DELIVERY records carry ``sending`` (the point of no return).
SENDING_VERSION = 4
SCANNED = frozenset({RecordType.ENVELOPE, RecordType.START, RecordType.DELIVERY, RecordType.FINISH})


@attrs.define
class RecoveryStats:
    bytes_read: int = 0
    records_read: int = 0
    segments_scanned: int = 0
    tail_cut_bytes: int = 0
    in_flight: int = 0
    in_doubt: int = 0  # recipients
    held: int = 0  # messages held in doubt (``in_doubt = "hold"``)
    replacements: int = 0
    marks: int = 0
    syncs: int = 0  # fdatasyncs and directory fsyncs made to secure the log's tail before acting on it
    seconds: float = 0.0


@attrs.define
class OpenAttempt:
    """A START without a FINISH in the working suffix, and the outcomes recorded for it."""

    start_pos: int
    start: Start
    outcomes: dict[str, int] = attrs.field(factory=dict)
    sending: set[str] = attrs.field(factory=set)  # recipients past the point of no return (DELIVERY's sending)
    legacy: bool = False  # its START lies in a segment written before ``sending`` existed (format 2 or 3)


@attrs.define
class SuffixScan:
    """What the scan of the working suffix found."""

    unfinished: dict[int, OpenAttempt] = attrs.field(factory=dict)
    replaced: dict[int, int] = attrs.field(factory=dict)  # old envelope -> replacement
    to_mark: list[int] = attrs.field(factory=list)
    body_span: int = 0  # envelopes written since the checkpoint: how far back their bodies reach
    marks_damaged: bool = False  # a worker's marks file could not be read whole: every claim is doubt


def refuse(anomaly: Anomaly) -> None:
    """A policy that stops the open at the first damage, naming the file, the offset and the reason (the
    engine's behaviour before damage was quarantined; ``on_damage = "refuse"`` is ``spool.damage.policy``'s, which also
    says what to run)."""
    raise anomaly.error()


def recover(sp: Reclaim, on_damage: Reporter | None = None) -> RecoveryStats:
    """Recover the spool ``sp`` (its directory made and locked, nothing read yet).

    On return its writer stands at the end of the log, its runners at their
    positions, its in-flight attempts are ended, and a checkpoint is written.
    ``on_damage``: where the anomalies go (default: the spool's damage policy,
    ``sp.damage``, as its config's ``on_damage`` says). Raises whatever that
    raises (DamageRefused, FormatVersionError).
    """
    return Recovery(sp, on_damage).run()


def working_start(cp: ckpt.Checkpoint | None, first: int) -> int:
    """Where the scan begins: the checkpoint's working-suffix start, or the first record of the log."""
    origin = make_pos(first, SEGMENT_HEADER_SIZE)
    return origin if cp is None else max(cp.working_start, origin)


class Recovery:
    """One recovery of one spool: the steps of the module docstring, in order."""

    def __init__(self, sp: Reclaim, on_damage: Reporter | None = None) -> None:
        self.sp = sp
        self.io: FileIO = sp.io
        self.log_dir = sp.log_dir
        self.on_damage = on_damage if on_damage is not None else sp.damage.reporter("recovery")
        self.stats = RecoveryStats()
        self._reported: set[Anomaly] = set()
        # How far the log reaches, as far as recovery has found it (None: not yet): until the spool has its writer,
        # the finder of lost messages reads no further (``context``). It moves while the end of the log is sought
        # and cut.
        self.reach: int | None = None
        self.log_open = False  # the spool appends (``SpoolCore.open_log``): its own context holds from here

    def run(self) -> RecoveryStats:
        with self.sp.damage.recovering(self.context):
            return self._run()

    def context(self) -> LogContext | None:
        """What the finder of lost messages needs while recovery runs: up to ``reach`` until the log is open."""
        if self.log_open:
            return self.sp.damage_context()
        return None if self.reach is None else self.sp.log_context(self.reach)

    def _run(self) -> RecoveryStats:
        sp, stats = self.sp, self.stats
        t0 = sp._now()
        cp = self.read_checkpoint()
        ids, missing = self.segments(cp)
        last, end_off = self.find_log_end(cp, ids)
        if cp is not None and make_pos(last, end_off) < cp.head:
            last, end_off = self.fresh_segment(cp, ids, make_pos(last, end_off))
        self.reach = make_pos(last, end_off)
        for anomaly in missing:  # reported now that the end of the log is known: what they lost can be named
            self.report(anomaly)
        first = ids[0]
        start, end = working_start(cp, first), make_pos(last, end_off)
        self.sync_tail(cp, pos_segment(start), end, ids)
        sp.open_log(last, end_off, t0)  # the tail is synced (sync_tail): the spool appends from its end
        self.log_open = True
        reader = self.reader(cp, ids)
        found = self.scan_suffix(reader, start, end)
        self.read_marks(found)
        sp.bodies_reach(found.body_span)
        self.mark_garbage(found.to_mark)
        self.start_runners(cp, first, end)
        self.check_sealed(reader, min(r.pos for r in sp.runners), last)
        versions: dict[int, int | None] = {}
        for attempt in sorted(found.unfinished.values(), key=lambda a: a.start_pos):
            seg = pos_segment(attempt.start_pos)
            if seg not in versions:
                versions[seg] = self.segment_version(seg)
            attempt.legacy = (versions[seg] or FORMAT_VERSION) < SENDING_VERSION or found.marks_damaged
            self.close_in_flight(attempt, found.replaced)
        self.commit()
        stats.seconds = sp._now() - t0
        log.info("recovered %s: %s; read %d records, %d bytes; %d in flight, %d in doubt%s", sp.path, describe(cp),
                 stats.records_read, stats.bytes_read, stats.in_flight, stats.in_doubt,
                 f" ({stats.held} message{'s' if stats.held > 1 else ''} held: mta queue list --in-doubt)"
                 if stats.held else "", extra={"event": "recovered"})
        self.first_checkpoint()
        return stats

    # -- 5b. the delivery workers' marks ---------------------------------------------------------

    def read_marks(self, found: SuffixScan) -> None:
        """The delivery workers' own points of no return (``spool.format.marks``), as ``sending`` of the attempt
        they name (a mark of an attempt not in flight here: it ended). A file that cannot be read whole hides
        which dots went: quarantined, and every claim in flight is doubt (docs/design.md)."""
        sp = self.sp
        for read in read_marks_dir(marks_dir(sp.path)):
            for mark in read.marks:
                attempt = found.unfinished.get(mark.start_pos)
                if attempt is not None:
                    attempt.sending.update(mark.recipients)
            if read.path.endswith(TMP_SUFFIX) and not read.marks:  # its creation cut short: no mark, no dot
                with contextlib.suppress(OSError):
                    os.unlink(read.path)
                continue
            if read.damage is not None:
                found.marks_damaged = True
                try:
                    sp.damage.marks_damaged(read.path, read.damage, sp._now_ms())
                except OSError:
                    pass  # logged there; the file stays, read again (and held in doubt again) at the next start

    # -- damage -------------------------------------------------------------------------

    def report(self, anomaly: Anomaly) -> None:
        """The one place where recovery meets damage: each distinct anomaly goes to ``on_damage`` once.

        Once: the same anomaly can be met twice (a missing segment by the
        listing and by the scan, a sealed size by the scan and by the runners'
        check), and a policy that quarantines must see it once.
        """
        if anomaly in self._reported:
            return
        self._reported.add(anomaly)
        self.on_damage(anomaly)

    def reader(self, cp: ckpt.Checkpoint | None, ids: list[int]) -> LogReader:
        """The log as recovery reads it: these segments, everything before the checkpoint's head durable, and
        every segment from the oldest one the checkpoint still needs (``first_needed``) present."""
        return LogReader(self.io, self.log_dir, segments=ids, durable=cp.head if cp is not None else None,
                         expect_first=first_needed(cp))

    # -- 1. checkpoint --------------------------------------------------------------------

    def read_checkpoint(self) -> ckpt.Checkpoint | None:
        sp = self.sp
        if ckpt.remove_temp(self.io, sp.path):
            log.info("%s: removed a temporary checkpoint left by an interrupted write", sp.path)
        try:
            cp = ckpt.load(self.io, sp.path)
        except (ckpt.CorruptCheckpoint, FormatVersionError) as exc:
            # Moved to the quarantine (refused with on_damage = "refuse"): the start scans the whole log, as
            # without a checkpoint. Slower, never wrong: positions may lag, and none do now. A version this
            # code does not know is handled alike: the version field is outside the checksum, so a flipped
            # bit reads as one, and a spool truly written by a newer version is refused by its segments.
            reason = exc.reason if isinstance(exc, CorruptRecord) else str(exc).removeprefix(
                os.path.join(sp.path, ckpt.NAME) + ": ")
            sp.damage.checkpoint_damaged(os.path.join(sp.path, ckpt.NAME), reason, sp._now_ms())
            cp = None
        sp.start_from(cp)
        return cp

    # -- 2. segments ----------------------------------------------------------------------

    def segments(self, cp: ckpt.Checkpoint | None) -> tuple[list[int], list[Anomaly]]:
        """The segment ids of the log, after finishing the deletions the checkpoint allows, and the segments
        it should hold and does not (a gap, a missing first or last one), for ``report``."""
        sp = self.sp
        ids = list_segments(self.io, self.log_dir)
        if cp is not None:
            keep_from = pos_segment(cp.garbage_end) - sp.slack
            sp._delete_segments_before(keep_from, ids)
            ids = [s for s in ids if s >= keep_from]
        if not ids:
            if cp is not None:
                # Every segment is gone, and the checkpoint says there were some: damage, loudly. The log
                # goes on in a new segment after the checkpoint's head, so that no queue id is used twice.
                head_seg = pos_segment(cp.head)
                self.report(Anomaly(Kind.MISSING_SEGMENT, head_seg, segment_path(self.log_dir, head_seg), 0, 0,
                                    f"the checkpoint names segments {first_needed(cp)} to {head_seg} but none "
                                    "exist"))
                self.create_segment(head_seg + 1)
                return [head_seg + 1], []
            self.create_segment(1)
            return [1], []
        if cp is None:
            log.warning("%s: no checkpoint: scanning the whole log (%d segments) to recover", sp.path, len(ids))
        missing = self.reader(cp, ids).missing()
        if missing and self.sp.damage.mode == "refuse":
            self.report(missing[0])  # refuses before anything is touched
        return ids, missing

    def create_segment(self, seg: int) -> None:
        """A new, empty segment ``seg`` (the first of a new spool, or one after lost data), made durable."""
        path = segment_path(self.log_dir, seg)
        fd = self.io.open(path, create=True, truncate=True)
        try:
            write_all(self.io, fd, encode_segment_header(seg, int(self.sp._now())), 0)
            self.io.fsync(fd)
        finally:
            self.io.close(fd)
        self.io.fsync_dir(self.log_dir)

    def fresh_segment(self, cp: ckpt.Checkpoint, ids: list[int], end: int) -> tuple[int, int]:
        """The log ends before the checkpoint's head (the last segment is missing or cut short): records the
        checkpoint vouched for are gone (reported as damage). Appending at ``end`` would give new records the
        positions, and so the queue ids, of lost ones: the log goes on in a new segment instead.

        The new segment records no sealed size for its predecessor (0: nothing to check it against).
        """
        seg = max(pos_segment(cp.head), ids[-1]) + 1
        log.warning("%s: the log ends at %s, before the checkpoint's head %s: durable records are gone; the log "
                    "goes on in a new segment %d", self.sp.path, format_pos(end), format_pos(cp.head), seg)
        self.create_segment(seg)
        ids.append(seg)
        return seg, SEGMENT_HEADER_SIZE

    # -- 3. the end of the log ----------------------------------------------------------------

    def find_log_end(self, cp: ckpt.Checkpoint | None, ids: list[int]) -> tuple[int, int]:
        """The last segment and the offset where its valid data ends, after cutting what was never acknowledged.

        The last segment is walked from where the working suffix begins in it.
        Damage at or past the last position recovery can prove durable
        (``proven``) is an unacknowledged tail: cut from there, the bytes kept
        in the quarantine (``cut_unacknowledged``). Damage before it is damage
        (``report``). A torn tail is cut, its bytes kept too. Removes a
        half-created last segment from ``ids`` (and from disk).
        """
        while True:
            last = ids[-1]
            start = working_start(cp, ids[0])
            reader = self.reader(cp, ids)
            size = reader.size(last)
            self.reach = make_pos(last, size)
            # From where the working suffix begins in it; from its first record when it is shorter than that
            # (it lost durable records: what is left of them is walked and named too).
            from_off = pos_offset(start) if pos_segment(start) == last and pos_offset(start) <= size else None
            walk = reader.segment(last, from_off, types=(RecordType.ENVELOPE,))
            torn = None
            damage: list[Anomaly] = []
            proven = proven_by_checkpoint(cp, last)
            after: list[Frame] = []  # envelopes after the first damage: what a cut would take
            for item in walk:
                if isinstance(item, Anomaly):
                    if item.torn:
                        torn = item
                    else:
                        damage.append(item)
                    continue
                if item.garbage:
                    # A garbage mark is written only on a record already durable, after the commit that made
                    # its START durable: everything up to its end was fdatasynced (docs/design.md, "Recovery").
                    proven = max(proven, pos_offset(item.pos) + item.size)
                if damage:
                    after.append(item)
            self.stats.bytes_read += walk.bytes_read
            if torn is not None and torn.offset == 0:
                self.remove_half_created(torn, ids)
                continue
            size = walk.data_end
            unacked = next((a for a in damage if a.kind is Kind.DAMAGED_RECORD and a.offset >= proven), None)
            for anomaly in damage:
                if unacked is None or anomaly.offset < unacked.offset:
                    self.report(anomaly)
            if unacked is not None:
                cut_at = unacked.offset
                # Kept up to where the zeros that end the file begin (the room is not part of the damage).
                stop = unacked.offset + unacked.length if unacked.resume is None else walk.records_end
                self.cut_unacknowledged(unacked, last, proven, size, stop,
                                        [f for f in after if pos_offset(f.pos) >= cut_at])
                return last, cut_at
            end = walk.valid_end
            if torn is not None:
                self.cut(torn, last, end, size)
            return last, end

    def remove_half_created(self, torn: Anomaly, ids: list[int]) -> None:
        """A crash while creating a segment can leave it without its header: then it held nothing.

        A segment's header is written with its first records and synced before
        anything in it is acknowledged, and a torn write keeps a prefix of what
        was written, so a segment whose first sector is gone is empty or all
        zeros, and nothing in it was ever promised to anyone.
        """
        log.warning("removing segment %s left half-created by a crash", torn.path)
        self.stats.tail_cut_bytes += torn.length
        self.io.unlink(torn.path)
        self.io.fsync_dir(self.log_dir)
        ids.pop()
        if not ids:
            self.create_segment(1)
            ids.append(1)

    def cut(self, torn: Anomaly, seg: int, end: int, size: int) -> None:
        """Cut a torn tail (an interrupted write: never acknowledged) from the last segment, its bytes kept."""
        path = segment_path(self.log_dir, seg)
        # Kept up to where the zeros that end the file begin (the reader's range); the file is cut at ``end``.
        tail = Anomaly(Kind.TORN_TAIL, seg, path, end, max(torn.offset + torn.length, end) - end, torn.reason)
        note = self.sp.damage.cut(tail, "a torn tail: a write interrupted by the crash, never acknowledged; cut")
        log.warning("cutting torn tail of %s: %d bytes at offset %d (%s)", path, size - end, end, _kept(note))
        self.truncate(seg, end, size)

    def cut_unacknowledged(self, first: Anomaly, seg: int, proven: int, size: int, stop: int,
                           envelopes: list[Frame]) -> None:
        """Cut the last segment at the damage ``first``, which lies past every position recovery can prove
        durable: pages written after the last fsync reached the disk out of order (docs/design.md,
        "Recovery"), so nothing from there on was acknowledged. The cut bytes are kept in the quarantine
        first (with the envelopes among them named, in case the disk, not a crash, damaged them)."""
        path = segment_path(self.log_dir, seg)
        span = Anomaly(Kind.DAMAGED_RECORD, seg, path, first.offset, max(stop, first.offset + first.length)
                       - first.offset, first.reason, first.resume)
        named = [_unacknowledged(self.sp, f) for f in envelopes]
        why = (f"damage at offset {first.offset} ({first.message()}) lies past the last position recovery can "
               f"prove durable (offset {proven}): pages written after the last fsync reached the disk out of "
               "order, so nothing from there on was acknowledged; cut")
        note = self.sp.damage.cut(span, why, named)
        log.warning("cut %d bytes of %s at offset %d (segment %d): %s (%s; %d envelopes among them, none "
                    "acknowledged)", size - first.offset, path, first.offset, seg, why, _kept(note), len(named))
        self.truncate(seg, first.offset, size)

    def truncate(self, seg: int, end: int, size: int) -> None:
        self.stats.tail_cut_bytes += size - end
        fd = self.io.open(segment_path(self.log_dir, seg))
        try:
            self.io.truncate(fd, end)
            self.io.fsync(fd)
        finally:
            self.io.close(fd)

    # -- 4. sync the tail -------------------------------------------------------------------

    def sync_tail(self, cp: ckpt.Checkpoint | None, first_seg: int, end: int, ids: list[int]) -> None:
        """Make every record up to ``end`` durable, syncing only what may not be (counted in ``stats.syncs``).

        Why each sync is or is not needed:

        - Everything before the checkpoint's head was durable when the
          checkpoint was stored (``Reclaim.checkpoint_write`` refuses
          otherwise), and the only writes that land before a durable head
          later are garbage marks, which need no sync (a mark is only ever
          written after its START is durable, so a lost mark is re-inferred and
          a kept one is explained). So segments wholly before the head's
          segment are skipped, and when the log ends at the head there is
          nothing to sync.
        - Past the head, records may sit in the page cache only (a kill -9
          after a write-only batch, or between a write and its fdatasync):
          each segment holding such bytes is fdatasynced.
        - A segment created after the head's segment may lack a durable
          directory entry (the writer syncs the directory with the next durable
          batch, which a kill -9 can pre-empt): then the log directory is
          fsynced too, or a power cut could take the whole segment back after
          recovery acted on it (marked envelopes for its STARTs, or
          checkpointed a head inside it).
        """
        if cp is not None and end <= cp.head:
            return
        head_seg = pos_segment(cp.head) if cp is not None else first_seg
        first = max(first_seg, head_seg)
        last = pos_segment(end)
        for seg in range(first, last + 1):
            if seg not in ids:
                continue  # missing: reported with the listing
            fd = self.io.open(segment_path(self.log_dir, seg))
            try:
                self.io.fdatasync(fd)
            finally:
                self.io.close(fd)
            self.stats.syncs += 1
        if last > head_seg:
            self.io.fsync_dir(self.log_dir)
            self.stats.syncs += 1

    # -- 5. the working suffix --------------------------------------------------------------

    def scan_suffix(self, reader: LogReader, start: int, end: int) -> SuffixScan:
        result = SuffixScan()
        records, read = reader.records, reader.bytes_read
        for item in reader.decoded(start, end, types=SCANNED):
            if isinstance(item, Anomaly):
                self.report(item)  # a record whose payload does not decode is damage of that record alone
                continue
            frame, payload = item
            _account(result, frame.pos, frame.rtype, payload)
        self.stats.records_read += reader.records - records
        self.stats.bytes_read += reader.bytes_read - read
        self.stats.segments_scanned += max(0, pos_segment(end) - pos_segment(start) + 1)
        return result

    # -- 6. garbage marks ---------------------------------------------------------------------

    def mark_garbage(self, positions: list[int]) -> None:
        for pos in positions:
            try:
                self.sp.writer.mark_now(pos)
            except FileNotFoundError:
                pass  # its segment was already reclaimed: nothing left to mark
            self.stats.marks += 1

    # -- 7. runners -------------------------------------------------------------------------

    def start_runners(self, cp: ckpt.Checkpoint | None, first: int, end: int) -> None:
        """Runners at the checkpoint's positions, within the log (a position past its end, in records that
        are gone, begins at the end)."""
        sp = self.sp
        origin = make_pos(first, SEGMENT_HEADER_SIZE)
        n = sp.config.classes
        for k in range(n):
            pos = cp.runners[k] if cp is not None and k < len(cp.runners) else (
                min(cp.runners) if cp is not None and cp.runners else origin)
            sp.runners.append(Runner(self.io, self.log_dir, k, sp.config.interval(k), min(max(pos, origin), end),
                                     sweeper=k == n - 1, reporter=sp.damage.reporter(f"runner {k}")))

    def check_sealed(self, reader: LogReader, start: int, last: int) -> None:
        """Every sealed segment the runners will read is as long as its successor's header says.

        One header read per segment: a truncated segment is reported at open,
        not discovered by a runner later.
        """
        listed = set(reader.segments)
        for seg in range(pos_segment(start), last):
            if seg in listed:  # a missing one was reported with the listing
                anomaly = reader.sealed_size(seg, reader.size(seg))
                if anomaly is not None:
                    self.report(anomaly)

    # -- 8. in flight ---------------------------------------------------------------------------

    def close_in_flight(self, attempt: OpenAttempt, replaced: dict[int, int]) -> None:
        sp, stats = self.sp, self.stats
        stats.in_flight += 1
        env_pos = attempt.start.envelope
        if env_pos in replaced:
            sp._append(RecordType.FINISH, Finish(attempt.start_pos, sp._now_ms(), replaced[env_pos]))
            return
        try:
            frame, env = self.read_envelope(env_pos)
        except (CorruptRecord, FileNotFoundError) as exc:
            self.lost_in_flight(attempt, getattr(exc, "reason", None) or str(exc))
            return
        if env_pos in replaced:
            sp._append(RecordType.FINISH, Finish(attempt.start_pos, sp._now_ms(), replaced[env_pos]))
            return
        doubt = in_doubt_recipients(env, attempt)
        # Held in doubt: the replacement is in the held class with the held flag, the same record an admin
        # hold writes, so a second restart finds it held and only `mta queue release` lets it go.
        hold = bool(doubt) and sp.config.in_doubt == "hold"
        if doubt:
            report_in_doubt(sp.queue_id(env.message_id), doubt, held=hold)
            stats.in_doubt += len(doubt)
            stats.held += hold
        replacement = None
        remaining = remaining_recipients(env, attempt)  # every recipient in doubt is among them
        if remaining:
            replacement = sp._write_replacement(env, env_pos, HELD_CLASS if hold else frame.klass, remaining,
                                                attempts=env.attempts, held=hold,
                                                in_doubt=tuple(dict.fromkeys(env.in_doubt + tuple(doubt))))
            stats.replacements += 1
        fin = sp._append(RecordType.FINISH, Finish(attempt.start_pos, sp._now_ms(), replacement))
        sp._settling.append((fin, attempt.start_pos, min((env_pos, *env.body))))

    def segment_version(self, seg: int) -> int | None:
        """The format version segment ``seg``'s header names (None: unreadable; the scan reported it)."""
        try:
            fd = self.io.open_read(segment_path(self.log_dir, seg))
        except FileNotFoundError:
            return None
        try:
            return header_version(self.io.read(fd, SEGMENT_HEADER_SIZE, 0))
        finally:
            self.io.close(fd)

    def read_envelope(self, pos: int) -> tuple[Frame, Envelope]:
        """Raises CorruptRecord, FileNotFoundError (its segment is missing)."""
        frame = self.sp.writer.read_frame(pos)
        if frame.rtype != RecordType.ENVELOPE:
            raise CorruptRecord(f"expected an envelope at position {format_pos(pos)}",
                                segment_path(self.log_dir, pos_segment(pos)), pos_offset(pos))
        env = decode_payload(frame.rtype, frame.payload)
        assert isinstance(env, Envelope)
        return frame, env

    def lost_in_flight(self, attempt: OpenAttempt, reason: str) -> None:
        """An attempt in flight at the crash whose envelope cannot be read: damage (reported), and its
        message is lost, named by the attempt's START and DELIVERY records. A FINISH ends the attempt."""
        sp = self.sp
        env_pos = attempt.start.envelope
        anomaly = sp.anomaly_at(env_pos, reason)
        self.report(anomaly)
        sp.damage.name_more(anomaly, [lost.in_flight(attempt.start_pos, env_pos, attempt.outcomes)])
        fin = sp._append(RecordType.FINISH, Finish(attempt.start_pos, sp._now_ms(), None))
        sp._settling.append((fin, attempt.start_pos, env_pos))

    # -- 9. commit ------------------------------------------------------------------------------

    def commit(self) -> None:
        sp = self.sp
        try:
            sp.commit()
        except DiskFull as exc:
            # Safe to go on: what waits is only replacement envelopes and FINISH records (and garbage
            # marks), which need no fsync of their own; a crash before they are written recovers the
            # same attempts again. Runners see them once written (docs/design.md, "A full disk").
            log.warning("recovered %s on a full disk (%s): %d bytes of replacement envelopes and FINISH records "
                        "wait in memory until there is room", sp.path, exc, sp.writer.pending_bytes)

    # -- 10. the first checkpoint -------------------------------------------------------------------

    def first_checkpoint(self) -> None:
        """Not needed for correctness (the old checkpoint stays valid: positions may lag, never lead), but
        after a crash it bounds the next start's scan to what is in flight then, instead of rescanning this
        suffix at every start of a crash loop. After a clean stop it is identical to the stored one, and
        ``checkpoint_write`` skips it."""
        sp = self.sp
        if not sp.reserve.ensure():
            log.warning("%s: no room for the spool's %d-byte reserve yet", sp.path, sp.reserve.size)
        if sp.writer.full is not None:
            return
        try:
            sp.checkpoint()
        except (DiskFull, CheckpointFailed) as exc:
            log.warning("%s: checkpoint after recovery not written (%s); the previous one stands", sp.path, exc)


# -- the scan's bookkeeping, and what the log says about each attempt ---------------------------------


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
            attempt.sending.update(payload.sending)
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


def in_doubt_recipients(envelope: Envelope, attempt: OpenAttempt) -> list[str]:
    """The recipients the next hop may have taken: past the point of no return, with no outcome.

    Why that is enough: the relay writes the final dot for a recipient only
    after a DELIVERY naming it in ``sending`` is durable, and a next hop
    takes nothing before the final dot. So a recipient never named there
    cannot have been delivered by this attempt, and is due again.
    """
    if attempt.start.kind is not StartKind.DELIVERY:
        return []
    if attempt.legacy:
        return [r for r in envelope.recipients if r not in attempt.outcomes]
    return [r for r in envelope.recipients if r in attempt.sending and r not in attempt.outcomes]


def remaining_recipients(envelope: Envelope, attempt: OpenAttempt) -> list[str]:
    return [r for r in envelope.recipients
            if r not in attempt.outcomes or not Status(attempt.outcomes[r]).final]


def report_in_doubt(queue_id: str, recipients: list[str], *, held: bool) -> None:
    """One line per message: its queue id, its recipients in doubt (comma-joined), and what happens next."""
    fate = (f"the message is held: `mta queue release {queue_id}` delivers it again, `mta queue delete "
            f"{queue_id}` drops it" if held else "it will be delivered again")
    log.warning("in doubt: queue id %s recipient%s %s: an attempt was in flight at the crash with no outcome "
                "recorded; %s", queue_id, "s" if len(recipients) > 1 else "", ",".join(recipients), fate,
                extra={"event": "in_doubt", "qid": queue_id})  # fields of the JSON line (mta.observe.logline)


def describe(cp: ckpt.Checkpoint | None) -> str:
    if cp is None:
        return "no checkpoint: scanning from the first segment"
    return f"checkpoint {cp.sequence}: working suffix from {format_pos(cp.working_start)}"


def proven_by_checkpoint(cp: ckpt.Checkpoint | None, last: int) -> int:
    """How far the last segment is durable by the checkpoint alone: up to its head, if it lies there."""
    if cp is None or pos_segment(cp.head) < last:
        return 0
    if pos_segment(cp.head) > last:
        return 1 << 32  # the head lies beyond this segment: all of it was durable
    return pos_offset(cp.head)


def first_needed(cp: ckpt.Checkpoint | None) -> int | None:
    """The oldest segment a spool with this checkpoint must still have (None: no checkpoint, no rule).

    The engine deletes a segment only below ``segment(garbage_end) - BODY_SLACK - body_span`` of a
    durable checkpoint (docs/format.md, "Checkpoint"); segments are numbered from 1.
    """
    if cp is None:
        return None
    return max(1, pos_segment(cp.garbage_end) - BODY_SLACK - cp.body_span)


def _unacknowledged(sp: Reclaim, frame: Frame) -> dict[str, object]:
    """An envelope among cut bytes, for the quarantine note."""
    try:
        env = decode_payload(frame.rtype, frame.payload)
    except CorruptRecord:
        return {"position": format_pos(frame.pos), "error": "payload does not decode"}
    assert isinstance(env, Envelope)
    return {"position": format_pos(frame.pos), "queue_id": sp.queue_id(env.message_id), "sender": env.sender,
            "recipients": list(env.recipients), "replaces": None if env.replaces is None else format_pos(env.replaces)}


def _kept(note: dict[str, object]) -> str:
    if note.get("bytes_file"):
        return f"kept in quarantine/{note['bytes_file']}"
    return f"not kept: {note.get('copy_error', 'nothing to copy')}"
