"""Segment files on disk: the header checks of spool/format/segment.py, and the torn-tail rules recovery applies
through the log reader (spool/read/reader.py, spool/read/anomaly.py)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spool.errors import CorruptSegment, FormatVersionError
from spool.fileio import OsFileIO
from spool.format.record import FLAGS_OFFSET, HEADER_SIZE, Envelope, Finish, RecordType, Start, encode_frame, make_pos
from spool.format.segment import (
    FORMAT_VERSION,
    SECTOR,
    SEGMENT_HEADER_SIZE,
    decode_segment_header,
    encode_segment_header,
    list_segments,
    parse_segment_name,
    read_segment_header,
    read_whole,
    segment_name,
)
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import LogReader

IO = OsFileIO()
SEG = 3


def data_frame(seg: int, n: int, fill: int = 0x61) -> bytes:
    return encode_frame(seg, RecordType.DATA, bytes([fill]) * n, time=1700000000)


def some_frames(seg: int) -> list[bytes]:
    env = Envelope(seg << 32 | 32, "a@example.org", ("b@example.net",), (), 0, 1)
    return [
        encode_frame(seg, RecordType.ENVELOPE, env.to_payload(), klass=1, time=5),
        data_frame(seg, 40),
        encode_frame(seg, RecordType.START, Start(env.message_id, 7).to_payload(), time=6),
        encode_frame(seg, RecordType.FINISH, Finish(env.message_id, 8).to_payload(), time=6),
    ]


def write_segment(tmp_path: Path, seg: int, body: bytes) -> tuple[str, bytes]:
    """Write header + body to the segment's file and read it back as the engine would."""
    path = tmp_path / segment_name(seg)
    path.write_bytes(encode_segment_header(seg, 1700000000) + body)
    return str(path), read_whole(IO, str(path))


def end_of(seg: int, path: str, *, last: bool) -> int:
    """Where recovery finds the segment's valid data to end (``Recovery.find_log_end``): a torn tail ends it,
    any other anomaly stops the open. ``last``: the segment is the last of the log (else a successor follows)."""
    reader = LogReader(IO, os.path.dirname(path), segments=(seg,) if last else (seg, seg + 1))
    walk = reader.segment(seg, payloads=False)
    for anomaly in walk:
        assert isinstance(anomaly, Anomaly)
        if not anomaly.torn:
            raise anomaly.error()
    return walk.valid_end


# -- a clean segment ---------------------------------------------------------------


def test_clean_segment_ends_at_its_size_last_or_not(tmp_path: Path) -> None:
    path, data = write_segment(tmp_path, SEG, b"".join(some_frames(SEG)))
    assert end_of(SEG, path, last=True) == len(data)
    assert end_of(SEG, path, last=False) == len(data)
    empty_path, _empty = write_segment(tmp_path / "", SEG + 1, b"")
    assert end_of(SEG + 1, empty_path, last=True) == SEGMENT_HEADER_SIZE


# -- torn tails of the last segment ---------------------------------------------------


@pytest.mark.parametrize("tail", range(4), ids=["envelope", "data", "start", "finish"])
def test_frame_cut_at_every_length_is_cut_off_in_the_last_segment(tmp_path: Path, tail: int) -> None:
    frames = some_frames(SEG)
    base = b"".join(frames[:tail] + frames[tail + 1 :])
    torn = frames[tail]
    good_end = SEGMENT_HEADER_SIZE + len(base)
    for n in range(len(torn)):
        path, data = write_segment(tmp_path, SEG, base + torn[:n])
        assert len(data) == good_end + n
        assert end_of(SEG, path, last=True) == good_end, f"cut after {n} bytes"
        if n:
            with pytest.raises(CorruptSegment) as info:
                end_of(SEG, path, last=False)
            assert (info.value.path, info.value.offset) == (path, good_end)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 700), min_size=1, max_size=6), data=st.data())
def test_torn_last_frame_of_random_sizes_is_cut_off(tmp_path: Path, sizes: list[int], data: st.DataObject) -> None:
    frames = [data_frame(SEG, n, fill=1 + i) for i, n in enumerate(sizes)]
    cut = data.draw(st.integers(1, len(frames[-1]) - 1))
    good_end = SEGMENT_HEADER_SIZE + sum(map(len, frames[:-1]))
    path, _buf = write_segment(tmp_path, SEG, b"".join(frames[:-1]) + frames[-1][:cut])
    assert end_of(SEG, path, last=True) == good_end
    reader = LogReader(IO, str(tmp_path), segments=(SEG,))
    got = reader.frames(make_pos(SEG, SEGMENT_HEADER_SIZE), make_pos(SEG, good_end))
    assert [f.payload for f in got] == [f[HEADER_SIZE:] for f in frames[:-1]]


