"""The workers' marks files: their format, the writer, recovery's reader and the relay's collector.

Real files under tmp_path. The torn-tail cases build the bytes a crash can leave (a record's
write cut anywhere, the room's zeros after it); the damage cases flip bytes of a record that
has records after it. docs/format.md's worked example is compared byte for byte.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
from pathlib import Path

import pytest
from crc32c import crc32c

import spool
from spool.format.marks import (
    HEADER_SIZE,
    RECORD_HEAD_SIZE,
    Mark,
    MarksRead,
    encode_header,
    encode_mark,
    marks_dir,
    parse_marks,
)
from spool.read.marks import MarksCollector, marks_of, read_marks_dir
from spool.write.marks import MIN_ROOM, MarksWriter

DOC = Path(__file__).resolve().parents[3] / "docs" / "format.md"
FID = 0x0123456789ABCDEF
MARKS = [Mark(0x100000099, ("b@example.net",)), Mark(0x100000200, ("c@example.net", "d@example.net")),
         Mark(0x200000020, ("e@example.org",))]


def file_bytes(marks: list[Mark], room: int = 4096, file_id: int = FID) -> bytes:
    """A marks file as the writer leaves it: header, records, then zeros up to ``room``."""
    body = encode_header(file_id) + b"".join(encode_mark(file_id, m.start_pos, m.recipients) for m in marks)
    return body + bytes(room - len(body))


def record_offsets(marks: list[Mark]) -> list[int]:
    offsets, at = [], HEADER_SIZE
    for m in marks:
        offsets.append(at)
        at += len(encode_mark(FID, m.start_pos, m.recipients))
    return offsets


# -- the format ---------------------------------------------------------------


def test_round_trip() -> None:
    assert parse_marks("f", file_bytes(MARKS)) == MarksRead("f", tuple(MARKS), None)
    assert parse_marks("f", file_bytes(MARKS)[: record_offsets(MARKS)[-1] + 100]).marks == tuple(MARKS)


def test_zeroed_room_and_an_empty_file() -> None:
    assert parse_marks("f", file_bytes([])) == MarksRead("f", (), None)
    assert parse_marks("f", encode_header(FID)) == MarksRead("f", (), None)  # no room at all: still whole


@pytest.mark.parametrize("room", [True, False], ids=["zeros-after", "file-ends"])
def test_torn_tail_at_every_cut_of_the_last_record(room: bool) -> None:
    whole = file_bytes(MARKS)
    last = record_offsets(MARKS)[-1]
    size = len(encode_mark(FID, MARKS[-1].start_pos, MARKS[-1].recipients))
    for cut in range(size):
        data = whole[: last + cut] + (bytes(len(whole) - last - cut) if room else b"")
        assert parse_marks("f", data) == MarksRead("f", tuple(MARKS[:-1]), None), cut


@pytest.mark.parametrize("flip", [0x01, 0x80, 0xFF])
def test_a_flipped_byte_in_a_middle_record_is_damage(flip: int) -> None:
    whole = file_bytes(MARKS)
    begin, end = record_offsets(MARKS)[1], record_offsets(MARKS)[2]
    for at in range(begin, end):
        data = bytearray(whole)
        data[at] ^= flip
        read = parse_marks("f", bytes(data))
        assert read.marks == (MARKS[0],), at
        assert read.damage is not None and read.damage.startswith(f"record at offset {begin}: "), (at, read.damage)


def test_a_record_of_another_file_fails() -> None:
    other = encode_mark(FID ^ 1, MARKS[1].start_pos, MARKS[1].recipients)
    mine = [encode_mark(FID, m.start_pos, m.recipients) for m in MARKS]
    # last: it fails with only zeros after it, as a torn write would; it is no mark
    tail = encode_header(FID) + mine[0] + other + bytes(512)
    assert parse_marks("f", tail) == MarksRead("f", (MARKS[0],), None)
    # in the middle: damage
    middle = encode_header(FID) + mine[0] + other + mine[2] + bytes(512)
    read = parse_marks("f", middle)
    assert read.marks == (MARKS[0],)
    assert read.damage == f"record at offset {HEADER_SIZE + len(mine[0])}: checksum mismatch"


def test_a_record_whose_checksum_passes_but_shape_is_wrong_is_damage_even_at_the_end() -> None:
    import cbor2

    for payload in (cbor2.dumps({"start": 1}), cbor2.dumps([1, []]), cbor2.dumps([-1, ["a"]]),
                    cbor2.dumps([1, ["a"]]) + b"\x00", b"\xff"):
        n = len(payload)
        record = struct.pack("<II", crc32c(payload, crc32c(struct.pack("<QI", FID, n))), n) + payload
        read = parse_marks("f", encode_header(FID) + record + bytes(64))
        assert read.marks == ()
        assert read.damage is not None and read.damage.startswith(f"record at offset {HEADER_SIZE}: "), payload


@pytest.mark.parametrize(
    ("data", "why"),
    [(b"LSMK\x01\x00", "short header (6 bytes)"),
     (b"LSMX" + bytes(12), "bad magic (not a marks file)"),
     (b"LSMK\x02\x00" + bytes(10), "unknown marks format version 2"),
     (b"LSMK\x01\x00\x01\x00" + bytes(8), "reserved header bytes set")],
)
def test_a_bad_header_is_damage_that_says_which(data: bytes, why: str) -> None:
    assert parse_marks("f", data) == MarksRead("f", (), why)


def test_zeros_then_data_where_a_record_would_begin_is_damage() -> None:
    data = bytearray(file_bytes(MARKS[:1]))
    data[200] = 1
    read = parse_marks("f", bytes(data))
    assert read.marks == (MARKS[0],)
    assert read.damage is not None and read.damage.startswith(f"record at offset {record_offsets(MARKS)[1]}: ")


def test_encode_refuses_what_the_reader_would_refuse() -> None:
    for pos, rcpts in ((-1, ["a"]), (1 << 64, ["a"]), (1, []), (1, ["x" * (64 * 1024)])):
        with pytest.raises(ValueError):
            encode_mark(FID, pos, rcpts)


# -- the worked example of docs/format.md -------------------------------------


def doc_block(name: str) -> tuple[int, bytes]:
    (body,) = re.findall(rf"^```hex {name}\n(.*?)^```$", DOC.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    start, data = -1, bytearray()
    for line in body.splitlines():
        m = re.match(r"^([0-9a-f]{4,8})  ((?:[0-9a-f]{2} )*[0-9a-f]{2})(?:  .*)?$", line)
        assert m, line
        if start < 0:
            start = int(m.group(1), 16)
        assert int(m.group(1), 16) == start + len(data), line
        data += bytes.fromhex(m.group(2))
    return start, bytes(data)


def test_the_worked_example_byte_for_byte() -> None:
    start, doc = doc_block("marks")
    code = encode_header(FID) + encode_mark(FID, 0x100000099, ["b@example.net"])
    assert start == 0
    assert doc.hex(" ") == code.hex(" ")
    assert len(doc) == 49  # the size the document states
    # the checksum's recipe, computed apart from the code: file_id, length, payload
    crc, length = struct.unpack_from("<II", doc, HEADER_SIZE)
    assert crc == 0x50E13705 == crc32c(doc[8:16] + doc[20:24] + doc[24:])
    assert length == 25 == len(doc) - HEADER_SIZE - RECORD_HEAD_SIZE
    assert parse_marks("f", doc + bytes(100)) == MarksRead("f", (Mark(0x100000099, ("b@example.net",)),), None)


# -- the writer and the readers -----------------------------------------------


def test_writer_round_trip_through_every_reader(tmp_path: Path) -> None:
    d = marks_dir(str(tmp_path))
    assert d == str(tmp_path / "marks")
    assert read_marks_dir(d) == []  # no directory yet
    w = MarksWriter(d, "w7", room=MIN_ROOM)
    assert w.path == os.path.join(d, "w7-1.marks")
    assert os.path.getsize(w.path) == MIN_ROOM  # made with its room
    for m in MARKS:
        w.add(m.start_pos, m.recipients)
    w.sync()
    assert marks_of(d, "w7") == MARKS
    assert marks_of(d, "w") == []  # another prefix
    assert read_marks_dir(d, lock_wait=0.05) == [MarksRead(w.path, (), "held by a live writer")]
    w.close()
    assert read_marks_dir(d) == [MarksRead(w.path, tuple(MARKS), None)]
    assert os.path.getsize(w.path) == MIN_ROOM  # the appends changed no size
    assert sorted(os.listdir(d)) == ["w7-1.marks"]


def test_writer_rolls_when_full_and_every_file_reads_back(tmp_path: Path) -> None:
    d = str(tmp_path / "marks")
    w = MarksWriter(d, "w", room=MIN_ROOM)
    rcpts = tuple(f"r{i}@example.net" for i in range(300))  # about 5 KiB a mark
    written: list[Mark] = []
    for batch in range(12):
        for j in range(3):
            m = Mark((batch << 32) | j, rcpts)
            w.add(m.start_pos, m.recipients)
            written.append(m)
        w.sync()
    w.close()
    names = sorted(os.listdir(d), key=lambda n: int(n.split("-")[1].split(".")[0]))
    assert len(names) >= 3 and all(n.endswith(".marks") for n in names)
    assert marks_of(d, "w") == written
    reads = read_marks_dir(d)
    assert all(r.damage is None for r in reads)
    by_name = {os.path.basename(r.path): r.marks for r in reads}
    assert [m for n in names for m in by_name[n]] == written
    # a batch never straddles two files when it fits a fresh one
    assert all(len(by_name[n]) % 3 == 0 for n in names)


def test_a_batch_bigger_than_a_file_goes_on_in_the_next(tmp_path: Path) -> None:
    d = str(tmp_path / "marks")
    w = MarksWriter(d, "w", room=MIN_ROOM)
    rcpts = tuple(f"r{i}@example.net" for i in range(300))
    written = [Mark(i, rcpts) for i in range(40)]
    for m in written:
        w.add(m.start_pos, m.recipients)
    w.sync()
    w.close()
    assert marks_of(d, "w") == written
    assert len(os.listdir(d)) >= 3


def test_a_name_of_an_earlier_life_is_never_replaced(tmp_path: Path) -> None:
    d = str(tmp_path / "marks")
    with MarksWriter(d, "w", room=MIN_ROOM) as w:
        w.add(5, ["a@example.net"])
        w.sync()
    with MarksWriter(d, "w", room=MIN_ROOM) as again:
        assert again.path == os.path.join(d, "w-2.marks")
    assert marks_of(d, "w") == [Mark(5, ("a@example.net",))]


def test_a_tmp_left_by_a_creation_cut_short_is_never_reused(tmp_path: Path) -> None:
    """A crash while ``w-1`` was being made left ``w-1.tmp``: the next writer of that prefix goes on with ``w-2``
    and leaves the leftover as it was (recovery reads it, and deletes it when it holds no mark)."""
    d = tmp_path / "marks"
    d.mkdir()
    (d / "w-1.tmp").write_bytes(b"")
    with MarksWriter(str(d), "w", room=MIN_ROOM) as w:
        assert w.path == str(d / "w-2.marks")
        w.add(7, ["a@example.net"])
        w.sync()
    assert (d / "w-1.tmp").read_bytes() == b""
    assert marks_of(str(d), "w") == [Mark(7, ("a@example.net",))]


# -- the collector -------------------------------------------------------------


def test_the_collector_deletes_only_closed_old_files(tmp_path: Path) -> None:
    d = str(tmp_path / "marks")
    old = MarksWriter(d, "old", room=MIN_ROOM)
    old.add(10, ["a@example.net"])
    old.add(20, ["b@example.net"])
    old.sync()
    old.close()  # closed: every mark before 100
    young = MarksWriter(d, "young", room=MIN_ROOM)
    young.add(150, ["c@example.net"])
    young.sync()
    young.close()  # closed, but a mark at or after 100
    live = MarksWriter(d, "live", room=MIN_ROOM)
    live.add(5, ["d@example.net"])
    live.sync()  # old marks, but the writer's current file: locked
    empty = MarksWriter(d, "empty", room=MIN_ROOM)
    empty.close()  # closed and holding none
    tmp = os.path.join(d, "gone-1.tmp")
    Path(tmp).write_bytes(file_bytes([]))  # never a .tmp, locked or not
    damaged = os.path.join(d, "bad-1.marks")
    data = bytearray(file_bytes(MARKS))
    data[record_offsets(MARKS)[1]] ^= 1
    Path(damaged).write_bytes(bytes(data))  # marks all before 1 << 40, but damaged

    collector = MarksCollector(d)
    assert collector.collect(working_start=100) == ["empty-1.marks", "old-1.marks"]
    assert sorted(os.listdir(d)) == ["bad-1.marks", "gone-1.tmp", "live-1.marks", "young-1.marks"]
    assert collector.collect(working_start=1 << 40) == ["young-1.marks"]  # its highest mark was cached
    live.close()
    assert collector.collect(working_start=6) == ["live-1.marks"]
    assert sorted(os.listdir(d)) == ["bad-1.marks", "gone-1.tmp"]
    assert MarksCollector(str(tmp_path / "none")).collect(1) == []


def test_the_collector_skips_a_file_another_reader_holds(tmp_path: Path) -> None:
    d = str(tmp_path / "marks")
    with MarksWriter(d, "w", room=MIN_ROOM) as w:
        path = w.path
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert MarksCollector(d).collect(1) == []
    finally:
        os.close(fd)
    assert MarksCollector(d).collect(1) == ["w-1.marks"]


def test_the_face_names_the_marks() -> None:
    assert spool.MarksWriter is MarksWriter
    assert spool.MarksCollector is MarksCollector
    assert spool.read_marks_dir is read_marks_dir
    assert spool.marks_of is marks_of
    assert spool.Mark is Mark
    assert spool.MarksRead is MarksRead
    assert spool.MARKS_DIR == "marks"
    assert spool.marks_dir("/s") == "/s/marks"
