"""The one reader of the log: segments in order, records with their positions, every anomaly named once.

Theory of operation (LevelDB's ``log::Reader`` and its ``Reporter``). Every
part of the spool that reads the log sequentially reads it here: recovery,
the admin reads, ``spoolctl``, the runners, the Spark data source. So they
all agree on where the log ends and on what is damaged, because the decision
is made once (``spool.read.anomaly``), with the same segment, offset and reason for
every consumer.

A walk yields ``Frame`` objects in log order and, in their place, ``Anomaly``
records (see ``spool.read.anomaly.Kind``). The consumer decides what an anomaly
means to it: recovery hands it to its damage policy (``spool.engine.recovery``;
today it raises ``anomaly.error()``), the runners raise it, ``spoolctl
verify`` lists them, the Spark source turns them into error rows. A
damaged record is followed by a resynchronisation on the next frame whose
checksum passes, so one bad byte never hides the rest of the log.
``frames(reporter=...)`` is the LevelDB shape: good frames out, anomalies to
a callback.

What the caller knows and the reader cannot:

- ``durable``: a position known durable (a checkpoint's head, a writer's
  durable end). Nothing before it can be a torn tail, and a segment that ends
  before it has lost records (``ENDS_EARLY``).
- ``expect_first``: the oldest segment that must exist (from the checkpoint:
  segments before it may have been reclaimed, none after), unless the log
  began later: a first segment whose header records no predecessor
  (``prev_size`` 0) is where the log began, and nothing before it is missing
  (a spool made by ``Spool.create(first_segment=N)``, as ``spoolctl salvage``
  makes them, begins at N).
- ``segments``: the ids that make up the log, as listed when the caller
  looked (default: listed now). The last one is the only one whose tail may
  be torn. A listed segment that vanishes while we read, with no older one
  left, was reclaimed by a running relay: that is not an anomaly; a gap is.

Memory: one window (``WINDOW``, 1 MiB) per walk, grown to one frame for a
frame larger than that; the error path reads in windows too.

Two walks. ``read`` checks every frame (checksum included) and copies each
payload. ``HeaderWalk`` is the runners': it decides from the 16-byte headers,
skips a body larger than its window with a seek, and checks and copies only
the records it selects; on anything implausible it asks ``classify_at`` for
the anomaly that covers the place, so a runner names the same segment and
offset as ``spoolctl verify``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Final, Generic, TypeVar

from spool.errors import CorruptRecord, CorruptSegment, FormatVersionError, UnknownRecordType
from spool.fileio import FileIO, read_exact
from spool.format.record import (
    GARBAGE,
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD,
    Frame,
    Payload,
    RecordType,
    check_frame,
    decode_payload,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import (
    SEGMENT_HEADER_SIZE,
    list_segments,
    read_frame_at,
    segment_header_fields,
    segment_path,
)
from spool.read.anomaly import (
    WINDOW,
    Anomaly,
    BufferSource,
    FileSource,
    Kind,
    Source,
    all_zero,
    classify,
    whole_record,
)

Reporter = Callable[[Anomaly], None]
R = TypeVar("R")
MakeRecord = Callable[[int, int, int, int, int, bytes], R]  # (pos, type, flags, class, time, payload) -> record
_ENVELOPE: Final = int(RecordType.ENVELOPE)
_MAX_TYPE: Final = max(int(t) for t in RecordType)
_unpack = HEADER.unpack_from
_length = struct.Struct("<4xI").unpack_from  # a frame header's length field alone


def raise_anomaly(anomaly: Anomaly) -> None:
    """The reporter of a consumer that stops at the first anomaly: raise what the engine always raised."""
    raise anomaly.error()


class LogReader:
    """Read-only access to the segments of one log directory. Never writes, never takes a lock."""

    def __init__(self, io: FileIO, log_dir: str, *, segments: Sequence[int] | None = None,
                 durable: int | None = None, expect_first: int | None = None, window: int = WINDOW,
                 paths: Mapping[int, str] | None = None) -> None:
        self.io = io
        self.log_dir = log_dir
        self.paths = paths or {}
        self.durable = durable
        self.expect_first = expect_first
        self.window = window
        self._listed: tuple[int, ...] | None = None if segments is None else tuple(sorted(segments))
        self._began: tuple[int, bool] | None = None  # (the first segment, whether its header says the log began there)
        self.bytes_read = 0
        self.records = 0

    # -- the sequence of segments -------------------------------------------------

    @property
    def segments(self) -> tuple[int, ...]:
        """The segment ids that make up the log (listed on first use when not given)."""
        if self._listed is None:
            self._listed = tuple(list_segments(self.io, self.log_dir))
        return self._listed

    @property
    def last(self) -> int | None:
        """The last segment: the only one whose tail may be torn."""
        return self.segments[-1] if self.segments else None

    def path(self, seg: int) -> str:
        """The file of ``seg``: as given in ``paths`` (a log spread over directories: an archive and
        the log of one spool), else in ``log_dir``."""
        return self.paths.get(seg) or segment_path(self.log_dir, seg)

    def _first_wanted(self) -> int:
        first = self.segments[0] if self.segments else (self.expect_first or 1)
        if self.expect_first is None or self.expect_first >= first or self._began_log(first):
            return first
        return self.expect_first

    def _began_log(self, seg: int) -> bool:
        """Does ``seg``'s header say that no segment came before it (``prev_size`` 0)? Read once."""
        if self._began is None or self._began[0] != seg:
            self._began = (seg, self._recorded_size(seg) == 0)
        return self._began[1]

    def _last_wanted(self) -> int:
        last = self.last if self.last is not None else self._first_wanted()
        return max(last, pos_segment(self.durable)) if self.durable is not None else last

    def segment_ids(self) -> range:
        """Every id a whole-log walk visits: the listed segments, and those that should be there."""
        return range(self._first_wanted(), self._last_wanted() + 1)

    def missing(self) -> list[Anomaly]:
        """Segments the log should hold and does not: gaps, a missing first (``expect_first``) or last
        (``durable``) segment. From the listing alone; ``read`` reports the same ones as it meets them."""
        listed = set(self.segments)
        return [self._missing(seg) for seg in self.segment_ids() if seg not in listed]

    def missing_segment(self, seg: int) -> Anomaly:
        """The anomaly of ``seg``, found missing by someone who expected it (a runner at its position)."""
        return self._missing(seg)

    def _missing(self, seg: int) -> Anomaly:
        listed = self.segments
        before = [s for s in listed if s < seg]
        after = [s for s in listed if s > seg]
        if before and after:
            why = f"segment {seg} is missing between {before[-1]} and {after[0]}"
        elif self.durable is not None and seg <= pos_segment(self.durable) and not after:
            why = f"segment {seg} is missing, but the position {pos_segment(self.durable)}:" \
                  f"{pos_offset(self.durable)} known durable lies in or after it"
        elif self.expect_first is not None:
            why = f"segment {seg} is missing; the checkpoint needs every segment from {self.expect_first} on"
        else:
            why = f"segment {seg} is missing"
        return Anomaly(Kind.MISSING_SEGMENT, seg, self.path(seg), 0, 0, why)

    def _gone(self, seg: int) -> bool:
        """``seg`` is not there: was it lost (True), or reclaimed in front of us (False)?

        Segments are reclaimed oldest first, so a segment with an older one
        still present was lost. One that was listed and has vanished since,
        with nothing older left, was reclaimed while we read.
        """
        now = list_segments(self.io, self.log_dir)
        if any(s < seg for s in now):
            return True
        if seg in self.segments:
            return False
        return self.expect_first is not None and seg >= self.expect_first

    # -- the verifying walk ---------------------------------------------------------

    def read(self, start: int | None = None, end: int | None = None, *,
             types: Container[int] | None = None) -> Iterator[Frame | Anomaly]:
        """Every frame from ``start`` (a position; default: the first record of the log) to ``end``
        (default: the end of the last segment), checksums verified, with anomalies in their place.
        ``types``: yield only frames of those types (the others are checked and passed)."""
        lo = pos_segment(start) if start is not None else self._first_wanted()
        hi = pos_segment(end) if end is not None else self._last_wanted()
        for seg in range(lo, hi + 1):
            walk = self.segment(seg, pos_offset(start) if start is not None and seg == lo else None,
                                pos_offset(end) if end is not None and seg == hi else None, types=types)
            yield from walk

    def frames(self, start: int | None = None, end: int | None = None,
               reporter: Reporter = raise_anomaly, *, types: Container[int] | None = None) -> Iterator[Frame]:
        """``read`` with each anomaly handed to ``reporter`` (which may raise) instead of yielded."""
        for item in self.read(start, end, types=types):
            if isinstance(item, Anomaly):
                reporter(item)
            else:
                yield item

    def decoded(self, start: int | None = None, end: int | None = None, *,
                types: Container[int] | None = None) -> Iterator[tuple[Frame, Payload] | Anomaly]:
        """``read`` with each frame's payload decoded: a frame whose payload does not decode is yielded as a
        BAD_PAYLOAD anomaly in its place (``bad_payload``), so a consumer that decodes meets it as damage of
        that record, named like every other anomaly."""
        for item in self.read(start, end, types=types):
            if isinstance(item, Anomaly):
                yield item
                continue
            try:
                yield item, decode_payload(item.rtype, item.payload)
            except CorruptRecord as exc:
                yield bad_payload(item, self.path(pos_segment(item.pos)), exc)

    def segment(self, seg: int, start: int | None = None, end: int | None = None, *,
                payloads: bool = True, types: Container[int] | None = None) -> SegmentWalk[Frame]:
        """One segment from offset ``start`` (default: its header) to ``end`` (default: the end of the
        file, checked against the size its successor recorded). Iterate it; ``payloads=False`` yields
        anomalies only (finding where valid data ends without copying it); ``types`` yields only frames
        of those types (the others are checked and passed)."""
        return SegmentWalk(self, seg, start, end, payloads, types, Frame)

    def segment_as(self, seg: int, make: MakeRecord[R], *, types: Container[int] | None = None) -> SegmentWalk[R]:
        """``segment`` for a bulk reader that wants its own record shape: each valid frame is
        ``make(pos, type, flags, class, time, payload)``. Why: building a ``Frame`` costs more than
        checking the frame, and the Spark source builds columns, not objects."""
        return SegmentWalk(self, seg, None, None, True, types, make)

    def tail_from(self, seg: int) -> int | None:
        """From which offset of ``seg`` a failure may be a torn tail: only in the last segment, and only
        past ``durable`` (None: nowhere)."""
        d = self.durable
        if d is not None and pos_segment(d) > seg:
            return None
        if seg != self.last:
            return None
        return pos_offset(d) if d is not None and pos_segment(d) == seg else 0

    def log_end(self, start: int | None = None) -> tuple[int, list[Anomaly]]:
        """Where valid data ends in the last segment (read from ``start``, a position in it, or its
        first record), and the anomalies met on the way. A torn tail ends the log where it begins;
        damaged records are walked past (they are reported, the log goes on after them)."""
        last = self.last
        if last is None:
            return make_pos(self._first_wanted(), SEGMENT_HEADER_SIZE), []
        off = pos_offset(start) if start is not None and pos_segment(start) == last else None
        walk = self.segment(last, off, payloads=False)
        found = anomalies(walk)
        torn = [a for a in found if a.torn]
        if torn and torn[0].offset == 0 and len(self.segments) > 1:
            prev = self.segments[-2]
            return make_pos(prev, self.size(prev)), found  # a half-created last segment held nothing
        return make_pos(last, torn[0].offset if torn else walk.records_end), found

    def size(self, seg: int) -> int:
        """The size of ``seg``'s file now. Raises FileNotFoundError."""
        fd = self.io.open_read(self.path(seg))
        try:
            return self.io.size(fd)
        finally:
            self.io.close(fd)

    def sealed_size(self, seg: int, size: int) -> Anomaly | None:
        """A sealed segment of ``size`` bytes against what its successor's header recorded.

        A successor that is missing or holds no readable header yet proves
        nothing either way (its own header is its own anomaly).
        """
        prev = self._recorded_size(seg + 1)
        if not prev or prev == size:
            return None
        how = "truncated" if size < prev else "extended past its end (or overwritten)"
        return Anomaly(Kind.SIZE_MISMATCH, seg, self.path(seg), min(size, prev), abs(size - prev),
                       f"the segment is {size} bytes but segment {seg + 1} records it sealed at {prev} bytes: "
                       f"it was {how}")

    def _recorded_size(self, seg: int) -> int | None:
        """The sealed size of ``seg - 1`` that ``seg``'s header records (0: the log began at ``seg``); None
        when ``seg`` is not there or cannot be read (its own walk names that, not its predecessor's)."""
        path = self.path(seg)
        try:
            fd = self.io.open_read(path)
        except OSError:
            return None
        try:
            head = read_exact(self.io, fd, SEGMENT_HEADER_SIZE, 0)
        except OSError:
            return None
        finally:
            self.io.close(fd)
        try:
            return segment_header_fields(head, path, seg)[2]
        except (CorruptSegment, FormatVersionError):
            return None

    # -- the error path of header walks ------------------------------------------------

    def classify_at(self, seg: int, off: int, end: int, reason: str) -> Anomaly:
        """The anomaly that covers ``seg:off``, found by the verifying walk of the segment up to ``end``.

        For a walk that does not check every frame (``HeaderWalk``): it notices
        damage later than it begins (a damaged body is skipped by its intact
        length), so the place it noticed is not the place to name. ``end`` is
        durable: nothing before it is a torn tail.
        """
        reader = LogReader(self.io, self.log_dir, segments=self._listed, durable=make_pos(seg, end),
                           window=self.window, paths=self.paths)
        found = anomalies(reader.segment(seg, None, end, payloads=False))
        for a in found:
            if a.offset <= off < a.offset + max(a.length, 1):
                return a
        # No frame fails there: a record that passes its checksum and whose payload a consumer could not
        # decode (damage of that record alone), or the file changed under us (name the place noticed).
        frame = self._whole_frame(seg, off)
        if frame is not None:
            return whole_record(Kind.BAD_PAYLOAD, seg, self.path(seg), off, frame.size, frame.size + off + 1, reason)
        return Anomaly(Kind.DAMAGED_RECORD, seg, self.path(seg), off, end - off, reason)

    def _whole_frame(self, seg: int, off: int) -> Frame | None:
        """The frame at ``seg:off`` if it passes its checks, else None."""
        try:
            fd = self.io.open_read(self.path(seg))
        except OSError:
            return None
        try:
            return read_frame_at(self.io, fd, self.path(seg), seg, off)
        except (CorruptRecord, OSError):
            return None
        finally:
            self.io.close(fd)


