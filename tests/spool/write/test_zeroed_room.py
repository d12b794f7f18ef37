"""Zeroed room ahead of the log's write position (spool/write/room.py, format version 3): how the writer makes it,
seals it away, and how every reader and recovery read a zero tail (the clean end) against damage."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import trio
from click.testing import CliRunner
from crc32c import crc32c
from spool_support import spool_config

from fault_injection import powercut
from fault_injection.recording import RecordingFileIO, Sync, Write
from fault_injection.workloads import FakeClock as Clock
from spool.aio.async_spool import AsyncSpool
from spool.engine.spool import Spool
from spool.export.rows import ERROR_TYPE, segment_rows
from spool.fileio import OsFileIO
from spool.format.record import HEADER, HEADER_SIZE, RecordType, encode_frame, make_pos, pos_offset, pos_segment
from spool.format.segment import FORMAT_VERSION, SEGMENT_HEADER, SEGMENT_HEADER_SIZE, list_segments, segment_path
from spool.read import listing as admin
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import LogReader, anomalies
from spool.tools.cli import cli as spoolctl
from spool.write.room import ROOM_MIN

IO = OsFileIO()
RCPT = "r@dest.example"


def live(sp: Spool) -> set[int]:
    return {m.message_id for m in admin.iter_live(sp)}


def commit_and_room(sp: Spool) -> None:
    """A commit, then room made as the trio committer makes it when nothing else waits."""
    sp.commit()
    if sp.writer.room_wanted():
        sp.writer.make_room()


def seg_file(sp: Spool, seg: int | None = None) -> str:
    return segment_path(sp.log_dir, seg if seg is not None else list_segments(sp.io, sp.log_dir)[-1])


def quarantined(path: Path) -> list[str]:
    q = path / "quarantine"
    return sorted(os.listdir(q)) if q.exists() else []


def whole_log_anomalies(path: Path) -> list[Anomaly]:
    reader = LogReader(IO, str(path / "log"))
    return anomalies(reader.read())


def test_room_is_zeroed_synced_and_never_past_the_segment_size(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), spool_config(Clock()))
    try:
        sp.enqueue("s@src.example", [RCPT], b"x" * 100)
        sp.commit()
        w = sp.writer
        assert w.room_wanted()
        fsyncs = w.fsyncs
        w.make_room()
        end = pos_offset(w.written_end)
        data = Path(seg_file(sp)).read_bytes()
        assert len(data) == end + ROOM_MIN, "a small spool's room is the minimum"
        assert data[end:] == bytes(ROOM_MIN)
        assert (w.room.extensions, w.room.end, w.fsyncs) == (1, len(data), fsyncs), "counted apart"
        assert not w.room_wanted()
    finally:
        sp.close()
    small = tmp_path / "small"
    sp = Spool.open(str(small), spool_config(Clock(), segment_size=8192))
    try:
        sp.enqueue("s@src.example", [RCPT], b"x" * 100)
        commit_and_room(sp)
        assert os.path.getsize(seg_file(sp)) == 8192
    finally:
        sp.close()


def test_a_sealed_segment_is_cut_to_its_records_before_its_successor_names_its_size(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), spool_config(Clock(), segment_size=4096))
    try:
        while pos_segment(sp.writer.head) < 4:
            sp.enqueue("s@src.example", [RCPT], b"y" * 700)
            commit_and_room(sp)
        assert sp.writer.room.extensions >= 3
        segs = list_segments(sp.io, sp.log_dir)
        for seg in segs[:-1]:
            recorded = SEGMENT_HEADER.unpack_from(Path(seg_file(sp, seg + 1)).read_bytes())[3]
            assert os.path.getsize(seg_file(sp, seg)) == recorded == sp.writer.closed_sizes[seg]
        last = Path(seg_file(sp)).read_bytes()
        end = pos_offset(sp.writer.durable_end)
        assert len(last) > end and last[end:] == bytes(len(last) - end)
        assert whole_log_anomalies(tmp_path) == []
        reader = LogReader(IO, sp.log_dir)
        assert reader.log_end()[0] == sp.writer.durable_end
    finally:
        sp.close()


def test_a_crash_with_a_zeroed_tail_recovers_every_acknowledged_message_and_appends_after_it(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    acked = set()
    for i in range(5):
        acked.add(sp.enqueue("s@src.example", [RCPT], b"body %d" % i))
        commit_and_room(sp)
    end = sp.writer.durable_end
    path = seg_file(sp)
    assert os.path.getsize(path) > pos_offset(end)
    sp.close()  # crash-only: nothing is tidied at close; the zeroed room stays on disk
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert live(sp) == acked
        assert sp.recovery_stats.tail_cut_bytes == 0
        assert quarantined(tmp_path) == []
        assert sp.writer.head == end, "the next record goes over the first zero"
        acked.add(sp.enqueue("s@src.example", [RCPT], b"after the crash"))
        commit_and_room(sp)
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert live(sp) == acked
        assert quarantined(tmp_path) == []
    finally:
        sp.close()


def _crashed_with_room(tmp_path: Path, clock: Clock) -> tuple[set[int], str, int]:
    """A spool whose last commit left zeroed room after it; returns the acknowledged ids, the file, its end."""
    sp = Spool.open(str(tmp_path), spool_config(clock))
    acked = {sp.enqueue("s@src.example", [RCPT], b"acknowledged %d" % i) for i in range(3)}
    commit_and_room(sp)
    path, end = seg_file(sp), pos_offset(sp.writer.durable_end)
    sp.close()
    return acked, path, end


def _write_at(path: str, off: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def test_a_torn_record_followed_by_zeros_is_a_clean_torn_tail(tmp_path: Path) -> None:
    """The power cut kept the first sectors of a record written into the room, not the rest: cut, kept
    in the quarantine up to where the zeros begin, and every acknowledged message survives."""
    clock = Clock()
    acked, path, end = _crashed_with_room(tmp_path, clock)
    seg = int(os.path.basename(path)[:16], 16)
    frame = encode_frame(seg, RecordType.DATA, b"\x7e" * 1500, time=int(clock.now))
    kept = -(-(end + 1) // 512) * 512 - end  # up to the next sector boundary
    _write_at(path, end, frame[:kept])
    size = os.path.getsize(path)
    assert size > end + kept
    [torn] = anomalies(LogReader(IO, str(tmp_path / "log")).read())
    assert (torn.kind, torn.offset, torn.length) == (Kind.TORN_TAIL, end, kept)
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert live(sp) == acked
        assert os.path.getsize(path) == end
        [bin_name] = [n for n in quarantined(tmp_path) if n.endswith(".bin")]
        assert "torn-tail" in bin_name
        assert (tmp_path / "quarantine" / bin_name).read_bytes() == frame[:kept]
        acked.add(sp.enqueue("s@src.example", [RCPT], b"after"))
        sp.commit()
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert live(sp) == acked
    finally:
        sp.close()


def test_garbage_followed_by_zeros_past_what_is_durable_is_cut_as_unacknowledged(tmp_path: Path) -> None:
    """Garbage that is not shaped like an interrupted write (a plausible header, bytes past its frame, not
    zero from a sector boundary inside it) is damage, not the clean end: after the last position recovery
    can prove durable it is an unacknowledged tail, cut with its bytes kept."""
    clock = Clock()
    acked, path, end = _crashed_with_room(tmp_path, clock)
    bogus = HEADER.pack(0x12345678, 40, int(RecordType.ENVELOPE), 0, 0, 0, int(clock.now)) + b"\x55" * 100
    _write_at(path, end, bogus)
    [damage] = anomalies(LogReader(IO, str(tmp_path / "log")).read())
    assert (damage.kind, damage.offset, damage.length) == (Kind.DAMAGED_RECORD, end, len(bogus))
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert live(sp) == acked
        assert os.path.getsize(path) == end
        [bin_name] = [n for n in quarantined(tmp_path) if n.endswith("-cut.bin")]
        assert (tmp_path / "quarantine" / bin_name).read_bytes() == bogus, "the garbage, not the room after it"
    finally:
        sp.close()


def test_zeros_where_durable_records_were_are_damage_not_the_end(tmp_path: Path) -> None:
    """Zeros at or before a position known durable (a checkpoint's head) are lost records, and zeros in a
    segment that is not the last one are too: only the last segment's tail past what is durable is clean."""
    clock = Clock()
    _acked, path, end = _crashed_with_room(tmp_path, clock)
    seg = int(os.path.basename(path)[:16], 16)
    first = SEGMENT_HEADER_SIZE
    _write_at(path, first, bytes(end - first))  # every record zeroed
    reader = LogReader(IO, str(tmp_path / "log"), durable=make_pos(seg, end))
    [damage] = anomalies(reader.read())
    assert (damage.kind, damage.offset) == (Kind.DAMAGED_RECORD, first)
    assert anomalies(LogReader(IO, str(tmp_path / "log")).read()) == [], "with nothing known durable: the end"
    # The same zeros in a segment with a successor: damage, whatever is known durable.
    with open(segment_path(str(tmp_path / "log"), seg + 1), "wb") as f:
        head = SEGMENT_HEADER.pack(b"LSPOOLSG", 3, 32, os.path.getsize(path), seg + 1, int(clock.now), 0)[:28]
        f.write(head + struct.pack("<I", crc32c(head)))
    kinds = [a.kind for a in anomalies(LogReader(IO, str(tmp_path / "log")).read())]
    assert Kind.DAMAGED_RECORD in kinds


def test_a_version_2_segment_opens_is_appended_to_without_room_and_the_next_one_gets_room(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock, segment_size=4096))
    acked = {sp.enqueue("s@src.example", [RCPT], b"old %d" % i) for i in range(2)}
    sp.commit()
    path = seg_file(sp)
    sp.close()
    data = bytearray(Path(path).read_bytes())
    struct.pack_into("<H", data, 8, 2)
    struct.pack_into("<I", data, 28, crc32c(bytes(data[:28])))
    Path(path).write_bytes(bytes(data))
    sp = Spool.open(str(tmp_path), spool_config(clock, segment_size=4096))
    try:
        assert live(sp) == acked
        acked.add(sp.enqueue("s@src.example", [RCPT], b"new"))
        commit_and_room(sp)
        assert os.path.getsize(path) == pos_offset(sp.writer.written_end), "no room in a version-2 segment"
        while pos_segment(sp.writer.head) == 1:
            acked.add(sp.enqueue("s@src.example", [RCPT], b"z" * 600))
            commit_and_room(sp)
        assert sp.writer.room.enabled and os.path.getsize(seg_file(sp)) == 4096
        assert Path(seg_file(sp)).read_bytes()[8:10] == struct.pack("<H", FORMAT_VERSION)
        assert os.path.getsize(path) == sp.writer.closed_sizes[1]
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), spool_config(clock, segment_size=4096))
    try:
        assert live(sp) == acked
        assert whole_log_anomalies(tmp_path) == []
    finally:
        sp.close()


