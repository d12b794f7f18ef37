"""The engine's settings, each defined once: type, default, limits and help (``spool.config.settings``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

import attrs

from spool.config.fairness import QUIET, TRICKLE
from spool.config.settings import Boolean, Duration, Fraction, Integer, ListOf, OneOf, Optional, Path, Size, setting
from spool.format.record import HELD_CLASS

MIB = 1024 * 1024
# A position keeps a segment offset in 32 bits, and a record that does not fit the rest of a segment
# starts one of its own (up to MAX_PAYLOAD past segment_size): 1 GiB leaves ample room below 4 GiB.
MIN_SEGMENT_SIZE = 4096
MAX_SEGMENT_SIZE = 1 << 30


DEFAULT_RETRY_INTERVALS = (60.0, 300.0, 900.0, 1800.0, 3600.0)


def _floats(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in value)


def _intervals_rule(value: tuple[float, ...]) -> str | None:
    if len(value) >= HELD_CLASS:
        return f"at most {HELD_CLASS - 1} deferred classes"
    if any(b < a for a, b in itertools.pairwise(value)):
        return "retry intervals must not decrease: the last class sweeps the log"
    return None


RETRY_INTERVALS = ListOf(Duration(positive=True), least=1, needed="at least one retry interval is needed",
                         rule=_intervals_rule, rule_text="not decreasing")


@attrs.frozen
class SpoolConfig:
    """Engine settings: each field is one setting's whole definition (``spool.config.settings``).

    ``retry_intervals`` are the deferred runner classes 1..N (class 0 is new
    mail, due at once). A runner of class k trails the head of the log by its
    interval; the last class is also the sweeper that carries held messages
    forward so that the log behind it can be reclaimed.

    The relay's ``[spool]`` section (``mta.config.sections.SpoolSection``) is
    this class plus where the spool lives: the settings marked ``in_file`` are
    read from the config file, the others are the engine's tuning, set by
    code, tests and benchmarks.
    """

    segment_size: int = setting(
        Size(MIN_SEGMENT_SIZE, MAX_SEGMENT_SIZE), "a segment is sealed and a new one started at this size (a "
        "position keeps the offset in 32 bits, and a record larger than the rest of a segment starts one of its own); "
        "cut to 1/16 of a smaller filesystem at start", 64 * MIB)
    retry_intervals: tuple[float, ...] = setting(
        RETRY_INTERVALS, "one deferred runner class per interval", DEFAULT_RETRY_INTERVALS, converter=_floats)
    max_queue_lifetime: float = setting(Duration(positive=True), "then the message bounces (expired)", 5 * 86400.0)
    active_limit: int = setting(Integer(1), "messages in delivery at once", 10_000)
    archive_dir: str | None = setting(
        Optional(Path()), "unset, garbage segments are deleted; set, they are moved here (for `mta report`)", None)
    cursor_pin_max: int = setting(
        Size(), "the segments that event consumers' cursors have not read past are kept from reclaim, up to this "
        "many bytes of segments (the newest kept); past it they are archived or deleted as ever, and a consumer "
        "that reads there is told it lags (see \"Consuming events\"); 0: cursors keep nothing", 1024 * MIB)
    on_damage: str = setting(
        OneOf(("quarantine", "refuse")), "damage in the log (a bad record, a missing segment, a damaged checkpoint): "
        "`quarantine` copies the damaged bytes to `<dir>/quarantine`, names the messages it lost and goes on; "
        "`refuse` stops a start that meets it and says what to run (see \"When the disk lies\"); damage met while "
        "running is quarantined either way", "quarantine")
    # What recovery does with a message whose delivery attempt was in flight at a crash and left recipients
    # with no outcome (the next hop may have taken them): hold it for the operator, or deliver it again.
    in_doubt: str = setting(
        OneOf(("hold", "redeliver")), "a message whose delivery was in flight at a crash, with recipients the "
        "next hop may have taken (no outcome recorded): `hold` holds it at the restart, logged and listed by `mta "
        "queue list --in-doubt`, until `mta queue release` or `delete`; `redeliver` delivers it again at once (a "
        "possible duplicate); see \"After a crash\"", "hold")
    body_chunk: int = setting(Size(positive=True), "message data is stored in chunks of at most this size",
                              256 * 1024, in_file=False)
    # Message data held in memory before it is written (not synced): a write is asked for at half of
    # this, and a receiver stops reading while this much is pending or being written.
    flush_threshold: int = setting(Size(), "message data held in memory before it is written", 4 * MIB, in_file=False)
    # Checkpoints: looked at every ``checkpoint_interval`` seconds and written if anything moved and either
    # the log was quiet for that interval, or ``checkpoint_bytes`` were appended since the last one, or
    # ``checkpoint_max_interval`` passed. A checkpoint costs three fsyncs; under load the byte bound, not the
    # clock, paces them (recovery scans at most about that much more). checkpoint_bytes 0: every interval.
    checkpoint_interval: float = setting(
        Duration(positive=True), "restart positions are looked at this often and written when the log was quiet "
        "that long", 2.0)
    checkpoint_bytes: int = setting(
        Size(), "...or when this much log was written since the last one (recovery rescans at most about this "
        "much); `0`: every interval", 16 * MIB)
    checkpoint_max_interval: float = setting(Duration(positive=True), "...or at the latest after this long", 60.0)
    # Records nobody waits for (FINISH, replacement envelopes) ride with the next commit; if none comes
    # sooner, this many seconds after they were appended replacement envelopes are committed (their runner
    # reads only the durable log) and FINISH records alone are written, not synced (spool.aio.group_commit).
    lazy_commit_delay: float = setting(Duration(), "records nobody waits for are committed (FINISH records alone: "
                                       "written) at most this late", 0.1, in_file=False)
    # Group-commit window: a commit someone waits for is cut once every commit announced as coming has
    # arrived (SMTP sessions between an accepted RCPT and the end of their data) and the event loop has
    # nothing else to run, or after this many seconds at most. With nothing announced and an idle loop it
    # cuts at once, so a lone session waits no longer; 0 cuts at once always. A session that holds a
    # window to the bound is not waited for again in that transaction.
    commit_delay: float = setting(
        Duration(at_most=1.0), "group-commit window bound: a commit waits for the sessions that announced one "
        "(between an accepted RCPT and their end of data) and for an idle event loop, at most this long; a lone "
        "session waits nothing; `0`: commit at once", 0.1)
    # Bodies of freshly enqueued messages kept in memory, so that delivering a message right after
    # accepting it reads nothing back; a body larger than a quarter of this is never kept. 16 MiB: with
    # 4 MiB, 20 sessions of 100 KB messages kept more bodies between their 250 and their delivery than
    # fit, and each miss was read back in worker threads (CPU per message 1.32 -> 1.16 ms with 16 MiB,
    # docs/benchmarks.md, "Body passes").
    body_cache: int = setting(Size(), "bodies of fresh messages kept in memory for their first delivery", 16 * MIB,
                              in_file=False)
    # While new mail is being claimed, deferred retries get at most this share of the claims (or
    # spool.config.fairness.TRICKLE claims per second, whichever is more); full rate after spool.config.fairness.QUIET
    # seconds without new mail. 1.0 turns the budget off.
    deferred_share: float = setting(
        Fraction(), f"while new mail is being claimed, retries of deferred mail get at most this share of the "
        f"claims (at least {TRICKLE:g} per second); after {QUIET:g} s without new mail, the full rate; `1`: no "
        "budget", 0.2)
    # Claims (STARTs) are written to the log before delivery begins, so a killed process leaves them;
    # True also fsyncs them then, so that a power cut leaves them too (for naming recipients in doubt).
    sync_claims: bool = setting(Boolean(), "fsync claims before delivery begins", False, in_file=False)
    # Appended to this spool's queue ids wherever the engine names a message (``-K`` for shard K of a
    # relay with several processes), so that ids stay unique across the spools of one host. Wiring, not a setting.
    id_suffix: str = ""
    # Room kept for reclaiming room (spool.write.reserve): a preallocated file that only a checkpoint which deletes
    # segments may give up, when the disk is full to the last block. 0: none. At most one segment (a
    # checkpoint needs one block; deleting one segment gives the reserve back).
    reserve_bytes: int = setting(Size(), "room kept for the checkpoint that deletes segments on a full disk",
                                 256 * 1024, in_file=False)
    # At open, cut segment_size (and checkpoint_bytes, reserve_bytes) to fit a filesystem too small for them
    # (fit_to_filesystem): a segment is deleted only when several newer ones exist.
    fit_to_disk: bool = setting(Boolean(), "cut segments to fit a small filesystem at open", True, in_file=False)
    clock: Callable[[], float] = time.time

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