class SegmentWalk(Generic[R]):
    """The verifying walk of one segment. Iterate it for frames and anomalies in file order.

    After (or during) the walk: ``valid_end``, the offset just past the last
    valid frame met (LevelDB's ``LastRecordOffset``); ``data_end``, where the
    segment's data ends (its size, or less: the sealed size its successor
    recorded, or the ``end`` asked for); ``records_end``, the same or less:
    where the zeros that end the log begin (format version 3's zeroed room).
    """

    def __init__(self, reader: LogReader, seg: int, start: int | None, end: int | None, payloads: bool,
                 types: Container[int] | None, make: MakeRecord[R]) -> None:
        self.reader = reader
        self.make = make
        self.seg = seg
        self.start = start
        self.end = end
        self.payloads = payloads
        self.types = types
        first = SEGMENT_HEADER_SIZE if start is None else max(start, SEGMENT_HEADER_SIZE)
        self.valid_end = first
        self.data_end = first
        self.zero_tail: int | None = None  # where the zeros that end the log begin, if the walk met them
        self.bytes_read = 0
        self.found = False  # the file was there (False: missing, or reclaimed while we read)

    @property
    def records_end(self) -> int:
        """Where the segment's records end: ``data_end``, or where the zeros that end the log begin."""
        return self.data_end if self.zero_tail is None else self.zero_tail

    def __iter__(self) -> Iterator[R | Anomaly]:
        r, seg = self.reader, self.seg
        path = r.path(seg)
        try:
            fd = r.io.open_read(path)
        except FileNotFoundError:
            if r._gone(seg):
                yield r._missing(seg)
            return
        self.found = True
        src = FileSource(r.io, fd, r.io.size(fd), r.window)
        try:
            size = self.data_end = src.size
            header = self._header(src, path)
            if header is not None:
                yield header
                if header.kind is not Kind.BAD_HEADER:
                    return
                if size <= SEGMENT_HEADER_SIZE:  # no record left: but say how much its successor says is gone
                    yield from self._bounds(path, size)[1]
                    return
            end, late = self._bounds(path, size)
            self.data_end = end
            walk = FrameWalk(seg, path, src, self.valid_end, end, self.make, tail_from=r.tail_from(seg),
                             payloads=self.payloads, types=self.types, window=r.window)
            try:
                yield from walk
            finally:
                self.valid_end = walk.valid_end
                if walk.zero_tail is not None:
                    self.zero_tail = walk.zero_tail
                r.records += walk.records
            yield from late
        finally:
            self.bytes_read = src.bytes_read
            r.bytes_read += src.bytes_read
            r.io.close(fd)

    def _bounds(self, path: str, size: int) -> tuple[int, list[Anomaly]]:
        """Where this walk's records end, and the anomalies of the segment's length (reported after its
        records, in offset order): a sealed size that disagrees with the successor's, an end before
        what is known durable."""
        r, seg = self.reader, self.seg
        end = size if self.end is None else min(self.end, size)
        late: list[Anomaly] = []
        if self.end is None and seg != r.last:
            sealed = r.sealed_size(seg, size)
            if sealed is not None:
                late.append(sealed)
                end = min(end, sealed.offset)
        if r.durable is not None and pos_segment(r.durable) == seg and pos_offset(r.durable) > size:
            late.append(Anomaly(Kind.ENDS_EARLY, seg, path, size, pos_offset(r.durable) - size,
                                f"the segment ends at {size} bytes, before the position {pos_offset(r.durable)} "
                                "known durable: durable records are gone"))
        return end, late

    def _header(self, src: FileSource, path: str) -> Anomaly | None:
        """The header's anomaly, if any. A half-created last segment (short or all zeros) is a torn tail."""
        r, seg, size = self.reader, self.seg, src.size
        head = src.read(0, SEGMENT_HEADER_SIZE)
        try:
            segment_header_fields(head, path, seg)
            return None
        except FormatVersionError as exc:
            return Anomaly(Kind.NEWER_FORMAT, seg, path, 0, size, str(exc).removeprefix(f"{path}: "))
        except CorruptSegment as exc:
            reason = exc.reason
        # A crash while creating the last segment leaves it short or all zeros: it held nothing. Not when
        # it is the only segment and the caller knows of durable data (the open keeps that one).
        if r.tail_from(seg) == 0 and not (r.durable is not None and len(r.segments) <= 1) \
                and (size < SEGMENT_HEADER_SIZE or all_zero(src, 0, size, r.window)):
            return Anomaly(Kind.TORN_TAIL, seg, path, 0, size, f"a half-created segment, its header never written "
                                                                  f"({reason})")
        return Anomaly(Kind.BAD_HEADER, seg, path, 0, min(size, SEGMENT_HEADER_SIZE), reason)


