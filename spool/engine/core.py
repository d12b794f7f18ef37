"""What one open spool holds, and the one path by which records enter its log.

``spool.engine.spool.Spool`` is made of layers, one module per job, each a class that
builds on this one:

- ``spool.engine.core`` (this module): the state of an open spool; appending records
  and committing them; messages in (``enqueue``, bodies through
  ``spool.write.bodies``) and bodies out; ending an attempt (its FINISH and
  replacement envelope), which the runners' side, the admin changes and
  recovery all do.
- ``spool.engine.claims``: the runners' side: claiming due messages, recording
  outcomes, finishing attempts.
- ``spool.engine.admin_changes``: hold, release, delete, flush.
- ``spool.engine.reclaim``: checkpoints and deleting segments behind them.
- ``spool.engine.recovery``: the open; every open is a recovery.

Durability rules (docs/design.md, "The log", durability rules; Finch):

- a new message's envelope and body are durable before the caller says 250
  (``enqueue`` then ``commit``);
- a DELIVERY record is durable before the message's next step (the caller
  commits after ``record_delivery``);
- START, FINISH, replacement envelopes and garbage marks carry no sync of their
  own: recovery rebuilds them. A START's garbage mark on its envelope is only
  written once the START itself is durable, so a surviving mark always has a
  surviving START to explain it.

Nothing appended is durable until ``commit()`` (or the trio layer's group
commit, ``spool.aio.async_spool``) returns. A commit that finds no room raises DiskFull
and keeps its records for the next try (``spool.write.log``); a message whose commit
failed is cancelled (``cancel``).

Bodies and space: message bodies sit in DATA records before their envelope, as
far back as the body is long (or as the client was slow). The spool records
the longest such reach it has seen (``body_span``, kept in the checkpoint,
never decreasing) and keeps BODY_SLACK + body_span segments behind the
garbage-prefix end (``spool.engine.reclaim``); a replacement envelope shares its body
when that stays within the slack and copies it to the head otherwise
(``_localise``), so deferred mail never pins old segments.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from spool.config.engine import SpoolConfig
from spool.config.fairness import DeferredBudget
from spool.damage.policy import DamagePolicy
from spool.engine.gauges import QueueGauges
from spool.engine.runner import Runner
from spool.errors import CorruptRecord, DamagedBody, DiskFull
from spool.fileio import FileIO
from spool.format import checkpoint as ckpt
from spool.format.record import (
    HELD_CLASS,
    Envelope,
    Finish,
    Outcome,
    RecordType,
    StartKind,
    envelope_payload,
    format_id,
    format_pos,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import list_segments
from spool.read.anomaly import Anomaly, Kind
from spool.read.lost import LogContext
from spool.read.reader import LogReader
from spool.write.bodies import BodyCache, BodyWriter
from spool.write.fresh import FreshEnvelopes
from spool.write.log import Batch, LogWriter
from spool.write.reserve import Reserve

log = logging.getLogger("spool")
BODY_SLACK = 2
LOG_DIR = "log"
# The key of an envelope's ``extra`` that says its data was found damaged (and not carried on): why.
DAMAGED_BODY = "damaged_body"


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


@attrs.frozen
class Appended:
    """A message appended and not yet durable: what ``Spool.cancel`` needs if its commit fails."""

    message_id: int
    pos: int
    body: tuple[int, ...]


class SpoolCore:
    """One spool directory, opened for writing by one process: its state and its append path."""

    def __init__(self, path: str, config: SpoolConfig, io: FileIO) -> None:
        self.path = path
        self.log_dir = os.path.join(path, LOG_DIR)
        self.config = config
        self.io = io
        self.attempts: dict[int, Attempt] = {}
        self.by_envelope: dict[int, Attempt] = {}
        self._open_bodies: dict[int, int] = {}
        self._rr = 0
        self._lock_fd = -1  # spool.engine.spool: the lock taken at open
        self._checkpoint: ckpt.Checkpoint | None = None
        self.writer: LogWriter  # made by open_log, at the end of the log recovery found
        self.runners: list[Runner] = []  # set by recovery, at the checkpoint's positions
        self.flush_hook: Any = None
        # How many segments a live body may lie behind its envelope (see BODY_SLACK); only grows.
        self.body_span = 0
        self.body_cache = BodyCache(config.body_cache)
        # Deferred claims while new mail flows (spool.config.fairness).
        self.budget = DeferredBudget(config.deferred_share)
        self.reserve = Reserve(io, path, min(config.reserve_bytes, config.segment_size))
        # Attempts ended in memory whose FINISH is not durable yet, oldest first: (FINISH position, START
        # position, first position of the envelope and its body). See checkpoint_plan(durable_only=True).
        self._settling: deque[tuple[int, int, int]] = deque()
        self._restore_floor: int | None = None  # restore_message: ids below this position are not this spool's
        # Damage (spool.damage.policy): quarantined, named, gone past. While recovery runs (no writer yet), the
        # finder of lost messages is given recovery's own context instead (Recovery.context).
        self.damage = DamagePolicy(io, path, config.on_damage, self.damage_context)
        # The position of the last ENVELOPE appended (-1: none yet). A batch that becomes durable gives a
        # runner work only if an envelope was appended since the last wake-up (AsyncClaims._signal_change).
        self.envelope_head = -1
        self.fresh = FreshEnvelopes()  # new envelopes until their claim (spool.write.fresh): no decode for the runner
        self.gauges: QueueGauges | None = None  # kept once the relay seeds them (``keep_gauges``)

    def keep_gauges(self, gauges: QueueGauges) -> None:
        """Keep ``gauges`` (seeded from the live log: spool.engine.gauges) as records are appended from now on."""
        self.gauges = gauges

    def _now(self) -> float:
        return self.config.clock()

    def _now_ms(self) -> int:
        return int(self._now() * 1000)

    def open_log(self, segment: int, offset: int, now: float) -> None:
        """Begin appending at ``offset`` of ``segment``, the end of the log that recovery found and synced.

        Why here and not in recovery: the writer is this spool's, for as long
        as it is open; recovery only says where the log ends. Everything up to
        there is durable, so readers may see all of it at once.
        """
        self.writer = LogWriter(self.io, self.log_dir, self.config.segment_size, segment, offset, int(now))
        self.writer.on_damage = self.damage.reporter("a runner")
        self.writer.publish_durable()

    def _next_position(self) -> int:
        """The log head: the position the next record appended will get, unless it opens a new segment."""
        return self.writer.head

    @property
    def head(self) -> int:
        """The log head: every record appended from now on lies at or after this position."""
        return self.writer.head

    def queue_id(self, message_id: int) -> str:
        """The id an operator sees for a message of this spool (hex, plus ``config.id_suffix``)."""
        return format_id(message_id) + self.config.id_suffix

    # -- the append path -----------------------------------------------------------------------

    def _append(self, rtype: RecordType, payload: Any, klass: int = 0) -> int:
        data = payload if isinstance(payload, bytes) else payload.to_payload()
        pos = self.writer.append(rtype, data, klass=klass, now=self._now())
        if rtype == RecordType.ENVELOPE:
            self.envelope_head = pos
            if self.gauges is not None and isinstance(payload, Envelope):
                self.gauges.added(payload.message_id, klass, payload.held, bool(payload.in_doubt),
                                  payload.arrival_ms)
        return pos

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

    # -- messages in ---------------------------------------------------------------------------

    def enqueue(self, sender: str, recipients: Iterable[str], body: bytes | BodyWriter | Iterable[bytes], *,
                extra: dict[str, Any] | None = None, arrival_ms: int | None = None) -> int:
        """Append a new message (body then envelope); returns its queue id. Not durable until commit."""
        return self.append_message(sender, recipients, body, extra=extra, arrival_ms=arrival_ms).message_id

    def append_message(self, sender: str, recipients: Iterable[str], body: bytes | BodyWriter | Iterable[bytes], *,
                       extra: dict[str, Any] | None = None, arrival_ms: int | None = None,
                       held: bool = False) -> Appended:
        """``enqueue``, returning what ``cancel`` needs as well as the queue id.

        ``held``: the message is held from its first envelope (a mail filter's
        quarantine): no runner takes it until it is released, and no delivery
        can start between its commit and a hold.
        """
        rcpts = tuple(recipients)
        if not rcpts:
            raise ValueError("a message needs at least one recipient")
        chunks, size = self._body_chunks(body)
        # The head as the message is given its id: unique and increasing (docs/design.md, "Queue ids").
        # Here, the head before the envelope's append (its own position unless the append opens a new
        # segment); or the id the body took when it began (BodyWriter.begin).
        reserved = body.message_id if isinstance(body, BodyWriter) else None
        mid = reserved if reserved is not None else self.writer.head
        # Encoded from the fields: no Envelope record is built for an envelope that is never read back here.
        now = self._now()
        arrival = arrival_ms if arrival_ms is not None else int(now * 1000)
        klass = HELD_CLASS if held else 0
        payload = envelope_payload(mid, sender, rcpts, chunks, size, arrival, held=held, extra=extra)
        pos = self.writer.append(RecordType.ENVELOPE, payload, klass=klass, now=now)
        self.envelope_head = pos
        if self.gauges is not None:
            self.gauges.added(mid, klass, held, False, arrival)
        if not held:
            self.fresh.add(pos, payload, mid, sender, rcpts, chunks, size, arrival, extra)
        self._note_span(pos, chunks)
        return Appended(mid, pos, chunks)

    def restore_message(self, envelope: Envelope, klass: int, body: bytes | Iterable[bytes]) -> Appended:
        """Append a message carried over from another spool, under its own queue id (``spoolctl salvage``).

        ``envelope`` is kept whole (sender, recipients, arrival, attempts, held,
        in doubt, extra) but for its body, written here, and ``replaces``,
        dropped: it named a position of the other spool. It goes to runner class
        ``klass`` with the spool clock's time, so the caller keeps a deferred
        message's next retry by setting the clock to when its envelope was
        appended. Not durable until commit.

        Raises ValueError for a ``message_id`` at or past this log's first
        segment: ids this spool hands out are positions in it, so only an id
        below it can never meet one of them (``Spool.create(first_segment=)``).
        """
        if self._restore_floor is None:
            self._restore_floor = make_pos(min(list_segments(self.io, self.log_dir), default=1), 0)
        if envelope.message_id >= self._restore_floor:
            raise ValueError(f"queue id {format_id(envelope.message_id)} could be one of this spool's own; "
                             "create the spool past it (Spool.create(first_segment=...))")
        chunks, size = self._body_chunks(body)
        env = attrs.evolve(envelope, body=chunks, body_size=size, replaces=None)
        pos = self._append(RecordType.ENVELOPE, env, klass)
        self._note_span(pos, chunks)
        return Appended(env.message_id, pos, chunks)

    def cancel(self, message: Appended) -> None:
        """Withdraw a message whose commit failed (DiskFull): it must not be delivered once written.

        Its envelope gets the garbage flag (in the buffer, and on disk after the
        next commit); its body is garbage with it. A crash in between can still
        leave it live: the sender was told to try again, so that is a
        duplicate, never a loss.
        """
        self.writer.cancel(message.pos)
        if self.gauges is not None:
            self.gauges.claimed(0, False, False)
            self.gauges.gone(message.message_id)
        if message.body:
            self.body_cache.drop(message.body[0])

    def enqueue_many(self, messages: Iterable[tuple[str, Iterable[str], bytes]]) -> list[int]:
        """The batch API: many messages, one commit (like Nerve's SendPack)."""
        ids = [self.enqueue(s, r, b) for s, r, b in messages]
        self.commit()
        return ids

    def begin_body(self, first: Callable[[int], bytes] | None = None) -> BodyWriter:
        """A body to stream into; with ``first``, the message's id is decided now (``BodyWriter.begin``)."""
        writer = BodyWriter(self)
        if first is not None:
            writer.begin(first)
        return writer

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

    # -- bodies out, and how far back they reach -----------------------------------------------

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
        """One DATA record's payload. Blocking: the trio layer calls it in a worker thread for big bodies.

        Raises DamagedBody when it cannot be read: the damage is quarantined and named first.
        """
        try:
            frame = self.writer.read_frame(pos)
        except (CorruptRecord, FileNotFoundError) as exc:
            raise self._damaged_body(pos, getattr(exc, "reason", None) or str(exc)) from None
        if frame.rtype != RecordType.DATA:
            raise self._damaged_body(pos, f"a {RecordType(frame.rtype).name} record lies where message data "
                                          "should be")
        return frame.payload

    def _damaged_body(self, pos: int, reason: str) -> DamagedBody:
        anomaly = self.anomaly_at(pos, reason)
        self.damage.report(anomaly, "a read of message data")
        self.damage.body_damaged()
        return DamagedBody(f"the message data at {format_pos(pos)} is damaged: {anomaly.message()}",
                           anomaly.path, anomaly.offset)

    def anomaly_at(self, pos: int, reason: str) -> Anomaly:
        """The anomaly that covers the record at ``pos``, which a read of that one record found damaged.

        Named as the log reader names it (so it is quarantined and recognised
        once, whoever meets it): the verifying walk of its segment, or the
        segment's absence.
        """
        seg, off = pos_segment(pos), pos_offset(pos)
        reader = LogReader(self.io, self.log_dir)
        durable = self.writer.durable_end if hasattr(self, "writer") else None
        try:
            size = reader.size(seg)
        except FileNotFoundError:
            return Anomaly(Kind.MISSING_SEGMENT, seg, reader.path(seg), 0, 0,
                           f"segment {seg} is missing; it held the record at {format_pos(pos)}")
        end = pos_offset(durable) if durable is not None and pos_segment(durable) == seg else size
        return reader.classify_at(seg, off, max(end, min(size, off + 1)), reason)

    def damage_context(self) -> LogContext | None:
        """What the finder of lost messages needs now (``spool.read.lost``): how far to read, the oldest runner,
        the envelopes in flight. None before the log has a writer (recovery gives its own: ``Recovery.context``)."""
        return self.log_context(self.writer.durable_end) if hasattr(self, "writer") else None

    def log_context(self, end: int) -> LogContext:
        """What the finder of lost messages needs when the log is known to reach ``end``."""
        cp = self._checkpoint
        runners = [r.pos for r in self.runners] or (list(cp.runners) if cp is not None else [])
        live_from = min(runners) if runners else 0
        return LogContext(LogReader(self.io, self.log_dir, durable=end), end, live_from,
                          frozenset(self.by_envelope), BODY_SLACK + self.body_span, self.queue_id,
                          cp.working_start if cp is not None else 0)

    @property
    def slack(self) -> int:
        """Segments kept behind the garbage-prefix end, for bodies that lie behind their envelopes."""
        return BODY_SLACK + self.body_span

    def start_from(self, cp: ckpt.Checkpoint | None) -> None:
        """The checkpoint recovery read (None: none, or damaged): its positions, and how far back bodies reach."""
        self._checkpoint = cp
        if cp is not None:
            self.body_span = cp.body_span

    def bodies_reach(self, span: int) -> None:
        """Bodies were found lying ``span`` segments behind their envelopes (recovery's scan); the reach only grows."""
        self.body_span = max(self.body_span, span)

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
        return tuple(self._append(RecordType.DATA, self.read_chunk(p)) for p in chunks), True

    # -- ending an attempt ---------------------------------------------------------------------

    def _end(self, attempt: Attempt, replacement: int | None) -> None:
        """Append the attempt's FINISH (no sync of its own: recovery rebuilds a lost one) and forget it.

        Until the FINISH is durable the attempt is *settling*: a checkpoint of
        what is durable still counts it as in flight (``Reclaim.checkpoint_plan``).
        """
        fin = self._append(RecordType.FINISH, Finish(attempt.start_pos, self._now_ms(), replacement))
        self._settling.append((fin, attempt.start_pos, min((attempt.envelope_pos, *attempt.envelope.body))))
        settled = self.writer.durable_end
        while self._settling and self._settling[0][0] < settled:
            self._settling.popleft()
        if attempt.envelope.body:
            self.body_cache.drop(attempt.envelope.body[0])
        del self.attempts[attempt.start_pos]
        del self.by_envelope[attempt.envelope_pos]
        if replacement is None and self.gauges is not None:
            self.gauges.gone(attempt.message_id)

    def _write_replacement(self, env: Envelope, env_pos: int, klass: int, recipients: list[str], *, attempts: int,
                           held: bool = False, in_doubt: tuple[str, ...] | None = None,
                           extra: dict[str, Any] | None = None) -> int:
        """Append the envelope that replaces ``env`` (at ``env_pos``) for ``recipients``, in class ``klass``.

        Its body is shared or copied forward (``_localise``); ``in_doubt`` keeps
        only recipients that go on. Written by a finished delivery, an admin
        change, the sweeper carrying a held message, and recovery.
        """
        try:
            body, copied = self._localise(env.body)
        except DamagedBody as exc:
            # Its data cannot be copied (quarantined and named by now): the replacement carries no body and
            # says why, and the relay bounces or holds the message when it comes due. Chunks copied before
            # the damage are garbage with their segment.
            body, copied = (), False
            extra = {**(env.extra if extra is None else extra), DAMAGED_BODY: exc.reason}
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
