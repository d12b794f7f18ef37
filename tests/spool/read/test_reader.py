"""The log reader (spool/read/reader.py) and its one classification of anomalies (spool/read/anomaly.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from crc32c import crc32c

from spool.errors import CorruptSegment, FormatVersionError
from spool.fileio import OsFileIO
from spool.format.record import HEADER_SIZE, Envelope, Frame, RecordType, encode_frame, make_pos, pos_offset
from spool.format.segment import SEGMENT_HEADER, SEGMENT_HEADER_SIZE, encode_segment_header, segment_name
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import HeaderWalk, LogReader, anomalies

T = 1_700_000_000


class CountingIO(OsFileIO):
    """Real files; remembers the largest single read, to check that memory stays bounded."""

    def __init__(self) -> None:
        self.largest = 0

    def read(self, fd: int, size: int, offset: int) -> bytes:
        self.largest = max(self.largest, size)
        return super().read(fd, size, offset)


def envelope(seg: int, i: int, klass: int = 0, time: int = T) -> bytes:
    env = Envelope(make_pos(seg, 32), f"s{i}@example.org", ("r@example.net",), (), 0, 1)
    return encode_frame(seg, RecordType.ENVELOPE, env.to_payload(), klass=klass, time=time)


def data(seg: int, n: int, fill: int = 0x61) -> bytes:
    return encode_frame(seg, RecordType.DATA, bytes([fill]) * n, time=T)


def write(d: Path, seg: int, frames: list[bytes], prev: int = 0) -> list[int]:
    """Write a segment; returns the offset of each frame."""
    body = encode_segment_header(seg, T, prev)
    offsets = []
    for f in frames:
        offsets.append(len(body))
        body += f
    (d / segment_name(seg)).write_bytes(body)
    return offsets


def size_of(d: Path, seg: int) -> int:
    return (d / segment_name(seg)).stat().st_size


def where(items: list[Anomaly]) -> list[tuple[Kind, int, int]]:
    return [(a.kind, a.segment, a.offset) for a in items]


def flip(d: Path, seg: int, off: int) -> None:
    p = d / segment_name(seg)
    b = bytearray(p.read_bytes())
    b[off] ^= 0x10
    p.write_bytes(bytes(b))


def chain(d: Path, n: int, frames_per: int = 5) -> dict[int, list[int]]:
    """Segments 1..n, each recording its predecessor's sealed size."""
    offsets = {}
    prev = 0
    for seg in range(1, n + 1):
        offsets[seg] = write(d, seg, [envelope(seg, i) for i in range(frames_per)], prev)
        prev = size_of(d, seg)
    return offsets


def test_a_clean_log_reads_back_in_order_with_positions(tmp_path: Path) -> None:
    offsets = chain(tmp_path, 3)
    reader = LogReader(OsFileIO(), str(tmp_path))
    items = list(reader.read())
    assert all(isinstance(i, Frame) for i in items)
    assert [i.pos for i in items if isinstance(i, Frame)] == [make_pos(s, o) for s in (1, 2, 3) for o in offsets[s]]
    assert reader.log_end() == (make_pos(3, size_of(tmp_path, 3)), [])
    assert reader.missing() == []


def test_a_damaged_record_is_reported_and_reading_resumes_at_the_next_valid_frame(tmp_path: Path) -> None:
    offsets = chain(tmp_path, 2)
    flip(tmp_path, 1, offsets[1][2] + HEADER_SIZE + 3)
    items = list(LogReader(OsFileIO(), str(tmp_path)).read())
    [bad] = anomalies(items)
    assert (bad.kind, bad.segment, bad.offset, bad.resume) == (Kind.DAMAGED_RECORD, 1, offsets[1][2], offsets[1][3])
    assert bad.length == offsets[1][3] - offsets[1][2] and "checksum" in bad.reason
    assert len([i for i in items if isinstance(i, Frame)]) == 9  # every other record
    err = bad.error()
    assert isinstance(err, CorruptSegment) and (err.path, err.offset) == (bad.path, bad.offset)
    assert "valid records follow" in str(err)


