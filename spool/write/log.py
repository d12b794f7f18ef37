"""The append side of the log: positions, buffering, rotation, write and sync.

Theory of operation. ``append`` encodes a frame into an in-memory batch and
returns the record's position at once: positions are assigned by the event
loop's thread, in order. ``take_batch`` hands the pending bytes to whoever will
do the I/O (the trio committer, in a worker thread; or the synchronous core
directly), and ``write_batch`` writes them with one write per segment, applies
garbage marks that were waiting for this sync, and fdatasyncs. Appends may go
on while a batch is being written: that is group commit.

Rotation: when a record does not fit, the next segment begins in the same
batch. Batches may be written without a sync (early writes of big bodies,
claims), so a rotation can fall between two batches: whatever batch creates
segment N+1 first fdatasyncs every segment before it that holds unsynced data
(and the directory, if one of them is new), because N+1's header records N's
sealed size and must never reach the disk before N's tail. A commit then
fdatasyncs every segment it covers that holds unsynced data, oldest first, not
only the last one. So only the last segment can ever have a torn tail, and
``durable_end`` never passes a byte that is not on disk.

A failed fsync poisons the writer: PostgreSQL's fsyncgate showed that a retried
fsync can report success for pages the kernel already dropped, so the only safe
course is to crash and recover from what is really on disk. So does EIO on a
write: what reached the file is unknown.

A write that finds no room (ENOSPC, EDQUOT) does not poison. It wrote nothing
that a later sync could make durable by surprise: the files are cut back to
where the failed batch began in each of them (a short write may have extended
one), the batch is put back in front of whatever was appended since
(``restore``), and the same bytes are written at the same positions when space
returns. Positions already handed out stay valid, so in-memory state (attempts,
outcomes, bodies being received) stays consistent with the log; records wait
in memory meanwhile, and the callers keep that bounded (the relay refuses new
mail and pauses deliveries while ``full`` is set). A message whose commit
failed this way is cancelled by its caller (``cancel``: its envelope is
written with the garbage flag set).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict

import attrs
from crc32c import crc32c

from spool.errors import DiskFull, SpoolError, SyncFailed, no_space
from spool.fileio import FileIO, read_exact, write_all
from spool.format.horizon import encode_horizon, horizon_path, read_horizon
from spool.format.record import (
    CRC_PREFIX,
    FLAGS_OFFSET,
    GARBAGE,
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD,
    Frame,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, encode_segment_header, header_version, read_frame_at, segment_path
from spool.read.reader import LogReader, Reporter, raise_anomaly
from spool.write.room import ROOM_VERSION, ZEROS, ZeroRoom

_MAX_OPEN = 16
# A record with a payload this big or bigger (a body's chunk) is buffered alone, in a buffer of exactly its size,
# not appended to the growing buffer the small records share: growing a buffer of megabytes by realloc left the
# event loop's heap holes of every size on the way (glibc keeps them), and RSS then grew by twice the data.
OWN_BUFFER = 64 * 1024
_pack_header = HEADER.pack
_pack_crc_prefix = CRC_PREFIX.pack


@attrs.define
class Batch:
    """Bytes to write: ``chunks`` are (segment id, offset, data), in log order."""

    chunks: list[tuple[int, int, bytearray]]
    end: int
    marks: list[int]
    sync: bool = True
    size: int = 0  # bytes in chunks (the writer's pending count when it was taken)


class LogWriter:
    """Owns the files of the log. Not thread-safe by itself: ``append`` and
    ``take_batch`` run on one thread; ``write_batch`` and ``mark_now`` on another,
    serialised by ``io_lock``."""

    def __init__(self, io: FileIO, log_dir: str, segment_size: int, segment_id: int, end_offset: int,
                 now: int) -> None:
        self.io = io
        self.log_dir = log_dir
        self.segment_size = segment_size
        self.io_lock = threading.Lock()
        self._seg = segment_id
        self._off = end_offset
        self._chunks: list[tuple[int, int, bytearray]] = []
        self._buf: bytearray | None = None  # the last of _chunks, where the next record goes (None: start one)
        self._marks: list[int] = []
        self._mark_set: set[int] = set()  # the same positions: mark_pending is asked once per claim candidate
        self._pending_bytes = 0
        self._last_time = now
        self.durable_end = make_pos(segment_id, end_offset)
        self.written_end = self.durable_end
        # Readers in other threads that wait for what was appended to become durable (``wait_durable``).
        self._durable_moved = threading.Condition(threading.Lock())
        self.appended_bytes = 0
        self.fsyncs = 0
        self.commits = 0
        self.records = 0
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._rfds: OrderedDict[int, int] = OrderedDict()
        # Readers run in several worker threads at once (bodies, admin reads): one holds this from picking a
        # descriptor until its read is done, so no other thread closes it (LRU eviction, deletion) midway.
        self._rlock = threading.Lock()
        self._dirty: set[int] = set()  # segments with unsynced data or garbage marks (a checkpoint syncs them)
        self._unsynced: set[int] = set()  # segments with unsynced record bytes (a commit syncs them)
        self._dir_dirty = False
        self.poisoned: BaseException | None = None
        # Why the last write found no room (None once a write succeeds again): see the module docstring.
        self.full: str | None = None
        # Garbage marks whose one-byte write found no room (copy-on-write filesystems): written with the next
        # batch or checkpoint, and counted as pending meanwhile, so that no runner claims their envelopes.
        self._late_marks: list[int] = []
        self.closed_sizes: dict[int, int] = {}
        # Where a sealed segment that is missing, or not the size its successor recorded, is reported when a
        # runner asks for its end (``segment_end``); the spool sets its damage policy here after recovery.
        self.on_damage: Reporter = raise_anomaly
        # Zeroed, synced room past the written end of the last segment (``make_room``, spool.write.room).
        self.room = ZeroRoom()
        self._horizon_fd: int | None = None  # DIR/durable, opened at the first publish
        self._published: int | None = None  # the position DIR/durable holds (None: not known yet)

    # -- append side (event loop thread) -------------------------------------

    @property
    def head(self) -> int:
        """Position the next record will get."""
        return make_pos(self._seg, self._off)

    def wait_durable(self, pos: int, timeout: float) -> bool:
        """From a thread other than the appender's: wait until every record before ``pos`` is durable.

        Why: a reader that began behind a record appended a moment ago (a
        held envelope carried forward, whose old place is already garbage)
        finds it only once it is durable. False if ``timeout`` passed first.
        """
        with self._durable_moved:
            return self._durable_moved.wait_for(lambda: self.durable_end >= pos, timeout)

    @property
    def segment_id(self) -> int:
        return self._seg

    @property
    def pending_bytes(self) -> int:
        """Bytes appended but not yet handed to ``write_batch`` (a counter: asked on every body chunk)."""
        return self._pending_bytes

    @property
    def has_chunks(self) -> bool:
        """Records appended and not yet handed to ``write_batch``."""
        return bool(self._chunks)

    @property
    def has_pending(self) -> bool:
        return bool(self._chunks) or bool(self._marks)

    def append(self, rtype: int, payload: bytes, *, klass: int = 0, now: float) -> int:
        """Buffer one record; return its position.

        Runs once per record, so it does the framing itself (``encode_header``'s
        checksum and pack, inlined) and keeps the buffer of the current segment
        at hand (``_buf``): 0.7 -> 0.5 us a record (batched appends).
        """
        if self.poisoned is not None:
            raise SpoolError("the log is unusable after an I/O failure; restart to recover") from self.poisoned
        t = int(now)
        if t < self._last_time:
            t = self._last_time
        else:
            self._last_time = t
        n = len(payload)
        if n > MAX_PAYLOAD:
            raise ValueError(f"payload of {n} bytes exceeds {MAX_PAYLOAD}")
        size = HEADER_SIZE + n
        off = self._off
        if off + size > self.segment_size and off > SEGMENT_HEADER_SIZE:
            self._rotate(t)
            off = SEGMENT_HEADER_SIZE
        seg = self._seg
        header = _pack_header(crc32c(payload, crc32c(_pack_crc_prefix(seg, n, rtype, klass, 0, t))),
                              n, rtype, 0, klass, 0, t)
        if n >= OWN_BUFFER:
            # A body chunk: a buffer of its own, of exactly its size (one allocation of one size, again and
            # again), never grown record by record (docs/design.md, "Memory while a body streams").
            buf = bytearray(header)
            buf += payload
            self._chunks.append((seg, off, buf))
            self._buf = None
        else:
            shared = self._buf
            if shared is None:
                shared = self._buf = bytearray()
                self._chunks.append((seg, off, shared))
            shared += header
            shared += payload
        self._off = off + size
        self._pending_bytes += size
        self.appended_bytes += size
        self.records += 1
        return seg << 32 | off

    def _rotate(self, t: int) -> None:
        """Seal the current segment and begin the next one in this batch (its header records the sealed size)."""
        self.closed_sizes[self._seg] = self._off
        self._seg += 1
        self._buf = bytearray(encode_segment_header(self._seg, t, self._off))
        self._chunks.append((self._seg, 0, self._buf))
        self._off = SEGMENT_HEADER_SIZE
        self._pending_bytes += SEGMENT_HEADER_SIZE

    def mark_after_sync(self, pos: int) -> None:
        """Set the garbage mark of ``pos`` once everything appended so far is durable."""
        self._marks.append(pos)
        self._mark_set.add(pos)

    def mark_pending(self, pos: int) -> bool:
        """Is a mark on ``pos`` still waiting for its START to be durable (or for room to be written)?"""
        return pos in self._mark_set or pos in self._late_marks

    @property
    def waiting_marks(self) -> int:
        """Garbage marks whose write found no room and waits for the next batch or checkpoint."""
        return len(self._late_marks)

    def cancel(self, pos: int) -> None:
        """Set the garbage flag of a record appended but not durable (a message whose commit failed).

        In the buffer if the record is still there; and in any case once the
        next commit is durable, like any mark (the record may be in a batch
        being written right now, or already written).
        """
        seg, off = pos_segment(pos), pos_offset(pos)
        for cseg, coff, data in self._chunks:
            if cseg == seg and coff <= off < coff + len(data):
                data[off - coff + FLAGS_OFFSET] |= GARBAGE
        self.mark_after_sync(pos)

    def take_batch(self, *, sync: bool = True) -> Batch:
        batch = Batch(self._chunks, self.head, self._marks if sync else [], sync, self._pending_bytes)
        self._chunks = []
        self._buf = None
        self._pending_bytes = 0
        if sync:
            self._marks = []
            self._mark_set = set()
        return batch

    def restore(self, batch: Batch) -> None:
        """Put back a batch whose write found no room, ahead of what was appended since (appending thread).

        Its positions were handed out, so its bytes must land exactly there;
        everything appended after it follows it in the log. The buffers are
        copied: the failed write's memoryviews may still hold the old ones.
        """
        self._chunks[:0] = [(seg, off, bytearray(data)) for seg, off, data in batch.chunks]
        self._pending_bytes += batch.size
        if batch.sync:
            self._marks[:0] = batch.marks
            self._mark_set.update(batch.marks)

    # -- I/O side (one thread at a time) --------------------------------------

    def _fd(self, seg: int, *, create: bool = False) -> int:
        fd = self._fds.get(seg)
        if fd is not None:
            self._fds.move_to_end(seg)
            return fd
        path = segment_path(self.log_dir, seg)
        fd = self.io.open(path, create=create)
        self._fds[seg] = fd
        while len(self._fds) > _MAX_OPEN:
            old, ofd = self._fds.popitem(last=False)
            if old in self._dirty:
                self._sync_fd(ofd)
                self._dirty.discard(old)
                self._unsynced.discard(old)
            self.io.close(ofd)
        return fd

    def _sync_fd(self, fd: int, *, count: bool = True) -> None:
        try:
            self.io.fdatasync(fd)
            if count:  # the zeroed room's syncs are counted apart (room.extensions): no commit waits on them
                self.fsyncs += 1
        except OSError as exc:
            self.poisoned = exc
            raise SyncFailed(f"fdatasync failed: {exc}; the process must restart and recover") from exc

    def write_batch(self, batch: Batch) -> None:
        """Write, sync (if asked), then apply the marks that waited for that sync.

        Raises DiskFull when a write finds no room: the files are cut back and
        the caller must ``restore`` the batch (from the appending thread).
        SyncFailed (and any other OSError) poisons the writer.
        """
        with self.io_lock:
            self._write_locked(batch)

    def try_write_batch(self, batch: Batch) -> bool:
        """``write_batch`` unless another thread holds the files (a checkpoint's syncs): then False, nothing done.

        For the event loop's thread, which must not wait behind another thread's I/O.
        """
        if not self.io_lock.acquire(blocking=False):
            return False
        try:
            self._write_locked(batch)
        finally:
            self.io_lock.release()
        return True

    def _write_locked(self, batch: Batch) -> None:
        """``write_batch``'s work, with ``io_lock`` held."""
        if self.poisoned is not None:
            raise SpoolError("the log is unusable after an I/O failure") from self.poisoned
        for seg, off, data in batch.chunks:
            if off == 0:
                # The new header records the previous segment's sealed size: that segment (cut to that
                # size first, if it had zeroed room), and any older one with unsynced bytes, must be on
                # disk before the header can be.
                self._seal(seg - 1)
                self._sync_segments(below=seg)
                self._sync_dir()
            self._write_chunk(seg, off, data)
        self.full = None
        if batch.chunks:
            self.written_end = batch.end
        if not batch.sync:
            return
        # Every segment with unsynced bytes up to written_end, oldest first: earlier write-only
        # batches may have left bytes in any of them, not only in the last.
        self._sync_segments(below=pos_segment(self.written_end) + 1)
        self._sync_dir()
        self.durable_end = self.written_end
        self.publish_durable()
        self.commits += 1
        with self._durable_moved:
            self._durable_moved.notify_all()
        self._late_marks.extend(batch.marks)
        self._apply_late_marks()

    def _write_chunk(self, seg: int, off: int, data: bytearray) -> None:
        try:
            fd = self._fd(seg, create=off == 0)
            if off == 0:
                self._dir_dirty = True
            write_all(self.io, fd, data, off)
        except SyncFailed:
            raise
        except OSError as exc:
            if not no_space(exc):
                self.poisoned = exc
                raise
            self._cut_back(seg, off)
            self.full = f"{exc.strerror or exc} writing {segment_path(self.log_dir, seg)}"
            raise DiskFull(exc.errno, f"the spool's disk is full: {self.full}") from None
        self._dirty.add(seg)
        self._unsynced.add(seg)

    def _cut_back(self, seg: int, off: int) -> None:
        """Undo whatever part of a failed write reached the file (a short write extends it).

        Nothing past ``off`` in this segment was written by an earlier batch,
        and no reader looks past ``durable_end``. A new segment keeps its (now
        empty) file; a crash before the retry leaves an empty last segment,
        which recovery removes. Failing to cut back poisons the writer: the
        file would hold bytes nobody accounts for.
        """
        fd = self._fds.get(seg)
        if fd is None:
            return  # the file could not even be created
        self.room.cut_to(seg, off)
        try:
            self.io.truncate(fd, off)
        except OSError as exc:
            self.poisoned = exc
            raise SpoolError(f"cutting back a write that found no room failed: {exc}") from exc

    def _seal(self, seg: int) -> None:
        """Cut a segment the writer has left to the size its successor's header will record (its zeroed
        room goes): a sealed segment is exactly its records, as in format version 2. Synced by the caller."""
        size = self.closed_sizes.get(seg)
        if size is None:
            return
        try:
            fd = self._fd(seg)
            if self.io.size(fd) > size:
                self.io.truncate(fd, size)
                self._unsynced.add(seg)
                self._dirty.add(seg)
        except FileNotFoundError:
            return  # reclaimed already (a segment is deleted only behind a durable checkpoint)
        except OSError as exc:
            self.poisoned = exc
            raise

    # -- zeroed room (spool.write.room) -----------------------------------------------

    def room_wanted(self) -> bool:
        """Would ``make_room`` do something now? Cheap: the committer asks after each of its passes."""
        if self.poisoned is not None or self.full is not None:
            return False
        end = self.written_end
        return self.room.wanted(pos_segment(end), pos_offset(end), self.segment_size)

    def make_room(self) -> None:
        """Zero the last segment past its written end and fdatasync it (spool.write.room): off the commit path.

        Never touches a byte below the written end (records), and holds the
        writer's lock, so no batch is written meanwhile. A disk with no room
        for the zeros is no error: the room is given up for this segment, and
        the records grow the file as they did before. EIO and a failed sync
        poison the writer, as on every other write.
        """
        with self.io_lock:
            if self.poisoned is not None or self.full is not None:
                return
            seg, written = pos_segment(self.written_end), pos_offset(self.written_end)
            room = self.room
            fd = self._fd(seg)
            if seg != room.seg:
                version = header_version(read_exact(self.io, fd, SEGMENT_HEADER_SIZE, 0))
                room.moved_to(seg, written, version is not None and version >= ROOM_VERSION)
            if not room.enabled:
                return
            start, stop = max(room.end, written), room.target(written, self.segment_size)
            if stop <= start:
                return
            try:
                off = start
                while off < stop:
                    n = min(len(ZEROS), stop - off)
                    write_all(self.io, fd, memoryview(ZEROS)[:n], off)
                    off += n
            except OSError as exc:
                if not no_space(exc):
                    self.poisoned = exc
                    raise
                self._cut_back(seg, start)
                room.enabled = False  # tried again in the next segment
                return
            self._sync_fd(fd, count=False)
            room.end = stop
            room.extensions += 1
            room.zeroed_bytes += stop - start

    def _apply_late_marks(self) -> None:
        """Write the marks waiting for this point; any that find no room wait for the next batch."""
        marks, self._late_marks = self._late_marks, []
        for i, pos in enumerate(marks):
            try:
                self._mark(pos)
            except FileNotFoundError:
                continue  # its segment was already reclaimed: nothing left to mark
            except OSError as exc:
                if not no_space(exc):
                    self.poisoned = exc
                    raise
                self._late_marks = marks[i:]
                return

    def _sync_segments(self, *, below: int) -> None:
        """fdatasync, oldest first, every segment below ``below`` that holds unsynced record bytes."""
        for seg in sorted(s for s in self._unsynced if s < below):
            self._sync_fd(self._fd(seg))
            self._unsynced.discard(seg)
            self._dirty.discard(seg)

    def _sync_dir(self) -> None:
        if self._dir_dirty:
            try:
                self.io.fsync_dir(self.log_dir)
                self.fsyncs += 1
            except OSError as exc:
                self.poisoned = exc
                raise SyncFailed(f"directory fsync failed: {exc}") from exc
            self._dir_dirty = False

    def _mark(self, pos: int) -> None:
        fd = self._fd(pos_segment(pos))
        write_all(self.io, fd, bytes([GARBAGE]), pos_offset(pos) + FLAGS_OFFSET)
        self._dirty.add(pos_segment(pos))

    def mark_now(self, pos: int) -> None:
        """Set a mark on a record already known durable (recovery, admin); later if it finds no room."""
        with self.io_lock:
            if self.poisoned is not None:
                raise SpoolError("the log is unusable after an I/O failure; restart to recover") from self.poisoned
            self._late_marks.append(pos)
            self._apply_late_marks()

    def sync_all(self) -> None:
        """fdatasync every segment with marks or data not yet synced (checkpoint).

        Raises DiskFull while a mark still waits for room: a checkpoint must
        not move the working suffix past the START that explains it.
        """
        with self.io_lock:
            if self.poisoned is not None:
                raise SpoolError("the log is unusable after an I/O failure; restart to recover") from self.poisoned
            self._apply_late_marks()
            if self._late_marks:
                raise DiskFull(errno.ENOSPC, f"{len(self._late_marks)} garbage marks wait for room")
            for seg in sorted(self._dirty):
                self._sync_fd(self._fd(seg))
            self._dirty.clear()
            self._unsynced.clear()
            self._sync_dir()

    def forget(self, seg: int) -> None:
        """Close the descriptor of a segment about to be deleted."""
        with self.io_lock, self._rlock:
            for fds in (self._fds, self._rfds):
                fd = fds.pop(seg, None)
                if fd is not None:
                    self.io.close(fd)
            self._dirty.discard(seg)
            self._unsynced.discard(seg)
            self.closed_sizes.pop(seg, None)

    # -- reading single records -----------------------------------------------

    def _rfd(self, seg: int) -> int:
        """Descriptors for reading, apart from the writer's: reads must not wait on a running fsync."""
        fd = self._rfds.get(seg)
        if fd is not None:
            self._rfds.move_to_end(seg)
            return fd
        fd = self.io.open_read(segment_path(self.log_dir, seg))
        self._rfds[seg] = fd
        while len(self._rfds) > _MAX_OPEN:
            self.io.close(self._rfds.popitem(last=False)[1])
        return fd

    def read_frame(self, pos: int) -> Frame:
        """Read and verify the record at ``pos`` (it must already be written)."""
        seg = pos_segment(pos)
        with self._rlock:
            return read_frame_at(self.io, self._rfd(seg), segment_path(self.log_dir, seg), seg, pos_offset(pos))

    def read_flags(self, pos: int) -> int:
        """The flags byte of the record at ``pos``, as on disk now (garbage marks included)."""
        with self._rlock:
            data = self.io.read(self._rfd(pos_segment(pos)), 1, pos_offset(pos) + FLAGS_OFFSET)
        return data[0] if data else 0

    def segment_end(self, seg: int) -> int:
        """End offset of valid data in ``seg`` as far as readers may go (durable).

        A sealed segment that is missing, or not the size its successor's
        header recorded, goes to ``on_damage``; if that returns, a missing
        segment reads as empty and a mismatched one ends at the smaller size.
        """
        if seg == pos_segment(self.durable_end):
            return pos_offset(self.durable_end)
        if seg in self.closed_sizes:
            return self.closed_sizes[seg]
        try:
            with self._rlock:
                size = self.io.size(self._rfd(seg))
        except FileNotFoundError:
            self.on_damage(LogReader(self.io, self.log_dir).missing_segment(seg))
            self.closed_sizes[seg] = SEGMENT_HEADER_SIZE
            return SEGMENT_HEADER_SIZE
        sealed = LogReader(self.io, self.log_dir, segments=()).sealed_size(seg, size)
        if sealed is not None:
            self.on_damage(sealed)  # a runner met it: it is reported as the reader's other anomalies
            size = sealed.offset
        self.closed_sizes[seg] = size
        return size

    def publish_durable(self) -> None:
        """Tell readers in other processes how far the log is on disk (``spool.format.horizon``).

        Called only once ``durable_end`` is true. One ``pwrite``, no fsync: a
        lost or torn write leaves an older (still true) horizon. A failure
        here is no failure of the commit: readers wait for the next one.
        An open that finds the horizon already true writes nothing.
        """
        if self._published == self.durable_end:
            return
        try:
            if self._horizon_fd is None:
                spool_dir = os.path.dirname(self.log_dir.rstrip(os.sep))
                if read_horizon(self.io, spool_dir) == self.durable_end:
                    self._published = self.durable_end
                    return
                self._horizon_fd = self.io.open(horizon_path(spool_dir), create=True)
            write_all(self.io, self._horizon_fd, encode_horizon(self.durable_end), 0)
            self._published = self.durable_end
        except OSError:
            pass

    def close(self) -> None:
        with self.io_lock:
            if self._horizon_fd is not None:
                self.io.close(self._horizon_fd)
                self._horizon_fd = None
            for fds in (self._fds, self._rfds):
                for fd in fds.values():
                    self.io.close(fd)
                fds.clear()