def _frame_across_sector(seg: int, into: int, payload: int) -> tuple[bytes, int]:
    """Frames such that the last one starts ``into`` bytes before a sector boundary.

    Returns the body and the offset of the last frame.
    """
    first = encode_frame(seg, RecordType.START, Start(1, 2).to_payload())
    filler_payload = 2 * SECTOR - into - SEGMENT_HEADER_SIZE - len(first) - HEADER_SIZE
    body = first + data_frame(seg, filler_payload)
    start = SEGMENT_HEADER_SIZE + len(body)
    assert (start + into) % SECTOR == 0
    return body + data_frame(seg, payload, fill=0x7E), start


@pytest.mark.parametrize("into", [*range(1, HEADER_SIZE + 1), 17, 100, 300])
def test_zeros_from_a_sector_boundary_inside_the_last_frame_are_a_torn_tail(tmp_path: Path, into: int) -> None:
    """The file grew but the last sector(s) of the write never reached the disk."""
    body, start = _frame_across_sector(SEG, into, 400)
    boundary = start + into - SEGMENT_HEADER_SIZE
    zeroed = body[:boundary] + bytes(len(body) - boundary)
    path, data = write_segment(tmp_path, SEG, zeroed)
    assert len(data) == SEGMENT_HEADER_SIZE + len(body)
    assert end_of(SEG, path, last=True) == start
    with pytest.raises(CorruptSegment) as info:
        end_of(SEG, path, last=False)
    assert info.value.offset == start


def test_zeros_after_the_last_frame_up_to_a_preallocated_size_are_the_clean_end(tmp_path: Path) -> None:
    """Format version 3's zeroed room (or a write that never came): no anomaly at all, the log ends there."""
    body = b"".join(some_frames(SEG))
    path, _data = write_segment(tmp_path, SEG, body + bytes(4096))
    assert end_of(SEG, path, last=True) == SEGMENT_HEADER_SIZE + len(body)
    reader = LogReader(IO, str(tmp_path), segments=(SEG,))
    assert [a for a in reader.read() if isinstance(a, Anomaly)] == []
    assert reader.log_end()[0] == make_pos(SEG, SEGMENT_HEADER_SIZE + len(body))


def test_zeros_not_reaching_back_to_a_sector_boundary_are_corruption(tmp_path: Path) -> None:
    """A complete last frame whose final bytes read as zero, inside one sector: damage, not a torn write."""
    frames = some_frames(SEG)
    last = bytearray(frames[-1])
    last[-4:] = bytes(4)
    body = b"".join(frames[:-1]) + bytes(last)
    start = SEGMENT_HEADER_SIZE + len(body) - len(last)
    assert start // SECTOR == (start + len(last)) // SECTOR  # no sector boundary inside it
    path, _data = write_segment(tmp_path, SEG, body)
    with pytest.raises(CorruptSegment) as info:
        end_of(SEG, path, last=True)
    assert (info.value.path, info.value.offset) == (path, start)


def test_complete_last_frame_with_a_flipped_bit_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    frames = some_frames(SEG)
    last = bytearray(frames[-1])
    last[HEADER_SIZE + 2] ^= 0x10
    path, data = write_segment(tmp_path, SEG, b"".join(frames[:-1]) + bytes(last))
    start = len(data) - len(last)
    with pytest.raises(CorruptSegment, match="checksum mismatch") as info:
        end_of(SEG, path, last=True)
    assert info.value.offset == start


# -- damage in the middle -------------------------------------------------------------


