"""The ``logspool`` Spark data source against the spool's own sequential reader."""

from __future__ import annotations

import glob
import os
import shutil
from collections import Counter
from typing import Any

import pytest
from report_reference import plain_records

from mta.report.job import read_records
from mta.report.spark_source import MAX_FILES_PER_PARTITION, TASKS_PER_CORE
from spool.export.rows import (
    ERROR_TYPE,
    SegmentTask,
    expand_paths,
    relay_name_for,
    segment_batches,
    segment_parts,
    segment_rows,
)
from spool.format.record import HEADER_SIZE, Delivery, Envelope, Finish, Start, pos_offset

# Run alone, the first test here pays for the shared SparkSession's start (see test_report.py).
pytestmark = pytest.mark.timeout(1800)


def load(spark: Any, *paths: str, **options: str) -> list[Any]:
    reader = spark.read.format("logspool")
    for k, v in options.items():
        reader = reader.option(k, v)
    rows: list[Any] = reader.load(list(paths)).collect()
    return rows


def test_every_record_of_a_fleet_is_read_once_with_its_relay(spark: Any, fleet: dict[str, str]) -> None:
    rows = load(spark, os.path.join(os.path.dirname(fleet["mx1"]), "*"))
    plain = plain_records(fleet)
    assert sorted((r.relay, r.pos, r.rtype) for r in rows) == sorted((p.relay, p.pos, p.rtype) for p in plain)
    by_key = {(r.relay, r.pos): r for r in rows}
    for p in plain:
        row = by_key[(p.relay, p.pos)]
        assert row.time == p.time
        if isinstance(p.payload, Envelope):
            e = p.payload
            assert (row.message_id, row.sender, tuple(row.recipients), row.body_size, row.arrival_ms, row.attempts,
                    row.replaces, row.held) == (e.message_id, e.sender, e.recipients, e.body_size, e.arrival_ms,
                                                 e.attempts, e.replaces, e.held)
        elif isinstance(p.payload, Delivery):
            d = p.payload
            assert (row.ref, row.time_ms, row.duration_ms) == (d.start, d.time_ms, d.duration_ms)
            assert [tuple(o) for o in row.outcomes] == [tuple(o.to_list()) for o in d.outcomes]
    assert all(r.error is None for r in rows)


def all_segments(spool_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(spool_dir, "log", "*.seg")) + glob.glob(os.path.join(spool_dir, "archive",
                                                                                              "*.seg")))


def test_one_partition_per_segment_file(spark: Any, fleet: dict[str, str]) -> None:
    files = all_segments(fleet["mx1"])
    df = spark.read.format("logspool").load(fleet["mx1"])
    assert len(glob.glob(os.path.join(fleet["mx1"], "archive", "*.seg"))) > 3
    assert df.rdd.getNumPartitions() == len(files)


