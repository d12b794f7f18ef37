"""Zeroed room ahead of the log's write position, so that a commit's fdatasync has no metadata to commit.

Why. On ext4 (and XFS) an fdatasync after a write that grows a file must
also commit the new size and the new extent in the journal: a second device
write and flush. An fdatasync after a write into blocks that are allocated,
written and whose size is already durable writes the data pages alone.
Measured on the project's VM (``tools/bench/prezero_probe.py``,
docs/benchmarks.md, "Zeroed room"): a 4 KiB write + fdatasync took
0.16 ms into a growing file, 0.105 ms into zeroed, synced room, and 0.16 ms
into fallocated room (unwritten extents: the first write to each converts it,
which is a metadata change too, so fallocate buys nothing). A lone client
waits for that fdatasync once or more per message. PostgreSQL fills each new
WAL segment with zeros before use for the same reason.

How. The writer keeps the last segment zeroed and synced some way past its
written end (``ROOM_MIN`` to ``ROOM_MAX``: as far ahead as the segment is long
already, so that a small spool's files stay small, never past the segment's
size). Making room (zeros written, then one fdatasync) runs off the commit
path: the trio committer asks for it when it has nothing else to write (a
client waiting for its ``250`` never waits for this sync). The synchronous
core never makes room, so its segments grow as in format version 2. A write
that reaches past the room grows the file, as before, and is correct either
way: room is only ever an optimisation.

What it changes on disk (format version 3, docs/format.md, "Zeroed room"): the
last segment may end in a run of zeros after its last record, which every
reader takes as the clean end of the log; a segment is cut to its real end
before its successor's header records that end as its sealed size, so a
sealed segment never holds room. Only a segment whose header says version 3
gets room; a version-2 segment continued after an upgrade grows as it always
did until the writer moves on to the next segment.
"""

from __future__ import annotations

from typing import Final

import attrs

ROOM_MIN: Final = 64 * 1024
ROOM_MAX: Final = 2 * 1024 * 1024  # made ~1 MiB at a time: 1.1 ms to write and sync here, 2 MiB 3.6 ms
ZEROS: Final = bytes(256 * 1024)  # written a piece at a time, one buffer for every write
ROOM_VERSION: Final = 3  # segments of this format version (and later) may end in zeroed room


@attrs.define
class ZeroRoom:
    """How far the last segment is zeroed and synced (``end``), and whether it may be (``enabled``).

    Read by the appending thread (``wanted``), changed by the I/O thread under the writer's lock.
    """

    seg: int = -1  # the segment ``end`` is in (-1: none looked at yet)
    end: int = 0  # every byte from the written end up to here is zero and durable, the file's size included
    enabled: bool = False  # the segment's header names a version that may end in zeros
    extensions: int = 0  # times room was made (one fdatasync each)
    zeroed_bytes: int = 0  # zeros written, in all

    @staticmethod
    def target(written: int, segment_size: int) -> int:
        """Where the room should end for a segment written up to ``written``: as far ahead as the
        segment is long already, between ROOM_MIN and ROOM_MAX, never past the segment's size."""
        return min(segment_size, written + min(ROOM_MAX, max(ROOM_MIN, written)))

    def wanted(self, seg: int, written: int, segment_size: int) -> bool:
        """Should room be made now? When the segment has not been looked at, or less than half the room
        it should have is left."""
        if seg != self.seg:
            return written < segment_size
        if not self.enabled:
            return False
        target = self.target(written, segment_size)
        return target > written and self.end - written < (target - written) // 2

    def moved_to(self, seg: int, written: int, enabled: bool) -> None:
        """The writer is in a segment it has not made room in: nothing beyond ``written`` is known."""
        self.seg = seg
        self.end = written
        self.enabled = enabled

    def cut_to(self, seg: int, off: int) -> None:
        """The segment was cut back to ``off`` (a write that found no room): so was its room."""
        if seg == self.seg:
            self.end = min(self.end, off)