def test_a_power_cut_while_room_was_made_loses_nothing_acknowledged() -> None:
    """The power-cut harness's workloads make room after each commit (as the committer does): every crash
    state, the room's zeros written and never synced among them, recovers every acknowledged message."""
    report = powercut.run("enqueue-only", 60, seed=11)
    assert (report.explored, report.failed) == (60, 0), [f.violations for f in report.failures]
    report = powercut.run("flush-rotate", 60, seed=12)
    assert (report.explored, report.failed) == (60, 0), [f.violations for f in report.failures]


def test_the_committer_makes_room_with_syncs_of_its_own_never_in_a_commit(tmp_path: Path) -> None:
    """Room is made between commits, and its fdatasync covers zeros only: a commit's fdatasync never waits
    for zeros written in the same sync, and a room sync never carries records."""
    rio = RecordingFileIO(str(tmp_path))

    async def main() -> None:
        sp = await AsyncSpool.open(str(tmp_path), spool_config(Clock(), segment_size=64 * 1024), rio)
        async with trio.open_nursery() as nursery:
            await nursery.start(sp.run)
            for i in range(120):  # three segments of 64 KiB
                await sp.enqueue("s@src.example", [RCPT], b"m" * 1000 + b"%d" % i)
            nursery.cancel_scope.cancel()
        assert sp.core.writer.room.extensions >= 2
        sp.core.close()

    trio.run(main)
    zeros_only = records = 0
    since: dict[int, list[bool]] = {}
    for op in rio.rec.ops:
        if isinstance(op, Write) and len(op.data) > HEADER_SIZE:
            since.setdefault(op.ino, []).append(op.data == bytes(len(op.data)))
        elif isinstance(op, Sync):
            kinds = set(since.pop(op.ino, []))
            assert kinds != {True, False}, "zeros and records in one fdatasync"
            zeros_only += kinds == {True}
            records += kinds == {False}
    assert zeros_only >= 2 and records >= 120


def test_spoolctl_verify_and_the_report_source_read_a_zero_tail_as_the_end(tmp_path: Path) -> None:
    """The readers outside the engine: ``spoolctl verify`` says clean, and the Spark data source's rows
    (spool/export/rows.py) are the records, with no error row, while the last segment ends in zeroed room."""
    sp = Spool.open(str(tmp_path), spool_config(Clock()))
    try:
        for i in range(3):
            sp.enqueue("s@src.example", [RCPT], b"r %d" % i)
            commit_and_room(sp)
        path, end = seg_file(sp), pos_offset(sp.writer.durable_end)
        records = sp.writer.records
    finally:
        sp.close()
    assert os.path.getsize(path) > end
    result = CliRunner().invoke(spoolctl, ["verify", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["clean"] is True and out["torn_tail"] is None and out["records"] == records
    rows = list(segment_rows(path))
    assert [r for r in rows if r["rtype"] == ERROR_TYPE] == []
    assert len(rows) == 3 and all(r["rtype"] == RecordType.ENVELOPE and pos_offset(r["pos"]) < end for r in rows)