def test_a_torn_tail_only_at_the_end_of_the_last_segment_and_only_past_what_is_durable(tmp_path: Path) -> None:
    offsets = chain(tmp_path, 2)
    cut = offsets[2][-1] + 7
    with open(tmp_path / segment_name(2), "r+b") as f:
        f.truncate(cut)
    torn = anomalies(LogReader(OsFileIO(), str(tmp_path)).read())
    assert where(torn) == [(Kind.TORN_TAIL, 2, offsets[2][-1])] and not torn[0].kind.damage
    assert LogReader(OsFileIO(), str(tmp_path)).log_end()[0] == make_pos(2, offsets[2][-1])
    # The same bytes, but a checkpoint said they were durable: damage, not a crash's tail.
    durable = LogReader(OsFileIO(), str(tmp_path), durable=make_pos(2, cut + 50))
    assert where(anomalies(durable.read())) == [(Kind.DAMAGED_RECORD, 2, offsets[2][-1]), (Kind.ENDS_EARLY, 2, cut)]
    # The same cut in a segment that is not the last: damage, and its successor says it was truncated.
    chain(tmp_path, 3)
    with open(tmp_path / segment_name(2), "r+b") as f:
        f.truncate(cut)
    assert where(anomalies(LogReader(OsFileIO(), str(tmp_path)).read())) == [
        (Kind.DAMAGED_RECORD, 2, offsets[2][-1]), (Kind.SIZE_MISMATCH, 2, cut)]


def test_an_extended_sealed_segment_is_read_only_to_its_sealed_size(tmp_path: Path) -> None:
    offsets = chain(tmp_path, 2)
    sealed = size_of(tmp_path, 1)
    with open(tmp_path / segment_name(1), "ab") as f:
        f.write(envelope(1, 99))  # a valid frame, but past what segment 2's header recorded
    items = list(LogReader(OsFileIO(), str(tmp_path)).read())
    assert where(anomalies(items)) == [(Kind.SIZE_MISMATCH, 1, sealed)]
    assert "extended" in anomalies(items)[0].reason
    assert [i.pos for i in items if isinstance(i, Frame)][:5] == [make_pos(1, o) for o in offsets[1]]
    assert len([i for i in items if isinstance(i, Frame)]) == 10


def test_missing_segments_gaps_and_what_the_checkpoint_needs(tmp_path: Path) -> None:
    chain(tmp_path, 5)
    (tmp_path / segment_name(3)).unlink()
    (tmp_path / segment_name(1)).unlink()
    plain = LogReader(OsFileIO(), str(tmp_path))
    assert where(plain.missing()) == [(Kind.MISSING_SEGMENT, 3, 0)]  # a gap; 1 may have been reclaimed
    assert "between 2 and 4" in plain.missing()[0].reason
    told = LogReader(OsFileIO(), str(tmp_path), expect_first=1)
    assert where(anomalies(told.read())) == [(Kind.MISSING_SEGMENT, 1, 0), (Kind.MISSING_SEGMENT, 3, 0)]
    head_gone = LogReader(OsFileIO(), str(tmp_path), durable=make_pos(6, 100))
    assert where(head_gone.missing()) == [(Kind.MISSING_SEGMENT, 3, 0), (Kind.MISSING_SEGMENT, 6, 0)]


def test_no_segment_is_missing_before_the_one_whose_header_says_the_log_began_there(tmp_path: Path) -> None:
    """A log that began at segment 7 (``Spool.create(first_segment=7)``, as ``spoolctl salvage`` makes):
    its header records no predecessor, so a checkpoint that "needs" 5 and 6 finds nothing missing."""
    write(tmp_path, 7, [envelope(7, 0)])
    write(tmp_path, 8, [envelope(8, 0)], size_of(tmp_path, 7))
    began = LogReader(OsFileIO(), str(tmp_path), expect_first=5)
    assert began.missing() == [] and anomalies(began.read()) == []
    (tmp_path / segment_name(7)).unlink()  # 8 records a predecessor: its loss is damage
    cut = LogReader(OsFileIO(), str(tmp_path), expect_first=5)
    assert where(cut.missing()) == [(Kind.MISSING_SEGMENT, s, 0) for s in (5, 6, 7)]


