"""The engine's tunables, with the defaults an operator would expect."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import attrs

from spool.record import HELD_CLASS

MIB = 1024 * 1024
# A position keeps a segment offset in 32 bits, and a record that does not fit the rest of a segment
# starts one of its own (up to MAX_PAYLOAD past segment_size): 1 GiB leaves ample room below 4 GiB.
MIN_SEGMENT_SIZE = 4096
MAX_SEGMENT_SIZE = 1 << 30


def _intervals(value: tuple[float, ...]) -> tuple[float, ...]:
    value = tuple(float(v) for v in value)
    if not value:
        raise ValueError("retry_intervals needs at least one deferred class")
    if len(value) >= HELD_CLASS:
        raise ValueError(f"at most {HELD_CLASS - 1} deferred classes")
    if any(v <= 0 for v in value):
        raise ValueError("retry intervals must be positive")
    if any(b < a for a, b in itertools.pairwise(value)):
        raise ValueError("retry intervals must not decrease: the last class sweeps the log")
    return value


@attrs.frozen
class SpoolConfig:
    """Engine settings.

    ``retry_intervals`` are the deferred runner classes 1..N (class 0 is new
    mail, due at once). A runner of class k trails the head of the log by its
    interval; the last class is also the sweeper that carries held messages
    forward so that the log behind it can be reclaimed.
    """

    segment_size: int = 64 * MIB
    retry_intervals: tuple[float, ...] = attrs.field(default=(60.0, 300.0, 900.0, 1800.0, 3600.0),
                                                     converter=_intervals)
    max_queue_lifetime: float = 5 * 86400.0
    active_limit: int = 10_000
    archive_dir: str | None = None
    body_chunk: int = 256 * 1024
    # Message data held in memory before it is written (not synced): a write is asked for at half of
    # this, and a receiver stops reading while this much is pending or being written.
    flush_threshold: int = 4 * MIB
    # Checkpoints: looked at every ``checkpoint_interval`` seconds and written if anything moved and either
    # the log was quiet for that interval, or ``checkpoint_bytes`` were appended since the last one, or
    # ``checkpoint_max_interval`` passed. A checkpoint costs three fsyncs; under load the byte bound, not the
    # clock, paces them (recovery scans at most about that much more). checkpoint_bytes 0: every interval.
    checkpoint_interval: float = 2.0
    checkpoint_bytes: int = 16 * MIB
    checkpoint_max_interval: float = 60.0
    # Records nobody waits for (FINISH, replacement envelopes) ride with the next commit, or are
    # committed this many seconds after they were appended if no commit comes sooner.
    lazy_commit_delay: float = 0.1
    # Group-commit window: a commit someone waits for is cut once every commit announced as coming has
    # arrived (SMTP sessions between an accepted RCPT and the end of their data) and the event loop has
    # nothing else to run, or after this many seconds at most. With nothing announced and an idle loop it
    # cuts at once, so a lone session waits no longer; 0 cuts at once always. A session that holds a
    # window to the bound is not waited for again in that transaction.
    commit_delay: float = 0.1
    # Bodies of freshly enqueued messages kept in memory, so that delivering a message right after
    # accepting it reads nothing back; a body larger than a quarter of this is never kept.
    body_cache: int = 4 * MIB
    # While new mail is being claimed, deferred retries get at most this share of the claims (or
    # spool.fairness.TRICKLE claims per second, whichever is more); full rate after spool.fairness.QUIET
    # seconds without new mail. 1.0 turns the budget off.
    deferred_share: float = 0.2
    # Claims (STARTs) are written to the log before delivery begins, so a killed process leaves them;
    # True also fsyncs them then, so that a power cut leaves them too (for naming recipients in doubt).
    sync_claims: bool = False
    # Appended to this spool's queue ids wherever the engine names a message (``-K`` for shard K of a
    # relay with several processes), so that ids stay unique across the spools of one host.
    id_suffix: str = ""
    # Room kept for reclaiming room (spool.reserve): a preallocated file that only a checkpoint which deletes
    # segments may give up, when the disk is full to the last block. 0: none. At most one segment (a
    # checkpoint needs one block; deleting one segment gives the reserve back).
    reserve_bytes: int = 256 * 1024
    # At open, cut segment_size (and checkpoint_bytes, reserve_bytes) to fit a filesystem too small for them
    # (fit_to_filesystem): a segment is deleted only when several newer ones exist.
    fit_to_disk: bool = True
    clock: Callable[[], float] = time.time

    def __attrs_post_init__(self) -> None:
        if not MIN_SEGMENT_SIZE <= self.segment_size <= MAX_SEGMENT_SIZE:
            raise ValueError(f"segment_size must be between 4 KiB and 1 GiB, got {self.segment_size}")
        if self.active_limit < 1:
            raise ValueError("active_limit must be at least 1")
        if self.max_queue_lifetime <= 0:
            raise ValueError("max_queue_lifetime must be positive")
        if not self.lazy_commit_delay >= 0:
            raise ValueError("lazy_commit_delay must not be negative")
        if not 0 <= self.commit_delay <= 1:
            raise ValueError("commit_delay must be between 0 and 1 second")
        if self.checkpoint_bytes < 0:
            raise ValueError("checkpoint_bytes must not be negative")
        if not self.checkpoint_max_interval > 0:
            raise ValueError("checkpoint_max_interval must be positive")
        if self.body_cache < 0:
            raise ValueError("body_cache must not be negative")
        if not 0.0 <= self.deferred_share <= 1.0:
            raise ValueError("deferred_share must be between 0 and 1")
        if self.reserve_bytes < 0:
            raise ValueError("reserve_bytes must not be negative")

    @property
    def classes(self) -> int:
        """Number of runner classes, new mail included."""
        return 1 + len(self.retry_intervals)

    def interval(self, klass: int) -> float:
        return 0.0 if klass == 0 else self.retry_intervals[klass - 1]

    def next_class(self, klass: int) -> int:
        return min(klass + 1, self.classes - 1)


# The filesystem must hold this many segments. The spool deletes a segment only once it lies more than
# BODY_SLACK (2) + body_span segments behind the garbage end, which is itself in or behind the head's
# segment: with a backlog-free log about 4 segments stay; 16 keep that to a quarter of the disk.
SEGMENTS_PER_FILESYSTEM = 16


def fit_to_filesystem(config: SpoolConfig, fs_bytes: int) -> SpoolConfig:
    """``config`` with segments small enough for a filesystem of ``fs_bytes`` (unchanged if they are).

    Why: a 64 MiB segment on a 100 MiB disk can never be deleted (deletion
    needs newer segments past it, and they do not fit), so the spool fills the
    disk with garbage and refuses mail for good. Segments of at most 1/16 of
    the filesystem (in 4 KiB steps, at least MIN_SEGMENT_SIZE) always leave
    room to rotate and delete. ``checkpoint_bytes`` and ``reserve_bytes`` are
    cut to one such segment too: under steady load the byte bound paces
    checkpoints, and a segment is reclaimed only behind one.
    """
    if not config.fit_to_disk or fs_bytes <= 0:
        return config
    limit = max(MIN_SEGMENT_SIZE, fs_bytes // SEGMENTS_PER_FILESYSTEM // MIN_SEGMENT_SIZE * MIN_SEGMENT_SIZE)
    if config.segment_size <= limit:
        return config
    return attrs.evolve(config, segment_size=limit, checkpoint_bytes=min(config.checkpoint_bytes, limit),
                        reserve_bytes=min(config.reserve_bytes, limit))