def test_with_the_jobs_cores_runs_of_segments_share_a_partition_and_every_row_is_the_same(
        spark: Any, fleet: dict[str, str]) -> None:
    both = os.path.join(os.path.dirname(fleet["mx1"]), "*")
    files = all_segments(fleet["mx1"]) + all_segments(fleet["mx2"])
    one_each = spark.read.format("logspool").load(both)
    grouped = spark.read.format("logspool").option("cores", "1").load(both)
    per = max(1, min(MAX_FILES_PER_PARTITION, len(files) // TASKS_PER_CORE))
    assert per > 1  # the fleet has enough segments for runs to form
    assert one_each.rdd.getNumPartitions() == len(files)
    assert grouped.rdd.getNumPartitions() == -(-len(files) // per)
    # Every row, every column, and each partition's rows in file order, file after file.
    assert sorted(map(tuple, grouped.collect())) == sorted(map(tuple, one_each.collect()))
    for rows in grouped.rdd.glom().collect():
        keys = [(r.file, r.pos) for r in rows]
        assert keys == sorted(keys) and len({r.file for r in rows}) <= per


def test_the_job_tells_the_data_source_its_parallelism(spark: Any, fleet: dict[str, str]) -> None:
    df = read_records(spark, [fleet["mx1"], fleet["mx2"]])
    files = all_segments(fleet["mx1"]) + all_segments(fleet["mx2"])
    cores = spark.sparkContext.defaultParallelism
    per = max(1, min(MAX_FILES_PER_PARTITION, len(files) // (cores * TASKS_PER_CORE)))
    assert df.rdd.getNumPartitions() == -(-len(files) // per)
    assert df.count() == spark.read.format("logspool").load([fleet["mx1"], fleet["mx2"]]).count()


def test_relay_name_from_directory_or_option(spark: Any, fleet: dict[str, str]) -> None:
    seg = min(glob.glob(os.path.join(fleet["mx2"], "log", "*.seg")))
    assert relay_name_for(seg) == "mx2"
    rows = load(spark, seg, relay="edge-7")
    assert rows and {r.relay for r in rows} == {"edge-7"}


def test_paths_globs_and_archive_directories(tmp_path: Any, fleet: dict[str, str]) -> None:
    archive = tmp_path / "relay9-archive"
    archive.mkdir()
    segs = sorted(glob.glob(os.path.join(fleet["mx1"], "log", "*.seg")))
    for s in segs[:2]:
        shutil.copy(s, archive)
    assert [os.path.basename(f) for f in expand_paths([str(archive)])] == [os.path.basename(s) for s in segs[:2]]
    assert relay_name_for(expand_paths([str(archive)])[0]) == "relay9-archive"
    assert expand_paths([os.path.join(fleet["mx1"], "log", "*.seg"), fleet["mx1"]]) == all_segments(fleet["mx1"])
    assert relay_name_for(all_segments(fleet["mx1"])[0]) == "mx1"
    assert expand_paths([str(tmp_path / "nothing-here*")]) == []


def _copy_spool(src: str, dst: str) -> list[str]:
    shutil.copytree(src, dst)
    return sorted(glob.glob(os.path.join(dst, "log", "*.seg")))


def test_a_corrupt_record_is_reported_and_the_rest_is_read(spark: Any, fleet: dict[str, str], tmp_path: Any) -> None:
    segs = _copy_spool(fleet["mx1"], str(tmp_path / "mx1"))
    victim = segs[1]
    before = list(segment_rows(victim))
    bad = before[3]["pos"]
    with open(victim, "r+b") as f:  # flip a payload byte of the fourth record
        f.seek(pos_offset(bad) + HEADER_SIZE + 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    rows = load(spark, str(tmp_path / "mx1"))
    errors = [r for r in rows if r.rtype == ERROR_TYPE]
    assert [(e.file, pos_offset(e.pos)) for e in errors] == [(victim, pos_offset(bad))]
    assert "corrupt record" in errors[0].error and "checksum" in errors[0].error
    good = Counter((r.relay, r.pos) for r in rows if r.rtype != ERROR_TYPE)
    expected = {("mx1", p.pos) for p in plain_records({"mx1": fleet["mx1"]})} - {("mx1", bad)}
    assert set(good) == expected and max(good.values()) == 1


def test_a_torn_tail_is_reported_as_torn(spark: Any, fleet: dict[str, str], tmp_path: Any) -> None:
    segs = _copy_spool(fleet["mx2"], str(tmp_path / "mx2"))
    last = segs[-1]
    rows_before = list(segment_rows(last))
    cut = pos_offset(rows_before[-1]["pos"]) + 7  # a write interrupted inside the last frame's header
    os.truncate(last, cut)
    rows = load(spark, last)
    errors = [r for r in rows if r.rtype == ERROR_TYPE]
    assert len(errors) == 1 and errors[0].error.startswith("torn tail") and pos_offset(errors[0].pos) == cut - 7
    assert len(rows) - 1 == len(rows_before) - 1


def test_a_damaged_segment_header_gives_one_error_row_and_its_records_are_read(spark: Any, fleet: dict[str, str],
                                                                            tmp_path: Any) -> None:
    """Every frame carries its own length and a checksum salted with the segment id (the file name's):
    a damaged header hides nothing behind it (spool.read.reader resynchronises at the first frame)."""
    segs = _copy_spool(fleet["mx2"], str(tmp_path / "mx2"))
    with open(segs[0], "r+b") as f:
        f.write(b"NOTASPOOL")
    rows = load(spark, str(tmp_path / "mx2"))
    errors = [r for r in rows if r.rtype == ERROR_TYPE]
    assert len(errors) == 1 and errors[0].file == segs[0] and "bad magic" in errors[0].error
    assert errors[0].error.startswith("damaged segment header") and pos_offset(errors[0].pos) == 0
    assert len(rows) - 1 == len(plain_records({"mx2": fleet["mx2"]}))


def test_batches_give_rows_in_file_order_with_every_field(fleet: dict[str, str]) -> None:
    """Columns are built per record type and put back in order: small batches mix types."""
    plain = plain_records({"mx1": fleet["mx1"]})
    files = all_segments(fleet["mx1"])
    rows = [r for f in files for b in segment_batches(f, "mx1", batch_rows=7) for r in b.to_pylist()]
    assert [(r["pos"], r["rtype"], r["time"]) for r in rows] == [(p.pos, p.rtype, p.time) for p in plain]
    assert len({r["rtype"] for r in rows}) == 4
    for r, p in zip(rows, plain, strict=True):
        rec = p.payload
        assert r["relay"] == "mx1" and r["error"] is None and r["garbage"] in (False, True)
        if isinstance(rec, Envelope):
            assert (r["message_id"], r["sender"], tuple(r["recipients"]), r["body_size"], r["arrival_ms"],
                    r["attempts"], r["replaces"], r["held"], r["ref"]) == (
                rec.message_id, rec.sender, rec.recipients, rec.body_size, rec.arrival_ms, rec.attempts,
                rec.replaces, rec.held, None)
        elif isinstance(rec, Start):
            assert (r["ref"], r["time_ms"], r["kind"], r["sender"]) == (rec.envelope, rec.time_ms, int(rec.kind), None)
        elif isinstance(rec, Delivery):
            assert (r["ref"], r["time_ms"], r["duration_ms"]) == (rec.start, rec.time_ms, rec.duration_ms)
            assert [tuple(o.values()) for o in r["outcomes"]] == [tuple(o.to_list()) for o in rec.outcomes]
        else:
            assert isinstance(rec, Finish)
            assert (r["ref"], r["time_ms"], r["replacement"], r["kind"]) == (rec.start, rec.time_ms,
                                                                             rec.replacement, None)


def test_parts_are_the_batches_rows_one_record_type_a_batch(fleet: dict[str, str], tmp_path: Any) -> None:
    """The decode stage's batches: every row of ``segment_batches`` once, error rows included (a segment
    with a damaged record), each batch of one type, each type's rows in file order."""
    files = all_segments(fleet["mx1"])
    damaged = str(tmp_path / os.path.basename(files[0]))
    with open(files[0], "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    with open(damaged, "wb") as f:
        f.write(data)
    for path in (*files, damaged):
        task = SegmentTask.alone(path)
        whole = [r for b in segment_batches(task, "mx1", batch_rows=7) for r in b.to_pylist()]
        parts = list(segment_parts(task, "mx1", batch_rows=7))
        assert all(len(set(b.column("rtype").to_pylist())) == 1 for b in parts)
        rows = [r for b in parts for r in b.to_pylist()]
        assert sorted(rows, key=lambda r: r["pos"]) == whole
        for t in {r["rtype"] for r in rows}:
            assert [r["pos"] for r in rows if r["rtype"] == t] == [r["pos"] for r in whole if r["rtype"] == t]
        if path == damaged:
            assert any(r["rtype"] == ERROR_TYPE for r in rows)


def test_the_garbage_collector_runs_again_between_batches_and_after_an_error(fleet: dict[str, str],
                                                                             tmp_path: Any) -> None:
    """The walk pauses the collector while it builds a batch: never across a yield, never after a failure."""
    import gc

    assert gc.isenabled()
    path = all_segments(fleet["mx1"])[0]
    batches = segment_batches(path, "mx1", batch_rows=7)
    assert next(batches).num_rows > 0
    assert gc.isenabled(), "left paused while Spark (the consumer) runs"
    batches.close()
    assert gc.isenabled()
    with pytest.raises(TypeError):  # a failure while the batch is built, collector paused
        next(segment_batches(path, "mx1", batch_rows="7"))  # type: ignore[arg-type]
    assert gc.isenabled()
    gone = str(tmp_path / "0000000000000001.seg")  # not a failure of the walk: an error row names it
    (row,) = segment_rows(gone, "mx1")
    assert row["rtype"] == ERROR_TYPE
    assert row["error"] == "missing segment: segment 1 was listed but is not there to read"
    assert gc.isenabled()


def test_spool_imports_without_pyspark() -> None:
    """Only the data source itself needs pyspark, and it lives with the report: every module of
    ``spool`` (the walk, spoolctl, the engine) and the ``mta`` command import without it."""
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib; sys.modules['pyspark'] = None; import spool; "
            "need = [m.name for m in pkgutil.walk_packages(spool.__path__, 'spool.') "
            "if importlib.import_module(m.name) is not None]; import mta.cli; print(len(need))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 40  # every module of spool's packages imported
    blocked = subprocess.run([sys.executable, "-c", "import sys; sys.modules['pyspark'] = None; "
                              "import mta.report.spark_source"], capture_output=True, text=True, check=False,
                             timeout=60)
    assert blocked.returncode != 0 and "pyspark" in blocked.stderr  # the check above can fail


def test_payloads_that_pass_the_checksum_but_do_not_decode_are_error_rows(tmp_path: Any) -> None:
    """The walk decodes on a good path of its own and leaves every failure to ``decode_fields``: each
    bad payload is one error row in its place, named as ``decode_fields`` names it, at any batch size."""
    import cbor2

    from spool.errors import CorruptRecord
    from spool.format.record import RecordType, decode_fields, encode_frame
    from spool.format.segment import SEGMENT_HEADER_SIZE, encode_segment_header

    env = Envelope(7, "a@x.test", ("b@y.test",), (1,), 10, 1_700_000_000_000)
    good = [(RecordType.ENVELOPE, env.to_payload()), (RecordType.START, Start(7, 5).to_payload()),
            (RecordType.FINISH, Finish(9, 6).to_payload())]
    bad = [(RecordType.ENVELOPE, b"\xff\xff"),  # not CBOR
           (RecordType.START, cbor2.dumps([7, 5])),  # an array, not a map
           (RecordType.FINISH, cbor2.dumps({0: 9})),  # a field missing
           (RecordType.ENVELOPE, cbor2.dumps({**env.to_map(), 1: 5})),  # a sender that is no text
           (RecordType.START, cbor2.dumps({0: 7, 1: 5, 2: 99}))]  # no such kind
    order = [good[0], bad[0], bad[1], good[1], bad[2], bad[3], good[2], bad[4]]
    path = str(tmp_path / "0000000000000001.seg")
    offsets, data = [], bytearray(encode_segment_header(1, 1))
    for rtype, payload in order:
        offsets.append(len(data))
        data += encode_frame(1, rtype, payload, time=1_700_000_000)
    with open(path, "wb") as f:
        f.write(data)
    assert offsets[0] == SEGMENT_HEADER_SIZE

    def reason(rtype: int, payload: bytes) -> str:
        with pytest.raises(CorruptRecord) as info:
            decode_fields(rtype, payload)
        return f"undecodable payload ({info.value.reason})"

    expected = [None if (rtype, payload) in good else reason(rtype, payload) for rtype, payload in order]
    for batch_rows in (1, 2, 3, 65536):
        rows = [r for b in segment_batches(path, "mx1", batch_rows=batch_rows) for r in b.to_pylist()]
        assert [pos_offset(r["pos"]) for r in rows] == offsets
        assert [r["error"] for r in rows] == expected
        assert [r["rtype"] for r in rows] == [ERROR_TYPE if e else int(t) for e, (t, _p) in zip(expected, order)]
    rows = list(segment_rows(path, "mx1"))
    assert (rows[0]["message_id"], rows[0]["sender"], rows[3]["ref"], rows[6]["ref"]) == (7, "a@x.test", 7, 9)


def test_a_worker_freezes_its_heap_once_before_the_first_segment() -> None:
    """pyspark's daemon collects every object of a reused worker after each task: the data source
    moves what the worker holds at its first task out of the collector's sight, once."""
    import subprocess
    import sys

    code = ("import gc, sys; from mta.report.spark_source import freeze_worker_heap as f; "
            "before = gc.get_freeze_count(); f(); once = gc.get_freeze_count(); x = [[] for _ in range(1000)]; f(); "
            "twice = gc.get_freeze_count(); import pyarrow as pa; gc.collect(); n = len(gc.get_objects()); "
            "pa.array((1, 2), pa.int64()); "
            "print(before, once, twice, gc.isenabled(), 'pyarrow.compute' in sys.modules, len(gc.get_objects()) - n)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    before, once, twice, enabled, imported, grown = proc.stdout.split()
    assert int(before) == 0 and int(once) > 10_000 and int(twice) == int(once)
    assert enabled == "True" and imported == "True"
    # what pyarrow's first array imports lazily (pandas, where numpy is installed) is frozen with the rest
    assert int(grown) < 1000