def test_a_middle_segment_cut_below_its_header_says_how_much_is_gone(tmp_path: Path) -> None:
    chain(tmp_path, 3)
    sealed = size_of(tmp_path, 2)
    for size in (0, 10):
        (tmp_path / segment_name(2)).write_bytes(encode_segment_header(2, T, size_of(tmp_path, 1))[:size])
        found = anomalies(LogReader(OsFileIO(), str(tmp_path)).read())
        assert where(found) == [(Kind.BAD_HEADER, 2, 0), (Kind.SIZE_MISMATCH, 2, size)]
        assert found[1].length == sealed - size and "truncated" in found[1].reason


def test_a_segment_reclaimed_while_we_read_is_not_an_anomaly(tmp_path: Path) -> None:
    chain(tmp_path, 3)
    reader = LogReader(OsFileIO(), str(tmp_path))  # lists 1, 2, 3
    walk = reader.read()
    first = next(walk)
    assert isinstance(first, Frame)
    (tmp_path / segment_name(2)).unlink()  # a running relay reclaims the front of the log
    (tmp_path / segment_name(1)).unlink()
    rest = list(walk)
    assert anomalies(rest) == []
    assert {i.pos >> 32 for i in rest if isinstance(i, Frame)} == {1, 3}  # segment 1 was already open


def test_segment_headers_damaged_newer_and_half_created(tmp_path: Path) -> None:
    offsets = chain(tmp_path, 3)
    with open(tmp_path / segment_name(2), "r+b") as f:
        f.write(b"NOTASPOO")
    found = anomalies(LogReader(OsFileIO(), str(tmp_path)).read())
    assert where(found) == [(Kind.BAD_HEADER, 2, 0)] and "bad magic" in found[0].reason
    frames = [i for i in LogReader(OsFileIO(), str(tmp_path)).read() if isinstance(i, Frame)]
    assert make_pos(2, offsets[2][0]) in {f.pos for f in frames}  # the records behind it are read

    newer = bytearray(encode_segment_header(2, T, size_of(tmp_path, 1)))
    newer[8] = 9  # version 9: a valid header of a format this reader does not know
    body = SEGMENT_HEADER.pack(*SEGMENT_HEADER.unpack(bytes(newer))[:-1], 0)[:28]
    (tmp_path / segment_name(2)).write_bytes(body + crc32c(body).to_bytes(4, "little") + envelope(2, 0))
    [a] = anomalies(LogReader(OsFileIO(), str(tmp_path)).read())
    assert a.kind is Kind.NEWER_FORMAT and isinstance(a.error(), FormatVersionError)

    (tmp_path / segment_name(3)).write_bytes(bytes(10))  # a crash while the last segment was created
    reader = LogReader(OsFileIO(), str(tmp_path))
    end, found = reader.log_end()
    assert where(found) == [(Kind.TORN_TAIL, 3, 0)] and end == make_pos(2, size_of(tmp_path, 2))


def test_the_error_path_reads_in_windows(tmp_path: Path) -> None:
    """Damage at the start of a 4 MiB segment with nothing valid after it: classified in bounded reads."""
    frames = [data(1, 60_000, fill=1 + i % 200) for i in range(70)]
    offsets = write(tmp_path, 1, frames)
    write(tmp_path, 2, [envelope(2, 0)], size_of(tmp_path, 1))
    p = tmp_path / segment_name(1)
    b = bytearray(p.read_bytes())
    for off in offsets[1:]:
        b[off + 8] = 0  # no type: nothing after the first frame can pass for a frame
    flip_at = offsets[0] + HEADER_SIZE + 100
    b[flip_at] ^= 1
    p.write_bytes(bytes(b))
    io = CountingIO()
    found = anomalies(LogReader(io, str(tmp_path), window=64 * 1024).read())
    assert where(found) == [(Kind.DAMAGED_RECORD, 1, offsets[0])] and found[0].resume is None
    assert found[0].length == len(b) - offsets[0]
    assert io.largest <= 64 * 1024 + HEADER_SIZE + 60_000