class FrameWalk(Generic[R]):
    """Frames of one source from ``off`` to ``end``, checked, with each failure classified in place.

    ``tail_from``: failures at or after this offset may be a torn tail (None:
    never). A damaged record is followed by the next valid frame; a torn tail
    or damage with nothing valid after it ends the walk.
    """

    def __init__(self, seg: int, path: str, src: Source, off: int, end: int, make: MakeRecord[R], *,
                 tail_from: int | None, payloads: bool = True, types: Container[int] | None = None,
                 window: int = WINDOW) -> None:
        self.make = make
        self.seg = seg
        self.path = path
        self.src = src
        self.off = off
        self.end = end
        self.tail_from = tail_from
        self.payloads = payloads
        self.types = types
        self.window = window
        self.valid_end = off
        self.zero_tail: int | None = None  # where the zeros that end the log begin, if the walk met them
        self.records = 0

    def __iter__(self) -> Iterator[R | Anomaly]:
        seg, src, end, payloads, types, make = self.seg, self.src, self.end, self.payloads, self.types, self.make
        seg_pos = make_pos(seg, 0)
        off = self.off
        buf, base, nbuf = b"", off, 0
        records = 0
        try:
            while off < end:  # the hot loop of every verifying reader: keep it short
                rel = off - base
                if rel + HEADER_SIZE > nbuf:
                    buf, base = src.window(off, HEADER_SIZE)
                    nbuf, rel = len(buf), off - base
                size = HEADER_SIZE + _length(buf, rel)[0] if rel + HEADER_SIZE <= nbuf else 0
                if HEADER_SIZE <= size <= HEADER_SIZE + MAX_PAYLOAD and off + size <= end:
                    if rel + size > nbuf:
                        buf, base = src.window(off, size)
                        nbuf, rel = len(buf), off - base
                    try:
                        rtype, flags, klass, t, _e = check_frame(seg, buf, rel)
                    except UnknownRecordType as exc:
                        # Written whole (its checksum passes): damage of this record only, read on after it.
                        records += 1
                        yield whole_record(Kind.UNKNOWN_TYPE, seg, self.path, off, size, end, exc.reason)
                        off += size
                        self.valid_end = off
                        continue
                    except CorruptRecord:
                        pass
                    else:
                        records += 1
                        if payloads and (types is None or rtype in types):
                            yield make(seg_pos | off, rtype, flags, klass, t, buf[rel + HEADER_SIZE : rel + size])
                        off += size
                        self.valid_end = off
                        continue
                tail_ok = self.tail_from is not None and off >= self.tail_from
                if tail_ok and all_zero(src, off, end, self.window):
                    # Nothing but zeros from here to the end: the writer's zeroed room (format version 3),
                    # or a write that never reached the disk past the last record. The log ends here, cleanly.
                    self.zero_tail = off
                    return
                anomaly = classify(seg, self.path, src, off, end, tail_ok=tail_ok, window=self.window)
                yield anomaly
                if anomaly.resume is None:
                    return
                off = anomaly.resume
        finally:
            self.records += records


