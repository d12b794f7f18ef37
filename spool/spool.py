"""The synchronous spool: open (= recover), enqueue, runners' attempts, checkpoint.

This is the core without an event loop, used directly by the CLI, tests and
benchmarks, and wrapped by ``spool.commit.AsyncSpool`` for the relay. Nothing
here is durable until ``commit()`` (or the async layer's group commit) returns.

Durability rules (DESIGN §2, Finch):
- a new message's envelope and body are durable before the caller says 250
  (``enqueue`` then ``commit``);
- a DELIVERY record is durable before the message's next step (the caller
  commits after ``record_delivery``);
- START, FINISH, replacement envelopes and garbage marks carry no sync of their
  own: recovery rebuilds them. A START's garbage mark on its envelope is only
  written once the START itself is durable, so a surviving mark always has a
  surviving START to explain it.

Space: a segment is deleted (or archived) when it lies more than ``slack``
segments behind the garbage-prefix end of a durable checkpoint. Message bodies
sit in DATA records before their envelope, as far back as the body is long (or
as the client was slow). The spool records the longest such reach it has seen
(``body_span``, kept in the checkpoint, never decreasing) and keeps
BODY_SLACK + body_span segments; a replacement envelope shares its body when
that stays within the slack and copies it to the head otherwise, so deferred
mail never pins old segments.

A full disk (docs/design.md, "A full disk"): a commit that finds no room raises
DiskFull and keeps its records for the next try (``spool.log``); a message
whose commit failed is cancelled (``cancel``). Recovery on a full disk
completes with its replacement envelopes and FINISH records waiting in memory,
and skips its checkpoint. Segments are cut to the filesystem's size at open
(``spool.config.fit_to_filesystem``), and a reserve file keeps room for the
checkpoint that deletes segments (``spool.reserve``).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from spool import checkpoint as ckpt
from spool import recovery
from spool.config import SpoolConfig, fit_to_filesystem
from spool.errors import CheckpointFailed, CorruptRecord, DiskFull, MessageBusy, SpoolError, SpoolLocked, SyncFailed
from spool.fairness import DeferredBudget
from spool.fileio import FileIO, OsFileIO, write_all
from spool.log import Batch, LogWriter
from spool.record import (
    GARBAGE,
    HELD_CLASS,
    Delivery,
    Envelope,
    Finish,
    Outcome,
    RecordType,
    Start,
    StartKind,
    Status,
    decode_payload,
    format_id,
    make_pos,
    pos_segment,
)
from spool.reserve import Reserve
from spool.runner import Candidate, Runner
from spool.segment import (
    SEGMENT_HEADER_SIZE,
    check_sealed_size,
    encode_segment_header,
    list_segments,
    read_segment_header,
    segment_path,
)

log = logging.getLogger("spool")
BODY_SLACK = 2
LOG_DIR = "log"


@attrs.define(eq=False)
class Attempt:
    """A message claimed by a START: being delivered, or changed by an admin."""

    start_pos: int
    envelope_pos: int
    envelope: Envelope
    klass: int
    kind: StartKind
    expired: bool = False
    outcomes: dict[str, Outcome] = attrs.field(factory=dict)

    @property
    def message_id(self) -> int:
        return self.envelope.message_id

    @property
    def remaining(self) -> list[str]:
        """Recipients with no final outcome yet."""
        return [r for r in self.envelope.recipients
                if r not in self.outcomes or not self.outcomes[r].status.final]


class BodyCache:
    """Bodies of recently enqueued messages, by the position of their first DATA record.

    Why: most mail is delivered a moment after it is accepted; reading its body
    back from the log costs a read and, in the relay, a hop to a worker thread.
    Bounded in bytes. Under a backlog the oldest entries are the next to be
    delivered, so a full cache refuses newcomers rather than evicting them;
    only entries older than ``max_age`` (a message held or deleted before
    delivery, whose attempt never ends) make way. Entries leave when their
    message's attempt ends.
    """

    def __init__(self, limit: int, max_age: float = 60.0) -> None:
        self.limit = limit
        self.item_limit = limit // 4
        self.max_age = max_age
        self.bytes = 0
        self.hits = 0
        self._items: OrderedDict[int, tuple[float, tuple[bytes, ...], int]] = OrderedDict()

    def add(self, key: int, chunks: tuple[bytes, ...], size: int, now: float) -> None:
        if size > self.item_limit or key in self._items:
            return
        while self._items and self.bytes + size > self.limit:
            old_key, (added, _chunks, old_size) = next(iter(self._items.items()))
            if added > now - self.max_age:
                return
            del self._items[old_key]
            self.bytes -= old_size
        self._items[key] = (now, chunks, size)
        self.bytes += size

    def get(self, key: int) -> tuple[bytes, ...] | None:
        item = self._items.get(key)
        if item is None:
            return None
        self.hits += 1
        return item[1]

    def drop(self, key: int) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.bytes -= item[2]

    def __len__(self) -> int:
        return len(self._items)


class BodyWriter:
    """Streams a message body into DATA records as it arrives.

    Why: a 50 MB message must pass through in bounded memory. Chunks are
    appended (not synced) as they fill; the enqueue's commit makes them durable
    together with the envelope. A body small enough for the spool's body cache
    also keeps its chunks (references to bytes made anyway) for that cache.
    """

    def __init__(self, spool: Spool) -> None:
        self._spool = spool
        self._buf = bytearray()
        self.chunks: list[int] = []
        self.size = 0
        self.closed = False
        self.discarding = False
        self.kept: list[bytes] | None = [] if spool.body_cache.item_limit > 0 else None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.discarding:
            self.size += len(data)
            return
        if self.closed:
            raise SpoolError("body already closed")
        self._buf += data
        self.size += len(data)
        limit = self._spool.config.body_chunk
        while len(self._buf) >= limit:
            with memoryview(self._buf) as view:
                chunk = bytes(view[:limit])  # one copy; a slice of the bytearray would make two
            del self._buf[:limit]
            self._emit(chunk)

    def _emit(self, chunk: bytes) -> None:
        if self.kept is not None:
            if self.size > self._spool.body_cache.item_limit:
                self.kept = None
            else:
                self.kept.append(chunk)
        pos = self._spool._append(RecordType.DATA, chunk)
        if not self.chunks:
            self._spool._open_bodies[id(self)] = pos
        self.chunks.append(pos)
        self._spool._maybe_flush()

    def close(self) -> tuple[int, ...]:
        if not self.closed:
            if self._buf or not self.chunks:
                self._emit(bytes(self._buf))
                self._buf.clear()
            self.closed = True
        return tuple(self.chunks)

    def abort(self) -> None:
        """Forget the body: its DATA records become garbage with their segment."""
        self.closed = True
        self._spool._open_bodies.pop(id(self), None)

    def discard(self) -> None:
        """Abort, and count (not store) whatever is still written: the sender's data goes on arriving.

        For a receiver that must refuse the message at its end (the disk
        filled up meanwhile) but has to read it to the end first.
        """
        self.abort()
        self.discarding = True
        self._buf.clear()
        self.kept = None


@attrs.frozen
class Appended:
    """A message appended and not yet durable: what ``Spool.cancel`` needs if its commit fails."""

    message_id: int
    pos: int
    body: tuple[int, ...]


@attrs.frozen
class CheckpointPlan:
    head: int
    checkpoint: ckpt.Checkpoint


class Spool:
    """One spool directory, opened for writing by one process."""

    def __init__(self, path: str, config: SpoolConfig, io: FileIO) -> None:
        self.path = path
        self.log_dir = os.path.join(path, LOG_DIR)
        self.config = config
        self.io = io
        self.attempts: dict[int, Attempt] = {}
        self.by_envelope: dict[int, Attempt] = {}
        self._open_bodies: dict[int, int] = {}
        self._rr = 0
        self._lock_fd = -1
        self._checkpoint: ckpt.Checkpoint | None = None
        self.recovery_stats = recovery.RecoveryStats()
        self.writer: LogWriter
        self.runners: list[Runner] = []
        self.flush_hook: Any = None
        # How many segments a live body may lie behind its envelope (see BODY_SLACK); only grows.
        self.body_span = 0
        self.body_cache = BodyCache(config.body_cache)
        # Deferred claims while new mail flows (spool.fairness).
        self.budget = DeferredBudget(config.deferred_share)
        self.reserve = Reserve(io, path, min(config.reserve_bytes, config.segment_size))
        # Attempts ended in memory whose FINISH is not durable yet, oldest first: (FINISH position, START
        # position, first position of the envelope and its body). See checkpoint_plan(durable_only=True).
        self._settling: deque[tuple[int, int, int]] = deque()

    # -- open = recover -----------------------------------------------------

    @classmethod
    def open(cls, path: str, config: SpoolConfig | None = None, io: FileIO | None = None,
             *, lock: bool = True) -> Spool:
        """Open (creating if needed) and recover. Raises SpoolLocked, CorruptSegment, ..."""
        sp = cls(path, config or SpoolConfig(), io or OsFileIO())
        sp.io.makedirs(sp.log_dir)
        sp._fit_to_filesystem()
        if lock:
            sp._take_lock()
        try:
            sp._recover()
        except BaseException:
            sp.close()
            raise
        return sp

    def _take_lock(self) -> None:
        fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolLocked(f"{self.path}: another process has this spool open") from None
        self._lock_fd = fd

    def _fit_to_filesystem(self) -> None:
        """Cut segments (and the reserve) to a small filesystem, and say so (spool.config.fit_to_filesystem)."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return
        fs_bytes = st.f_blocks * st.f_frsize
        fitted = fit_to_filesystem(self.config, fs_bytes)
        if fitted is self.config:
            return
        log.warning("%s: segment_size %d bytes is more than 1/16 of its %d-byte filesystem, where segments could "
                    "not be deleted: using segments of %d bytes, a checkpoint at least every %d bytes appended and a "
                    "reserve of %d bytes", self.path, self.config.segment_size, fs_bytes, fitted.segment_size,
                    fitted.checkpoint_bytes, fitted.reserve_bytes)
        self.config = fitted
        self.reserve = Reserve(self.io, self.path, min(fitted.reserve_bytes, fitted.segment_size))

    def _now(self) -> float:
        return self.config.clock()

    def _now_ms(self) -> int:
        return int(self._now() * 1000)

    def _recover(self) -> None:
        t0 = self._now()
        stats = self.recovery_stats
        if ckpt.remove_temp(self.io, self.path):
            log.info("%s: removed a temporary checkpoint left by an interrupted write", self.path)
        cp = ckpt.load(self.io, self.path)
        self._checkpoint = cp
        ids = list_segments(self.io, self.log_dir)
        if cp is not None:
            self.body_span = cp.body_span
            self._delete_segments_before(pos_segment(cp.garbage_end) - self.slack, ids)
            ids = [s for s in ids if s >= pos_segment(cp.garbage_end) - self.slack]
        if not ids:
            if cp is not None:
                raise SpoolError(f"{self.path}: the checkpoint names segments but none exist")
            self._create_first_segment()
            ids = [1]
        recovery.validate_segments(self.io, self.log_dir, ids)
        first, last = ids[0], ids[-1]
        start = cp.working_start if cp is not None else make_pos(first, SEGMENT_HEADER_SIZE)
        if pos_segment(start) < first:
            start = make_pos(first, SEGMENT_HEADER_SIZE)
        last = self._drop_empty_last_segment(ids, cp)
        read_segment_header(self.io, segment_path(self.log_dir, last), last)
        tail_from = start if pos_segment(start) == last else make_pos(last, SEGMENT_HEADER_SIZE)
        end_off = recovery.find_log_end(self.io, self.log_dir, last, int(tail_from & 0xFFFFFFFF),
                                        cp.head if cp else None, stats)
        end = make_pos(last, end_off)
        stats.syncs += recovery.sync_tail(self.io, self.log_dir, cp, pos_segment(start), end)
        self.writer = LogWriter(self.io, self.log_dir, self.config.segment_size, last, end_off, int(t0))
        found = recovery.scan_suffix(self.io, self.log_dir, start, end, stats)
        self.body_span = max(self.body_span, found.body_span)
        for pos in found.to_mark:
            self._mark_if_present(pos)
            stats.marks += 1
        self._runners_from(cp, first)
        self._check_sealed(min(r.pos for r in self.runners), last)
        for open_attempt in sorted(found.unfinished.values(), key=lambda a: a.start_pos):
            self._close_recovered(open_attempt, found.replaced)
        try:
            self.commit()
        except DiskFull as exc:
            # Safe to go on: what waits is only replacement envelopes and FINISH records (and garbage
            # marks), which need no fsync of their own; a crash before they are written recovers the
            # same attempts again. Runners see them once written (docs/design.md, "A full disk").
            log.warning("recovered %s on a full disk (%s): %d bytes of replacement envelopes and FINISH records "
                        "wait in memory until there is room", self.path, exc, self.writer.pending_bytes)
        stats.seconds = self._now() - t0
        log.info("recovered %s: %s; read %d records, %d bytes; %d in flight, %d in doubt",
                 self.path, recovery.describe(cp), stats.records_read, stats.bytes_read, stats.in_flight,
                 stats.in_doubt)
        if not self.reserve.ensure():
            log.warning("%s: no room for the spool's %d-byte reserve yet", self.path, self.reserve.size)
        if self.writer.full is not None:
            return
        # Not needed for correctness (the old checkpoint stays valid: positions may lag, never lead),
        # but after a crash it bounds the next start's scan to what is in flight then, instead of
        # rescanning this suffix at every start of a crash loop. After a clean stop it is identical
        # to the stored one, and checkpoint_write skips it.
        try:
            self.checkpoint()
        except (DiskFull, CheckpointFailed) as exc:
            log.warning("%s: checkpoint after recovery not written (%s); the previous one stands", self.path, exc)

    def _check_sealed(self, start: int, last: int) -> None:
        """Every sealed segment the runners will still read is as long as its successor says.

        One header read per segment: a truncated segment is reported at open,
        not discovered by a runner later.
        """
        for seg in range(pos_segment(start), last):
            path = segment_path(self.log_dir, seg)
            fd = self.io.open_read(path)
            try:
                size = self.io.size(fd)
            finally:
                self.io.close(fd)
            check_sealed_size(self.io, self.log_dir, seg, size)

    def _drop_empty_last_segment(self, ids: list[int], cp: ckpt.Checkpoint | None) -> int:
        """A crash while creating a segment can leave it without its header: then it held nothing.

        A segment's header is written with its first records and synced before
        anything in it is acknowledged, and a torn write keeps a prefix of what
        was written, so a segment whose first sector is gone is empty or all
        zeros, and nothing in it was ever promised to anyone.
        """
        last = ids[-1]
        path = segment_path(self.log_dir, last)
        fd = self.io.open_read(path)
        try:
            size = self.io.size(fd)
            head = self.io.read(fd, SEGMENT_HEADER_SIZE, 0)
            empty = size < SEGMENT_HEADER_SIZE or (head.count(0) == len(head) and self._all_zero(fd, size))
        finally:
            self.io.close(fd)
        if not empty or (len(ids) == 1 and cp is not None):
            return last
        log.warning("removing segment %s left half-created by a crash", path)
        self.recovery_stats.tail_cut_bytes += size
        self.io.unlink(path)
        self.io.fsync_dir(self.log_dir)
        ids.pop()
        if not ids:
            self._create_first_segment()
            ids.append(1)
        return ids[-1]

    def _all_zero(self, fd: int, size: int) -> bool:
        off = 0
        while off < size:
            chunk = self.io.read(fd, min(1 << 20, size - off), off)
            if not chunk or chunk.count(0) != len(chunk):
                return bool(not chunk)
            off += len(chunk)
        return True

    def _create_first_segment(self) -> None:
        path = segment_path(self.log_dir, 1)
        fd = self.io.open(path, create=True, truncate=True)
        try:
            write_all(self.io, fd, encode_segment_header(1, int(self._now())), 0)
            self.io.fsync(fd)
        finally:
            self.io.close(fd)
        self.io.fsync_dir(self.log_dir)

    def _runners_from(self, cp: ckpt.Checkpoint | None, first: int) -> None:
        origin = make_pos(first, SEGMENT_HEADER_SIZE)
        n = self.config.classes
        for k in range(n):
            pos = cp.runners[k] if cp is not None and k < len(cp.runners) else (
                min(cp.runners) if cp is not None and cp.runners else origin)
            pos = max(pos, origin)
            self.runners.append(Runner(self.io, self.log_dir, k, self.config.interval(k), pos,
                                       sweeper=k == n - 1))

    def _mark_if_present(self, pos: int) -> None:
        try:
            self.writer.mark_now(pos)
        except FileNotFoundError:
            pass  # its segment was already reclaimed: nothing left to mark

    def _close_recovered(self, attempt: recovery.OpenAttempt, replaced: dict[int, int]) -> None:
        stats = self.recovery_stats
        stats.in_flight += 1
        env_pos = attempt.start.envelope
        env = self._read_envelope(env_pos)
        if env_pos in replaced:
            self._append(RecordType.FINISH, Finish(attempt.start_pos, self._now_ms(), replaced[env_pos]))
            return
        doubt = recovery.in_doubt_recipients(env, attempt)
        remaining = recovery.remaining_recipients(env, attempt)
        if doubt:
            recovery.report_in_doubt(self.queue_id(env.message_id), doubt)
            stats.in_doubt += len(doubt)
        replacement = None
        if remaining:
            klass = self._read_class(env_pos)
            replacement = self._write_replacement(env, env_pos, klass, remaining, attempts=env.attempts,
                                                  in_doubt=tuple(dict.fromkeys(env.in_doubt + tuple(doubt))))
            stats.replacements += 1
        fin = self._append(RecordType.FINISH, Finish(attempt.start_pos, self._now_ms(), replacement))
        self._settling.append((fin, attempt.start_pos, min((env_pos, *env.body))))

    # -- reading --------------------------------------------------------------

    def _read_envelope(self, pos: int) -> Envelope:
        frame = self.writer.read_frame(pos)
        if frame.rtype != RecordType.ENVELOPE:
            raise CorruptRecord(f"expected an envelope at position {pos}", segment_path(
                self.log_dir, pos_segment(pos)), pos & 0xFFFFFFFF)
        env = decode_payload(frame.rtype, frame.payload)
        assert isinstance(env, Envelope)
        return env

    def _read_class(self, pos: int) -> int:
        return self.writer.read_frame(pos).klass

    def read_body(self, envelope: Envelope) -> Iterator[bytes]:
        """The message data, chunk by chunk, each checked against its checksum (or from the body cache)."""
        cached = self.cached_body(envelope)
        if cached is not None:
            yield from cached
            return
        for pos in envelope.body:
            yield self.read_chunk(pos)

    def cached_body(self, envelope: Envelope) -> tuple[bytes, ...] | None:
        return self.body_cache.get(envelope.body[0]) if envelope.body else None

    def read_chunk(self, pos: int) -> bytes:
        """One DATA record's payload. Blocking: the trio layer calls it in a worker thread for big bodies."""
        frame = self.writer.read_frame(pos)
        if frame.rtype != RecordType.DATA:
            raise CorruptRecord(f"expected message data at position {pos}")
        return frame.payload

    # -- appending --------------------------------------------------------------

    def _append(self, rtype: RecordType, payload: Any, klass: int = 0) -> int:
        data = payload if isinstance(payload, bytes) else payload.to_payload()
        return self.writer.append(rtype, data, klass=klass, now=self._now())

    def _maybe_flush(self) -> None:
        """Write (without sync) once enough is buffered, so big bodies do not pile up in memory.

        At half the threshold: the trio layer lets appends go on while a batch is
        being written, and bounds the two together by ``flush_threshold``
        (``AsyncSpool.wait_flushed``), so reading and writing overlap.
        """
        if self.writer.pending_bytes >= self.config.flush_threshold // 2:
            if self.flush_hook is not None:
                self.flush_hook()
            elif self.writer.full is None:
                try:
                    self._write(self.writer.take_batch(sync=False))
                except DiskFull:
                    pass  # kept for the commit, which reports it

    def begin_body(self) -> BodyWriter:
        return BodyWriter(self)

    def _body_chunks(self, body: bytes | BodyWriter | Iterable[bytes]) -> tuple[tuple[int, ...], int]:
        if isinstance(body, BodyWriter):
            writer = body
        else:
            writer = self.begin_body()
            if isinstance(body, bytes | bytearray | memoryview):
                writer.write(body)
            else:
                for part in body:
                    writer.write(part)
        chunks = writer.close()
        self._open_bodies.pop(id(writer), None)
        if writer.kept is not None and chunks:
            self.body_cache.add(chunks[0], tuple(writer.kept), writer.size, self._now())
        return chunks, writer.size

    @property
    def slack(self) -> int:
        """Segments kept behind the garbage-prefix end, for bodies that lie behind their envelopes."""
        return BODY_SLACK + self.body_span

    def _note_span(self, envelope_pos: int, chunks: tuple[int, ...]) -> None:
        if chunks:
            self.body_span = max(self.body_span, pos_segment(envelope_pos) - pos_segment(min(chunks)))

    def _localise(self, chunks: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
        """A replacement's body: shared while it stays close enough, else copied to the head.

        Why copy at all: a deferred message's envelope moves forward at every
        retry while its body would stay; without copying, the body would pin
        ever older segments. Shared when the envelope will lie at most
        BODY_SLACK segments beyond the body's own extent (which is itself
        within ``body_span``), so sharing never widens the slack. The old body
        is durable (its envelope was), so it can be read while a batch is in
        flight. Returns the chunks and whether they were copied.
        """
        if not chunks:
            return chunks, False
        first, last = pos_segment(min(chunks)), pos_segment(max(chunks))
        if self.writer.segment_id + 1 - first <= BODY_SLACK + (last - first):
            return chunks, False
        return tuple(self._append(RecordType.DATA, self.writer.read_frame(p).payload) for p in chunks), True

    def enqueue(self, sender: str, recipients: Iterable[str], body: bytes | BodyWriter | Iterable[bytes], *,
                extra: dict[str, Any] | None = None, arrival_ms: int | None = None) -> int:
        """Append a new message (body then envelope); returns its queue id. Not durable until commit."""
        return self.append_message(sender, recipients, body, extra=extra, arrival_ms=arrival_ms).message_id

    def cancel(self, message: Appended) -> None:
        """Withdraw a message whose commit failed (DiskFull): it must not be delivered once written.

        Its envelope gets the garbage flag (in the buffer, and on disk after the
        next commit); its body is garbage with it. A crash in between can still
        leave it live: the sender was told to try again, so that is a
        duplicate, never a loss.
        """
        self.writer.cancel(message.pos)
        if message.body:
            self.body_cache.drop(message.body[0])

    def append_message(self, sender: str, recipients: Iterable[str], body: bytes | BodyWriter | Iterable[bytes], *,
                       extra: dict[str, Any] | None = None, arrival_ms: int | None = None) -> Appended:
        """``enqueue``, returning what ``cancel`` needs as well as the queue id."""
        rcpts = tuple(recipients)
        if not rcpts:
            raise ValueError("a message needs at least one recipient")
        chunks, size = self._body_chunks(body)
        # The head before the append: unique and monotonic, and the envelope's own
        # position unless the append rotates to a new segment.
        mid = self.writer.head
        env = Envelope(mid, sender, rcpts, chunks, size, arrival_ms if arrival_ms is not None else self._now_ms(),
                       extra=extra or {})
        pos = self._append(RecordType.ENVELOPE, env, 0)
        self._note_span(pos, chunks)
        return Appended(mid, pos, chunks)

    def enqueue_many(self, messages: Iterable[tuple[str, Iterable[str], bytes]]) -> list[int]:
        """The batch API: many messages, one commit (like Nerve's SendPack)."""
        ids = [self.enqueue(s, r, b) for s, r, b in messages]
        self.commit()
        return ids

    def commit(self) -> None:
        """Make everything appended so far durable (one fdatasync).

        Raises DiskFull with everything still appended (the next commit tries
        again); the caller cancels the messages it had hoped to acknowledge.
        """
        if self.writer.has_pending or self.writer.full is not None:
            self._write(self.writer.take_batch())

    def _write(self, batch: Batch) -> None:
        try:
            self.writer.write_batch(batch)
        except DiskFull:
            self.writer.restore(batch)
            raise

    # -- runners ------------------------------------------------------------

    def poll_due(self, now: float | None = None, limit: int | None = None, *,
                 rationed: bool | None = None) -> list[Attempt]:
        """Claim due messages; respects the active limit and (``rationed``) the deferred budget.

        New mail first, up to half the room; then the deferred classes (in
        turn) up to what ``self.budget`` allows while new mail flows (all the
        rest of the room when it does not); then new mail again for what is
        left. The half kept back lets the trickle through even when new mail
        alone would fill every poll.

        ``rationed`` defaults to ``now is None``: polls at the spool's own
        clock (the relay's, through ``next_due``) are budgeted, and may return
        nothing while deferred mail is due (``next_wake`` says when to look
        again). A caller that names its own time (a checker draining the queue
        at a simulated instant) gets everything due, as before the budget.
        """
        if rationed is None:
            rationed = now is None
        now = self._now() if now is None else now
        room = self.config.active_limit - len(self.attempts)
        if limit is not None:
            room = min(room, limit)
        out: list[Attempt] = []
        if room <= 0:
            return out
        budget = self.budget if rationed else None
        self._take(0, (room + 1) // 2, now, out)
        if budget is not None:
            budget.note_new(len(out), now)
        deferred = list(range(1, len(self.runners)))
        if deferred:
            allowed = budget.allowance(now) if budget is not None else None
            cap = room if allowed is None else len(out) + min(allowed, room - len(out))
            rot = self._rr % len(deferred)
            self._rr += 1
            before = len(out)
            for k in deferred[rot:] + deferred[:rot]:
                self._take(k, cap - len(out), now, out)
            if budget is not None:
                budget.spend(len(out) - before)
        before = len(out)
        self._take(0, room - len(out), now, out)
        if budget is not None:
            budget.note_new(len(out) - before, now)
        return out

    def _take(self, klass: int, count: int, now: float, out: list[Attempt]) -> None:
        if count <= 0:
            return
        runner = self.runners[klass]
        for cand in runner.scan(self.writer, now, count, self.by_envelope):
            if self._gone(cand.pos):
                continue
            if cand.klass == HELD_CLASS:
                self._carry_held(cand)
                continue
            out.append(self._claim(cand, now))

    def _gone(self, pos: int) -> bool:
        """Was the envelope claimed since the runner read it into its window?

        A runner reads ahead in 1 MiB windows; a garbage mark written after that
        (an admin change, an attempt that ended) is only on disk, or still
        waiting for its START's sync. One small read per candidate settles it.
        """
        return self.writer.mark_pending(pos) or self.writer.read_flags(pos) & GARBAGE != 0

    def _claim(self, cand: Candidate, now: float, kind: StartKind = StartKind.DELIVERY) -> Attempt:
        env = decode_payload(RecordType.ENVELOPE, cand.payload)
        assert isinstance(env, Envelope)
        start = self._append(RecordType.START, Start(cand.pos, int(now * 1000), kind))
        self.writer.mark_after_sync(cand.pos)
        expired = (kind is StartKind.DELIVERY
                   and now * 1000 - env.arrival_ms >= self.config.max_queue_lifetime * 1000)
        attempt = Attempt(start, cand.pos, env, cand.klass, kind, expired)
        self.attempts[start] = attempt
        self.by_envelope[cand.pos] = attempt
        return attempt

    def _carry_held(self, cand: Candidate) -> None:
        attempt = self._claim(cand, self._now(), StartKind.CARRY)
        self._end(attempt, self._write_replacement(attempt.envelope, attempt.envelope_pos, HELD_CLASS,
                                                   attempt.remaining,
                                                   attempts=attempt.envelope.attempts, held=True))

    def next_wake(self) -> float | None:
        """Earliest time a runner may find something new (None: only new appends wake them).

        Now, if a runner stopped at its limit with more perhaps due; but a
        deferred runner waits for the budget to allow a claim, so that a caller
        that polls at this time does not spin while the budget says no.
        """
        now = self._now()
        gate = self.budget.next_allowed(now)
        times = []
        for r in self.runners:
            t = now if r.has_more else r.wake_at
            if t is not None:
                times.append(t if r.klass == 0 else max(t, gate))
        return min(times) if times else None

    def queue_id(self, message_id: int) -> str:
        """The id an operator sees for a message of this spool (hex, plus ``config.id_suffix``)."""
        return format_id(message_id) + self.config.id_suffix

    @property
    def has_room(self) -> bool:
        """May another message be claimed, under ``active_limit``?"""
        return len(self.attempts) < self.config.active_limit

    def record_delivery(self, attempt: Attempt, outcomes: Iterable[Outcome], duration_ms: int = 0) -> int:
        """Append a DELIVERY delta. The caller must commit before the message's next step."""
        outs = tuple(outcomes)
        for o in outs:
            if o.recipient not in attempt.envelope.recipients:
                raise ValueError(f"{o.recipient!r} is not a recipient of this attempt")
            attempt.outcomes[o.recipient] = o
        return self._append(RecordType.DELIVERY, Delivery(attempt.start_pos, self._now_ms(), outs, duration_ms))

    def finish(self, attempt: Attempt, *, next_class: int | None = None,
               extra: dict[str, Any] | None = None) -> int | None:
        """End an attempt: recipients without a final outcome go on in a replacement envelope.

        Returns the replacement's position, or None when the message is done.
        """
        if attempt.start_pos not in self.attempts:
            raise SpoolError("attempt already finished")
        remaining = attempt.remaining
        replacement = None
        if remaining:
            klass = self.config.next_class(attempt.klass) if next_class is None else next_class
            merged = {**attempt.envelope.extra, **(extra or {})}
            replacement = self._write_replacement(attempt.envelope, attempt.envelope_pos, klass, remaining,
                                                  attempts=attempt.envelope.attempts + 1, extra=merged)
        self._end(attempt, replacement)
        return replacement

    def _end(self, attempt: Attempt, replacement: int | None) -> None:
        fin = self._append(RecordType.FINISH, Finish(attempt.start_pos, self._now_ms(), replacement))
        self._settling.append((fin, attempt.start_pos, min((attempt.envelope_pos, *attempt.envelope.body))))
        settled = self.writer.durable_end
        while self._settling and self._settling[0][0] < settled:
            self._settling.popleft()
        if attempt.envelope.body:
            self.body_cache.drop(attempt.envelope.body[0])
        del self.attempts[attempt.start_pos]
        del self.by_envelope[attempt.envelope_pos]

    def _write_replacement(self, env: Envelope, env_pos: int, klass: int, recipients: list[str], *, attempts: int,
                           held: bool = False, in_doubt: tuple[str, ...] | None = None,
                           extra: dict[str, Any] | None = None) -> int:
        body, copied = self._localise(env.body)
        keep = set(recipients)
        new = attrs.evolve(
            env, recipients=tuple(recipients), body=body, attempts=attempts,
            replaces=env_pos, held=held,
            in_doubt=tuple(r for r in (env.in_doubt if in_doubt is None else in_doubt) if r in keep),
            extra=env.extra if extra is None else extra)
        pos = self._append(RecordType.ENVELOPE, new, klass)
        if copied:
            self._note_span(pos, body)
        return pos

    # -- admin changes (the listing side lives in spool.admin) -----------------

    def source(self) -> LogWriter:
        return self.writer

    def live_start(self) -> int:
        """Every live envelope lies at or after this position (see spool.admin)."""
        return min([r.pos for r in self.runners] + list(self.by_envelope))

    def active(self) -> dict[int, Attempt]:
        return self.by_envelope

    def claim_for_admin(self, pos: int) -> Attempt:
        """Claim a live envelope for an admin change. Raises MessageBusy while it is being delivered."""
        if pos in self.by_envelope or self.writer.mark_pending(pos):
            raise MessageBusy("the message is being delivered right now; try again when the attempt ends")
        frame = self.writer.read_frame(pos)
        if frame.garbage or frame.rtype != RecordType.ENVELOPE:
            raise MessageBusy("the message changed while we looked; list it again")
        return self._claim(Candidate(pos, frame.klass, frame.time, frame.payload), self._now(), StartKind.ADMIN)

    def admin_replace(self, attempt: Attempt, *, klass: int, held: bool) -> int:
        new = self._write_replacement(attempt.envelope, attempt.envelope_pos, klass,
                                      list(attempt.envelope.recipients),
                                      attempts=attempt.envelope.attempts, held=held)
        self._end(attempt, new)
        return new

    def admin_delete(self, attempt: Attempt, reason: str = "deleted by the administrator") -> None:
        outs = [Outcome(r, Status.DELETED, 0, "", reason, "") for r in attempt.remaining]
        self.record_delivery(attempt, outs)
        self._end(attempt, None)

    def change(self, message_id: int, action: str) -> bool:
        """Offline admin change by queue id: hold, release, delete or flush. Durable on return.

        Returns False when there was nothing to do (already held, not deferred, ...).
        """
        from spool import admin

        msg = admin.find(self, message_id)
        if (action == "hold" and msg.held) or (action == "release" and not msg.held) \
                or (action == "flush" and (msg.held or msg.klass == 0)):
            return False
        attempt = self.claim_for_admin(msg.pos)
        if action == "delete":
            self.admin_delete(attempt)
        elif action == "hold":
            self.admin_replace(attempt, klass=HELD_CLASS, held=True)
        elif action in ("release", "flush"):
            self.admin_replace(attempt, klass=0, held=False)
        else:
            raise ValueError(f"unknown action {action!r}")
        self.commit()
        return True

    # -- checkpoint and reclaiming space --------------------------------------

    def checkpoint_plan(self, *, durable_only: bool = False) -> CheckpointPlan:
        """Snapshot restart positions. Valid once everything appended so far is durable.

        ``durable_only``: valid now, naming only what is already durable; for
        a checkpoint while records wait for room (the disk is full), so that
        segments can still be reclaimed. Its head is the durable end, and
        attempts that ended in memory but whose FINISH is not durable yet
        (``_settling``) count as in flight: if those records are lost,
        recovery must still find their STARTs, envelopes and bodies. Runners
        never pass the durable end.
        """
        if durable_only:
            head = self.writer.durable_end
            while self._settling and self._settling[0][0] < head:
                self._settling.popleft()
            settling = list(self._settling)
        else:
            head, settling = self.writer.head, []
        starts = [a.start_pos for a in self.attempts.values()] + [start for _, start, _ in settling]
        envs = [min((a.envelope_pos, *a.envelope.body)) for a in self.attempts.values()] + [
            first for _, _, first in settling]
        runners = tuple(r.pos for r in self.runners)
        working = min([head, *starts])
        garbage = min([working, *runners, *envs, *self._open_bodies.values()])
        seq = (self._checkpoint.sequence + 1) if self._checkpoint else 1
        return CheckpointPlan(head, ckpt.Checkpoint(head, working, garbage, runners, self._now_ms(), seq,
                                                    self.body_span))

    def checkpoint_write(self, plan: CheckpointPlan) -> list[int]:
        """Sync marks, store the checkpoint, then reclaim segments. Needs durable_end >= plan.head.

        Returns the segment ids deleted or archived.
        """
        if self.writer.durable_end < plan.head:
            raise SpoolError("checkpoint before its head is durable")
        self.writer.sync_all()
        ids = list_segments(self.io, self.log_dir)
        limit = pos_segment(plan.checkpoint.garbage_end) - plan.checkpoint.body_span - BODY_SLACK
        if self._checkpoint is None or not plan.checkpoint.same_restart(self._checkpoint):
            # Two fsyncs (the file, then the directory after the rename). A checkpoint whose
            # positions equal the stored one's would only renew its time and sequence, which
            # nothing reads back: skipped, so an idle spool, and every open after a clean stop,
            # writes none.
            self._store_checkpoint(plan.checkpoint, frees=any(s < limit for s in ids))
        gone = self._delete_segments_before(limit, ids)
        self.reserve.ensure()
        return gone

    def _store_checkpoint(self, cp: ckpt.Checkpoint, *, frees: bool) -> None:
        """Store ``cp``; when it finds no room and would free segments, into the reserve's room.

        Raises DiskFull or CheckpointFailed (the previous checkpoint stands),
        SyncFailed (the writer is poisoned too: crash and recover).
        """
        try:
            try:
                ckpt.store(self.io, self.path, cp)
            except DiskFull:
                if not (frees and self.reserve.held):
                    raise
                self.reserve.release()
                ckpt.store(self.io, self.path, cp)
        except SyncFailed as exc:
            self.writer.poisoned = exc
            raise
        self._checkpoint = cp

    def checkpoint(self) -> list[int]:
        plan = self.checkpoint_plan()
        try:
            self.commit()
        except DiskFull:
            plan = self.checkpoint_plan(durable_only=True)  # while records wait for room: name only what is on disk
        return self.checkpoint_write(plan)

    def _delete_segments_before(self, limit_seg: int, ids: list[int]) -> list[int]:
        gone = [s for s in ids if s < limit_seg]
        if not gone:
            return []
        archive = self.config.archive_dir
        if archive:
            self.io.makedirs(archive)
        done: list[int] = []
        for seg in gone:
            self.writer.forget(seg) if hasattr(self, "writer") else None
            path = segment_path(self.log_dir, seg)
            try:
                if archive:
                    self.io.rename(path, os.path.join(archive, os.path.basename(path)))
                else:
                    self.io.unlink(path)
            except OSError as exc:
                # Not fatal: the segment stays garbage behind a durable checkpoint, and the next
                # checkpoint (or start) deletes it. An archive on a full disk fails here with ENOSPC.
                log.warning("could not %s segment %s: %s; trying again at the next checkpoint",
                            "archive" if archive else "delete", path, exc)
                break
            done.append(seg)
        if not done:
            return done
        try:
            if archive:
                self.io.fsync_dir(archive)
            self.io.fsync_dir(self.log_dir)
        except OSError as exc:
            if hasattr(self, "writer"):
                self.writer.poisoned = exc
            raise SyncFailed(f"directory fsync after deleting segments failed: {exc}; the process must restart "
                             "and recover") from exc
        return done

    @property
    def checkpoint_state(self) -> ckpt.Checkpoint | None:
        return self._checkpoint

    def close(self) -> None:
        """Release descriptors and the lock. Not a shutdown path: nothing is flushed here."""
        for r in self.runners:
            r.close()
        if hasattr(self, "writer"):
            self.writer.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
