"""Room kept for reclaiming room: a preallocated file that only a checkpoint may give up.

Why. A segment is deleted only behind a durable checkpoint, and a checkpoint
is a new file. On a disk filled to the last block (by another process, or with
a free-space floor set too low) the spool could hold any amount of garbage and
be unable to free it for want of one block. So the spool keeps ``DIR/reserve``,
a file of ``SpoolConfig.reserve_bytes`` with its blocks allocated
(``posix_fallocate``). When a checkpoint that would delete segments finds no
room, the spool empties the reserve, writes the checkpoint into the space it
gave back, deletes the segments, and allocates the reserve again
(``Spool.checkpoint_write``).

While the reserve is not whole (``held`` is False) the spool has lost that
guarantee, and says so: the relay refuses new mail until it is back.

Resource handling: one file, opened only while it is resized; the same FileIO
as the log, so the fault harness sees and can fail these calls too.
"""

from __future__ import annotations

import logging
import os
import threading

from spool.errors import no_space
from spool.fileio import FileIO

NAME = "reserve"
log = logging.getLogger("spool")


class Reserve:
    def __init__(self, io: FileIO, spool_dir: str, size: int) -> None:
        self.io = io
        self.path = os.path.join(spool_dir, NAME)
        self.size = size
        self.held = size == 0
        self._lock = threading.Lock()  # the keeper (spool.aio.async_spool) and a checkpoint run in different threads

    def ensure(self) -> bool:
        """Allocate the reserve if it is missing or short; False if there is no room for it yet."""
        with self._lock:
            return self._ensure()

    def _ensure(self) -> bool:
        if self.held:
            return True
        try:
            fd = self.io.open(self.path, create=True)
            try:
                if self.io.size(fd) < self.size:
                    # No fsync: a reserve lost to a crash is allocated again at the next start.
                    self.io.allocate(fd, self.size)
            finally:
                self.io.close(fd)
        except OSError as exc:
            if not no_space(exc):
                raise
            return False
        self.held = True
        return True

    def release(self) -> None:
        """Give the reserve's blocks back to the filesystem (for a checkpoint that will free more)."""
        if self.size == 0:
            return
        with self._lock:
            fd = self.io.open(self.path, create=True)
            try:
                self.io.truncate(fd, 0)
            finally:
                self.io.close(fd)
            self.held = False
        log.warning("the spool's disk is full: used the %d-byte reserve (%s) to write a checkpoint and delete "
                    "segments; it is allocated again as soon as there is room", self.size, self.path)
