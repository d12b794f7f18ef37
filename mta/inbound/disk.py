"""Room for new mail on the spool's disk: the check made before taking mail, and the refusal when there is none.

New mail is refused with ``452 4.3.1`` while the spool's disk is short
(``DiskCheck.ok``: the free space, less what the spool has not yet written,
below ``queue_minfree``; or a write waiting for room; or the spool's reserve
not whole). The session checks at MAIL, at every chunk of DATA (a message
being received is then read to its end and dropped) and before the enqueue;
a commit that finds the disk full (DiskFull) gets the same reply. A message
larger than the filesystem could ever hold above the floor gets ``552
5.3.4`` instead (``DiskCheck.refusal``), so that its sender stops retrying.
A filesystem that reports no size (statfs not implemented, as on some FUSE
and network filesystems: total 0, free 0) is not a full disk: the relay says
so once at start, and only the ENOSPC handling (the spool's reserve, a write
waiting for room) refuses mail there. docs/operations.md, "Disk space".
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from mta.smtp.common import Reply
from spool import AsyncSpool

log = logging.getLogger("mta.smtpd")

R_DISK_FULL = Reply(452, "4.3.1", "Insufficient system storage, try again later")
R_TOO_BIG_FOR_DISK = Reply(552, "5.3.4", "Message too big for this system's disk")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def measured_free(path: str, statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> int | None:
    """The free bytes for the spool at ``path``, or None when its filesystem reports no size (total 0)."""
    st = statvfs(path)
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize


def filesystem_bytes(path: str) -> int:
    """The size of the filesystem holding ``path`` (what the spool could ever use, with nothing else on it)."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


class CachedFreeSpace:
    """``free_bytes`` that reuses a reading for up to ``ttl`` seconds while the disk has plenty.

    Why: a statvfs per MAIL FROM (and per end of DATA) was 2% of the relay's
    CPU. A reading is reused only while it is at least ``margin`` bytes above
    ``minfree``; nearer the limit every check reads afresh, so the 452 starts
    and ends exactly where it did. What the cache can miss is a fall of more
    than ``margin`` within ``ttl`` seconds.
    """

    def __init__(self, minfree: int, *, ttl: float = 1.0, margin: int | None = None,
                 measure: Callable[[str], int | None] = measured_free,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.minfree = minfree
        self.ttl = ttl
        self.margin = max(minfree, 64 << 20) if margin is None else margin
        self.measure = measure
        self.clock = clock
        self._path = ""
        self._value: int | None = 0
        self._until = -math.inf

    def __call__(self, path: str) -> int | None:
        now = self.clock()
        if path != self._path or now >= self._until:
            self._path, self._value = path, self.measure(path)
            plenty = self._value is None or self._value >= self.minfree + self.margin
            self._until = now + self.ttl if plenty else -math.inf
        return self._value


class DiskCheck:
    """Whether the spool has room for new mail, and the reply when it has not.

    ``free_space`` (tests inject one) is asked at every check; the default is a ``CachedFreeSpace``.
    It answers None for a filesystem that reports no size: said once here, at start.
    """

    def __init__(self, aspool: AsyncSpool, minfree: int,
                 free_space: Callable[[str], int | None] | None = None) -> None:
        self.aspool = aspool
        self.minfree = minfree
        self.free_space = free_space or CachedFreeSpace(minfree)
        try:
            unsized = self.free_space(aspool.core.path) is None
        except OSError:
            unsized = False
        if unsized:
            log.warning("%s: the filesystem reports no size (statfs gives total 0, free 0): queue_minfree cannot "
                        "be checked there; mail is refused with 452 only when a write finds the disk full (ENOSPC)",
                        aspool.core.path)

    def ok(self) -> bool:
        """Room for new mail? The spool must have no write waiting for room and its reserve whole, and the
        free space, less what the spool holds in memory and has yet to write, must be above ``minfree``.
        """
        spool = self.aspool
        if not spool.space_ok:
            return False
        free = self.free_space(spool.core.path)
        return free is None or free - spool.unflushed_bytes >= self.minfree

    def refusal(self, size: int) -> Reply:
        """``452``, or ``552`` for a message of ``size`` bytes that could never fit above the floor."""
        try:
            room = filesystem_bytes(self.aspool.core.path) - self.minfree
        except OSError:
            return R_DISK_FULL
        return R_TOO_BIG_FOR_DISK if 0 < room < size else R_DISK_FULL