@pytest.mark.parametrize("last", [True, False])
def test_bit_flip_in_a_middle_record_names_path_and_offset(tmp_path: Path, last: bool) -> None:
    frames = some_frames(SEG)
    offsets = [SEGMENT_HEADER_SIZE + sum(map(len, frames[:i])) for i in range(len(frames))]
    body = b"".join(frames)
    for victim in range(len(frames) - 1):
        rel = offsets[victim] - SEGMENT_HEADER_SIZE
        # Every header byte, and a spread of payload bytes (each flip is a file write).
        for i in [*range(HEADER_SIZE), *range(HEADER_SIZE, len(frames[victim]), 5)]:
            if i == FLAGS_OFFSET:
                continue
            bad = bytearray(body)
            bad[rel + i] ^= 1 << (i % 8)
            path, _data = write_segment(tmp_path, SEG, bytes(bad))
            with pytest.raises(CorruptSegment) as info:
                end_of(SEG, path, last=last)
            assert (info.value.path, info.value.offset) == (path, offsets[victim]), (victim, i)
            assert path in str(info.value)
            assert f"offset {offsets[victim]}" in str(info.value)
            assert "valid records follow" in str(info.value)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 300), min_size=2, max_size=6), data=st.data())
def test_any_damaged_frame_followed_by_valid_ones_stops_the_open(tmp_path: Path, sizes: list[int],
                                                                 data: st.DataObject) -> None:
    frames = [data_frame(SEG, n, fill=1 + i) for i, n in enumerate(sizes)]
    victim = data.draw(st.integers(0, len(frames) - 2))
    offset = SEGMENT_HEADER_SIZE + sum(map(len, frames[:victim]))
    i = data.draw(st.integers(0, len(frames[victim]) - 1).filter(lambda k: k != FLAGS_OFFSET))
    bit = data.draw(st.integers(0, 7))
    body = bytearray(b"".join(frames))
    body[offset - SEGMENT_HEADER_SIZE + i] ^= 1 << bit
    path, _buf = write_segment(tmp_path, SEG, bytes(body))
    with pytest.raises(CorruptSegment) as info:
        end_of(SEG, path, last=True)
    assert (info.value.path, info.value.offset) == (path, offset)


def test_torn_tail_of_a_segment_that_is_not_the_last_is_corruption(tmp_path: Path) -> None:
    frames = some_frames(SEG)
    body = b"".join(frames)
    path, _data = write_segment(tmp_path, SEG, body + frames[0][:HEADER_SIZE + 3])
    assert end_of(SEG, path, last=True) == SEGMENT_HEADER_SIZE + len(body)
    with pytest.raises(CorruptSegment) as info:
        end_of(SEG, path, last=False)
    assert (info.value.path, info.value.offset) == (path, SEGMENT_HEADER_SIZE + len(body))
    zero_path, _zeros = write_segment(tmp_path, SEG + 1, encode_frame(SEG + 1, 5, b"x") + bytes(100))
    with pytest.raises(CorruptSegment):
        end_of(SEG + 1, zero_path, last=False)


def test_frames_of_another_segment_are_not_a_valid_tail(tmp_path: Path) -> None:
    """Stale frames salted for another segment id count as damage, however they are placed."""
    mine = b"".join(some_frames(SEG))
    stale = b"".join(some_frames(SEG + 1))
    path, _data = write_segment(tmp_path, SEG, mine + stale)
    with pytest.raises(CorruptSegment, match="checksum mismatch") as info:
        end_of(SEG, path, last=True)
    assert info.value.offset == SEGMENT_HEADER_SIZE + len(mine)


# -- the header ------------------------------------------------------------------------


def _header(**fields: int | bytes) -> bytes:
    values: dict[str, int | bytes] = {"magic": b"LSPOOLSG", "version": FORMAT_VERSION, "hdr_size": 32,
                                      "prev_size": 0, "seg": SEG, "created": 99}
    values.update(fields)
    body = struct.pack("<8sHHIQI", values["magic"], values["version"], values["hdr_size"], values["prev_size"],
                       values["seg"], values["created"])
    return body + struct.pack("<I", crc32c(body))


def _write(tmp_path: Path, seg: int, header: bytes) -> str:
    path = tmp_path / segment_name(seg)
    path.write_bytes(header + data_frame(seg, 3))
    return str(path)


def test_header_layout_matches_the_document(tmp_path: Path) -> None:
    assert encode_segment_header(SEG, 99) == _header()
    path = _write(tmp_path, SEG, _header())
    assert read_segment_header(IO, path, SEG) == (SEG, 99)


def test_bad_magic_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, SEG, _header(magic=b"LSPOOLSX"))
    with pytest.raises(CorruptSegment, match="bad magic") as info:
        read_segment_header(IO, path, SEG)
    assert (info.value.path, info.value.offset) == (path, 0)


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_unknown_version_raises_format_version_error(tmp_path: Path, version: int) -> None:
    path = _write(tmp_path, SEG, _header(version=version))
    with pytest.raises(FormatVersionError, match=f"version {version}") as info:
        read_segment_header(IO, path, SEG)
    assert path in str(info.value)
    assert not isinstance(info.value, CorruptSegment)