def test_the_header_walk_selects_skips_bodies_and_stops_at_time(tmp_path: Path) -> None:
    big = data(1, 300_000)
    frames = [envelope(1, 0, klass=0), big, envelope(1, 1, klass=1), envelope(1, 2, klass=0),
              envelope(1, 3, klass=0, time=T + 100)]
    offsets = write(tmp_path, 1, frames)
    walk = HeaderWalk(LogReader(OsFileIO(), str(tmp_path), window=4096))  # the body is larger: skipped
    out: list[Frame] = []
    try:
        off, too_new = walk.select(1, SEGMENT_HEADER_SIZE, size_of(tmp_path, 1), until=T + 50,
                                   classes=frozenset({0}), skip=(), limit=10, out=out)
    finally:
        walk.close()
    assert [f.pos for f in out] == [make_pos(1, offsets[0]), make_pos(1, offsets[3])]
    assert (off, too_new) == (offsets[4], T + 100)
    assert walk.bytes_read < 300_000 and walk.records == 4


def test_the_header_walk_names_damage_where_the_verifying_walk_does(tmp_path: Path) -> None:
    """Zeros inside a body are passed by its intact length; the walk notices them one record later,
    and names the body, as spoolctl verify does."""
    frames = [envelope(1, 0), data(1, 3000), envelope(1, 1), envelope(1, 2), envelope(1, 3)]
    offsets = write(tmp_path, 1, frames)
    p = tmp_path / segment_name(1)
    b = bytearray(p.read_bytes())
    b[offsets[1] + 2000 : offsets[3] + 10] = bytes(offsets[3] + 10 - offsets[1] - 2000)
    p.write_bytes(bytes(b))
    verifying = anomalies(LogReader(OsFileIO(), str(tmp_path)).read())
    assert where(verifying) == [(Kind.DAMAGED_RECORD, 1, offsets[1])] and verifying[0].resume == offsets[4]
    reported: list[Anomaly] = []
    walk = HeaderWalk(LogReader(OsFileIO(), str(tmp_path)), reporter=reported.append)
    out: list[Frame] = []
    try:
        walk.select(1, SEGMENT_HEADER_SIZE, len(b), until=T + 1, classes=frozenset({0}), skip=(), limit=10, out=out)
    finally:
        walk.close()
    assert reported == verifying  # the same anomaly, and the walk went on where valid records resume
    assert [f.pos for f in out] == [make_pos(1, offsets[0]), make_pos(1, offsets[4])]
    raising = HeaderWalk(LogReader(OsFileIO(), str(tmp_path)))
    with pytest.raises(CorruptSegment) as info:
        raising.select(1, SEGMENT_HEADER_SIZE, len(b), until=T + 1, classes=frozenset({0}), skip=(), limit=10,
                       out=[])
    raising.close()
    assert (info.value.path, info.value.offset) == (str(p), offsets[1])


def test_frames_hands_anomalies_to_the_reporter(tmp_path: Path) -> None:
    offsets = chain(tmp_path, 1)
    flip(tmp_path, 1, offsets[1][1] + HEADER_SIZE)
    seen: list[Anomaly] = []
    frames = list(LogReader(OsFileIO(), str(tmp_path)).frames(reporter=seen.append))
    assert len(frames) == 4 and where(seen) == [(Kind.DAMAGED_RECORD, 1, offsets[1][1])]
    with pytest.raises(CorruptSegment):
        list(LogReader(OsFileIO(), str(tmp_path)).frames())


def test_reading_from_a_position(tmp_path: Path) -> None:
    offsets = chain(tmp_path, 3)
    start = make_pos(2, offsets[2][3])
    got = [i.pos for i in LogReader(OsFileIO(), str(tmp_path)).read(start, make_pos(3, offsets[3][2]))
           if isinstance(i, Frame)]
    assert got == [make_pos(2, o) for o in offsets[2][3:]] + [make_pos(3, o) for o in offsets[3][:2]]
    assert pos_offset(got[0]) == offsets[2][3]
