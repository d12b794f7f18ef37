"""The synchronous spool: one spool directory, opened (= recovered) for writing by one process.

This is the engine without an event loop, used directly by the CLI, tests and
benchmarks, and wrapped by ``spool.aio.async_spool.AsyncSpool`` for the relay. Nothing
here is durable until ``commit()`` (or the async layer's group commit)
returns; the durability rules are in ``spool.engine.core``.

``Spool`` is made of layers, one module per job (each builds on ``SpoolCore``):

- ``spool.engine.core``: the state of an open spool, appending and committing,
  messages in and bodies out, ending an attempt;
- ``spool.engine.claims``: the runners' side: claims, outcomes, finish;
- ``spool.engine.admin_changes``: hold, release, delete, flush;
- ``spool.engine.reclaim``: checkpoints, and deleting the segments behind them;
- ``spool.engine.recovery``: what ``open`` does after taking the lock.

This module opens and closes: the directory, the lock, segments cut to a
small filesystem (``spool.config.engine.fit_to_filesystem``, with the reserve,
``spool.write.reserve``), and recovery. There is no shutdown path: ``close`` only
releases descriptors and the lock.
"""

from __future__ import annotations

import fcntl
import logging
import os

from spool.config.engine import SpoolConfig, fit_to_filesystem
from spool.engine import recovery
from spool.engine.admin_changes import AdminChanges
from spool.engine.core import BODY_SLACK, LOG_DIR, Appended, Attempt
from spool.engine.reclaim import CheckpointPlan, Reclaim
from spool.errors import SpoolError, SpoolLocked
from spool.fileio import FileIO, OsFileIO, write_all
from spool.format import checkpoint as ckpt
from spool.format.segment import encode_segment_header, list_segments, segment_path
from spool.read.reader import Reporter
from spool.write.bodies import BodyCache, BodyWriter
from spool.write.reserve import Reserve

log = logging.getLogger("spool")

__all__ = ["BODY_SLACK", "LOG_DIR", "Appended", "Attempt", "BodyCache", "BodyWriter", "CheckpointPlan", "Spool"]


class Spool(AdminChanges, Reclaim):
    """One spool directory, opened for writing by one process."""

    recovery_stats: recovery.RecoveryStats  # what the open's recovery read and did

    @classmethod
    def open(cls, path: str, config: SpoolConfig | None = None, io: FileIO | None = None,
             *, lock: bool = True, on_damage: Reporter | None = None) -> Spool:
        """Open (creating if needed) and recover. Raises SpoolLocked, DamageRefused, FormatVersionError, ...

        Damage in the log goes to the spool's damage policy (``spool.damage.policy``), as
        ``config.on_damage`` says: quarantined, named, and gone past (the default), or refused.
        ``on_damage``: a reporter that recovery hands its anomalies to instead (tests).
        """
        sp = cls(path, config or SpoolConfig(), io or OsFileIO())
        sp.io.makedirs(sp.log_dir)
        sp._fit_to_filesystem()
        if lock:
            sp._take_lock()
        try:
            sp.recovery_stats = recovery.recover(sp, on_damage)
        except BaseException:
            sp.close()
            raise
        return sp

    @classmethod
    def create(cls, path: str, config: SpoolConfig | None = None, io: FileIO | None = None, *,
               first_segment: int = 1) -> Spool:
        """A new spool whose log begins at segment ``first_segment``, opened (and locked) for writing.

        Why a first segment other than 1: positions, hence the queue ids of the
        messages this spool accepts, begin there. ``spool.tools.salvage`` copies
        messages from another spool under their old queue ids, which are
        positions of that spool; a log that begins past all of them never hands
        one of those ids out again (docs/design.md, "Salvage").

        Raises SpoolError if ``path`` already holds a spool (a segment or a checkpoint), SpoolLocked.
        """
        if first_segment < 1:
            raise ValueError("segment ids begin at 1")
        sp = cls(path, config or SpoolConfig(), io or OsFileIO())
        sp.io.makedirs(sp.log_dir)
        sp._fit_to_filesystem()
        sp._take_lock()
        try:
            if list_segments(sp.io, sp.log_dir) or sp.io.exists(os.path.join(path, ckpt.NAME)):
                raise SpoolError(f"{path}: a spool is there already")
            fd = sp.io.open(segment_path(sp.log_dir, first_segment), create=True, truncate=True)
            try:
                write_all(sp.io, fd, encode_segment_header(first_segment, int(sp._now())), 0)
                sp.io.fsync(fd)
            finally:
                sp.io.close(fd)
            sp.io.fsync_dir(sp.log_dir)
            sp.recovery_stats = recovery.recover(sp)
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
        """Cut segments (and the reserve) to a small filesystem, and say so (spool.config.engine.fit_to_filesystem)."""
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

    def close(self) -> None:
        """Release descriptors and the lock. Not a shutdown path: nothing is flushed here."""
        for r in self.runners:
            r.close()
        if hasattr(self, "writer"):
            self.writer.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