def bad_payload(frame: Frame, path: str, exc: CorruptRecord) -> Anomaly:
    """The anomaly of a frame that passed its checksum but whose payload does not decode (``exc``, from
    ``decode_payload``): every consumer that decodes a payload names it so, and treats it as damage of
    that record alone."""
    seg, off = pos_segment(frame.pos), pos_offset(frame.pos)
    return whole_record(Kind.BAD_PAYLOAD, seg, path, off, frame.size, off + frame.size + 1, exc.reason)


def check_buffer(seg: int, data: bytes | memoryview, start: int, path: str, *, last: bool) -> list[Anomaly]:
    """The anomalies of the frames in ``data`` from offset ``start`` on: a segment read whole, or its tail
    read from a sector boundary. ``last``: the buffer ends the log, so its tail may be torn."""
    src = BufferSource(data)
    return anomalies(FrameWalk(seg, path, src, start, src.size, Frame, tail_from=start if last else None,
                               payloads=False))


def anomalies(items: Iterable[object]) -> list[Anomaly]:
    """The anomalies of a walk (run to its end), frames dropped."""
    return [a for a in items if isinstance(a, Anomaly)]


# -- the runners' walk -------------------------------------------------------------------


class HeaderWalk:
    """Header-only walk for the runners: 16-byte headers decide, bodies are skipped, picks are verified.

    Keeps its descriptor and window between calls: a runner comes back to
    where it stopped. ``records`` counts headers decided, ``bytes_read`` bytes
    read. Anomalies go to ``reporter``; if it returns, the walk goes on where
    valid records resume (or at the end of the segment).
    """

    def __init__(self, reader: LogReader, reporter: Reporter = raise_anomaly) -> None:
        self.reader = reader
        self.io = reader.io
        self.reporter = reporter
        self.records = 0
        self.bytes_read = 0
        self._fd = -1
        self._fd_seg = -1
        self._buf = b""
        self._buf_start = 0

    def close(self) -> None:
        if self._fd >= 0:
            self.io.close(self._fd)
            self._fd = -1
            self._fd_seg = -1

    def _window(self, seg: int, off: int, end: int, need: int) -> None:
        """Make the buffer start at ``off`` with at least ``need`` bytes (bounded by end)."""
        if self._fd_seg != seg:
            self.close()
            self._fd = self.io.open_read(self.reader.path(seg))
            self._fd_seg = seg
            self._check_header(seg)
        size = min(max(need, self.reader.window), end - off)
        self._buf = read_exact(self.io, self._fd, size, off)
        self._buf_start = off
        self.bytes_read += len(self._buf)

    def _check_header(self, seg: int) -> None:
        """Report the header of ``seg``, just opened, if it fails its checks (one 32-byte read per segment):
        a runner passes every record of the segment, so it meets a damaged header as the verifying walk
        does. The records after it are read all the same."""
        path = self.reader.path(seg)
        head = read_exact(self.io, self._fd, SEGMENT_HEADER_SIZE, 0)
        self.bytes_read += len(head)
        try:
            segment_header_fields(head, path, seg)
        except FormatVersionError as exc:
            self.reporter(Anomaly(Kind.NEWER_FORMAT, seg, path, 0, self.io.size(self._fd),
                                  str(exc).removeprefix(f"{path}: ")))
        except CorruptSegment as exc:
            self.reporter(Anomaly(Kind.BAD_HEADER, seg, path, 0, len(head), exc.reason))

    def _report(self, seg: int, off: int, end: int, reason: str) -> int:
        """Classify and report the damage noticed at ``off``; returns where to go on."""
        anomaly = self.reader.classify_at(seg, off, end, reason)
        self.reporter(anomaly)
        self._buf = b""
        resume = anomaly.resume
        return resume if resume is not None and resume > off else end

    def select(self, seg: int, off: int, end: int, *, until: float, classes: Container[int],
               skip: Container[int], limit: int, out: list[Frame]) -> tuple[int, int | None]:
        """Walk ``seg`` from ``off`` to ``end``; append each live (not garbage) ENVELOPE whose class is in
        ``classes`` and whose position is not in ``skip``, checksum verified, to ``out``.

        Stops at ``end``, when ``out`` holds ``limit`` frames, or at the first
        record appended after ``until`` (seconds). Returns the offset reached
        and, when a record stopped it for its time, that record's time.
        """
        while True:
            buf = self._buf
            base = self._buf_start
            rel = off - base
            if self._fd_seg != seg or rel < 0 or rel + HEADER_SIZE > len(buf):
                if off >= end:
                    return off, None
                if end - off < HEADER_SIZE:
                    off = self._report(seg, off, end, f"{end - off} stray bytes where a record header should be")
                else:
                    self._window(seg, off, end, HEADER_SIZE)
                continue
            avail = min(len(buf), end - base)
            scanned = 0
            stopped = bad = ""
            while rel + HEADER_SIZE <= avail:  # the hot loop: keep it short
                _crc, length, rtype, flags, klass, res, t = _unpack(buf, rel)
                if not 0 < rtype <= _MAX_TYPE or res or flags & ~GARBAGE:
                    stopped = "header"
                    break
                if t > until:
                    self.records += scanned
                    return base + rel, t
                size = HEADER_SIZE + length
                if rel + size > avail:
                    stopped = "size"
                    break
                scanned += 1
                if rtype == _ENVELOPE and not flags & GARBAGE and klass in classes \
                        and make_pos(seg, base + rel) not in skip:
                    try:
                        check_frame(seg, buf, rel)
                    except CorruptRecord as exc:
                        bad = exc.reason
                        break
                    out.append(Frame(make_pos(seg, base + rel), rtype, flags, klass, t,
                                     buf[rel + HEADER_SIZE : rel + size]))
                    if len(out) >= limit:
                        self.records += scanned
                        return base + rel + size, None
                rel += size
            self.records += scanned
            off = base + rel
            if bad:
                off = self._report(seg, off, end, bad)
            elif stopped:
                off = self._after_break(seg, off, end, buf, rel)

    def _after_break(self, seg: int, off: int, end: int, buf: bytes, rel: int) -> int:
        """The hot loop stopped at ``off`` for a reason other than the window's end: decide it here."""
        length: int
        rtype: int
        flags: int
        res: int
        _crc, length, rtype, flags, _klass, res, _t = _unpack(buf, rel)
        if not 0 < rtype <= _MAX_TYPE or res or flags & ~GARBAGE:
            # Zeroed or overwritten bytes: never pass them as if they were records.
            return self._report(seg, off, end, f"no valid record header (type {rtype})")
        size = HEADER_SIZE + length
        if length > MAX_PAYLOAD or off + size > end:
            return self._report(seg, off, end, f"length {length} runs past the end of the log")
        # A record larger than the rest of the window. A candidate envelope is read whole; anything
        # else (a large body) is skipped without reading it.
        if rtype == _ENVELOPE and not flags & GARBAGE:
            self._window(seg, off, end, size)
            return off
        self.records += 1
        self._buf = b""
        return off + size
