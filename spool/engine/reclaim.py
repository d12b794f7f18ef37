"""Checkpoints and reclaiming space: restart positions, and deleting the segments behind them.

A checkpoint (format: ``spool.format.checkpoint``; docs/format.md, "Checkpoint")
names where recovery starts: the head, the start of the working suffix (the
oldest START without a FINISH), the garbage-prefix end (no live envelope,
in-flight envelope or body before it) and every runner's position. It is
stored only once everything before its head is durable, and positions may lag
the truth, never lead it.

A segment is deleted (or moved to ``archive_dir``) only behind a durable
checkpoint, and only when it lies more than BODY_SLACK + body_span segments
behind the garbage-prefix end (bodies lie before their envelopes; see
``spool.engine.core``). A failed deletion is retried at the next checkpoint.

A full disk (docs/design.md, "A full disk"): while records wait for room a
checkpoint names only what is durable (``checkpoint_plan(durable_only=True)``),
and a checkpoint that would free segments may use the reserve's room
(``spool.write.reserve``), so a spool stalled on its own garbage can still delete it.
"""

from __future__ import annotations

import logging
import os

import attrs

from spool.config.engine import SpoolConfig
from spool.engine.core import BODY_SLACK, SpoolCore
from spool.errors import DiskFull, SpoolError, SyncFailed
from spool.fileio import FileIO
from spool.format import checkpoint as ckpt
from spool.format.cursor import list_cursors
from spool.format.marks import marks_dir
from spool.format.record import pos_segment
from spool.format.segment import list_segments, segment_path, segment_size
from spool.read.marks import MarksCollector

log = logging.getLogger("spool")


@attrs.frozen
class CheckpointPlan:
    head: int
    checkpoint: ckpt.Checkpoint


class Reclaim(SpoolCore):
    """Restart positions and segment deletion."""

    def __init__(self, path: str, config: SpoolConfig, io: FileIO) -> None:
        super().__init__(path, config, io)
        self._marks_collector = MarksCollector(marks_dir(path))  # the workers' marks files (_collect_marks)

    def checkpoint_plan(self, *, durable_only: bool = False) -> CheckpointPlan:
        """Snapshot restart positions. Valid once everything appended so far is durable.

        ``durable_only``: valid now, naming only what is already durable; for
        a checkpoint while records wait for room (the disk is full), so that
        segments can still be reclaimed. Its head is the durable end, and
        attempts that ended in memory but whose FINISH is not durable yet
        (``_settling``) count as in flight: if those records are lost,
        recovery must still find their STARTs, envelopes and bodies. Runners
        never pass the durable end, but they have passed the envelopes they
        claimed: a runner is named no further than the envelope of an attempt
        whose START is not durable (lost with the START, that message must be
        found again).
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
        if durable_only:
            # A runner has passed every envelope it claimed, but a claim whose START is not durable is lost
            # with it, and recovery must find that envelope again: no runner is named past it.
            unclaimed = [a.envelope_pos for a in self.attempts.values() if a.start_pos >= head] + [
                first for _, start, first in settling if start >= head]
            if unclaimed:
                runners = tuple(min(pos, *unclaimed) for pos in runners)
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
        limit = self._cursor_limit(ids, pos_segment(plan.checkpoint.garbage_end) - plan.checkpoint.body_span
                                   - BODY_SLACK)
        if self._checkpoint is None or not plan.checkpoint.same_restart(self._checkpoint):
            # Two fsyncs (the file, then the directory after the rename). A checkpoint whose
            # positions equal the stored one's would only renew its time and sequence, which
            # nothing reads back: skipped, so an idle spool, and every open after a clean stop,
            # writes none.
            self._store_checkpoint(plan.checkpoint, frees=any(s < limit for s in ids))
        gone = self._delete_segments_before(limit, ids)
        self.reserve.ensure()
        if self._checkpoint is not None:
            self._collect_marks(self._checkpoint.working_start)
        return gone

    def _collect_marks(self, working_start: int) -> None:
        """Delete the delivery workers' closed marks files that only name attempts before ``working_start`` of
        the durable checkpoint: recovery begins there, so it would never look for them."""
        try:
            self._marks_collector.collect(working_start)
        except OSError as exc:  # the files stay, collected after a later checkpoint
            log.warning("%s: marks files not collected: %s", self.path, exc)

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

    def _cursor_limit(self, ids: list[int], limit: int) -> int:
        """``limit`` lowered to the oldest segment an event consumer's cursor has not read past
        (``spool.format.cursor``), keeping at most ``cursor_pin_max`` bytes of segments (the newest).

        Why a cap: a consumer that is gone for good must not fill the disk;
        past the cap its segments go where reclaimed segments go (the archive,
        where it can still read them), and it is told it lags.
        """
        cap = self.config.cursor_pin_max
        if cap <= 0 or not any(s < limit for s in ids):
            return limit
        cursors = [p for p in list_cursors(self.io, self.path).values() if p is not None]
        if not cursors:
            return limit
        need = min(pos_segment(p) for p in cursors)
        kept, total = limit, 0
        for seg in sorted((s for s in ids if need <= s < limit), reverse=True):
            total += segment_size(self.io, self.log_dir, seg)
            if total > cap:
                break
            kept = seg
        return kept

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