def test_every_bit_flip_in_the_header_is_refused(tmp_path: Path) -> None:
    good = encode_segment_header(SEG, 99)
    for i in range(SEGMENT_HEADER_SIZE):
        for bit in range(8):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            with pytest.raises(CorruptSegment):
                decode_segment_header(bytes(bad), "f", SEG)


def test_header_checksum_mismatch_is_refused(tmp_path: Path) -> None:
    bad = bytearray(_header())
    bad[24] ^= 1  # created
    path = _write(tmp_path, SEG, bytes(bad))
    with pytest.raises(CorruptSegment, match="checksum mismatch"):
        read_segment_header(IO, path, SEG)


def test_header_size_must_be_32(tmp_path: Path) -> None:
    path = _write(tmp_path, SEG, _header(hdr_size=48))
    with pytest.raises(CorruptSegment, match="unknown size"):
        read_segment_header(IO, path, SEG)


def test_prev_size_records_the_sealed_length_of_the_previous_segment(tmp_path: Path) -> None:
    """Version 2: a sealed segment cut at a record boundary no longer looks whole."""
    from spool.format.segment import segment_header_fields

    assert segment_header_fields(encode_segment_header(SEG, 99, 4096), "f", SEG) == (SEG, 99, 4096)
    (tmp_path / segment_name(SEG + 1)).write_bytes(encode_segment_header(SEG + 1, 99, 4096))
    reader = LogReader(IO, str(tmp_path), segments=())
    assert reader.sealed_size(SEG, 4096) is None
    mismatch = reader.sealed_size(SEG, 4000)
    assert mismatch is not None and mismatch.kind is Kind.SIZE_MISMATCH
    assert "sealed at 4096" in mismatch.reason and mismatch.path.endswith(segment_name(SEG))
    assert (mismatch.offset, mismatch.length) == (4000, 96)


def test_segment_id_must_match_the_file_name(tmp_path: Path) -> None:
    path = _write(tmp_path, SEG, _header(seg=SEG + 1))
    with pytest.raises(CorruptSegment, match="does not match") as info:
        read_segment_header(IO, path, SEG)
    assert (info.value.path, info.value.offset) == (path, 16)
    assert read_segment_header(IO, path) == (SEG + 1, 99)  # without an expectation it is a valid header


def test_truncated_header_is_refused(tmp_path: Path) -> None:
    for n in range(SEGMENT_HEADER_SIZE):
        path = tmp_path / segment_name(SEG)
        path.write_bytes(encode_segment_header(SEG, 99)[:n])
        with pytest.raises(CorruptSegment, match="truncated"):
            read_segment_header(IO, str(path), SEG)


# -- names ------------------------------------------------------------------------------


def test_segment_names_are_16_hex_digits(tmp_path: Path) -> None:
    assert segment_name(1) == "0000000000000001.seg"
    assert segment_name(2**64 - 1) == "ffffffffffffffff.seg"
    assert parse_segment_name("00000000000000ab.seg") == 0xAB
    for junk in ["1.seg", "00000000000000ab.seg.tmp", "0000000000000zzz.seg", "00000000000000ab.log"]:
        assert parse_segment_name(junk) is None
    for name in ["0000000000000010.seg", "0000000000000002.seg", "checkpoint", "0000000000000003.seg.tmp"]:
        (tmp_path / name).write_bytes(b"")
    assert list_segments(IO, str(tmp_path)) == [2, 16]


def test_only_canonical_segment_names_are_segments(tmp_path: Path) -> None:
    """parse_segment_name once took anything int(_, 16) takes: "0x00000000000001.seg", "+000000000000001.seg",
    "0000_0000_0000_1.seg", upper case; list_segments then listed an id twice, or one whose path does not exist."""
    for odd in ["0x00000000000001.seg", "+000000000000001.seg", " 000000000000001.seg", "0000_0000_0000_1.seg",
                "000000000000000A.seg"]:
        assert parse_segment_name(odd) is None, odd
        (tmp_path / odd).write_bytes(b"")
    (tmp_path / segment_name(1)).write_bytes(b"")
    assert list_segments(IO, str(tmp_path)) == [1]
