"""Every reader of the log names the same damage: the same kind, segment and offset.

One spool is built by the engine, then copies of it are damaged in one way
each (a zeroed 4 KiB range in a middle segment, flipped bits, a truncated
middle segment, a missing middle segment, a torn tail, a damaged segment
header, a record whose checksum passes but whose payload does not decode or
whose type is unknown). For each, the log reader itself, ``spoolctl verify``, the admin reads
(``admin.page``/``count``/``find`` on a read-only ``SpoolView``), the Spark
source's error rows (its pure-Python walk, ``spool.export.rows``) and, where it meets
the damage, a queue runner must agree. Before the one reader, ``verify``
blamed an undamaged segment ("bad magic") where recovery blamed its neighbour.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from spool_support import NoSync

from spool.config.engine import SpoolConfig
from spool.engine.runner import Runner
from spool.engine.spool import Spool
from spool.errors import CorruptSegment
from spool.export.rows import ERROR_TYPE, plan, segment_rows
from spool.format.record import Frame, RecordType, encode_frame, make_pos, pos_offset, pos_segment
from spool.format.segment import SEGMENT_HEADER_SIZE, list_segments, segment_path
from spool.read import listing as admin
from spool.read.anomaly import Anomaly, Kind
from spool.read.reader import anomalies
from spool.tools.inspection import LogFiles, checkpoint_or_none
from spool.tools.verify import verify
from spool.tools.verify_report import Problem

T0 = 1_700_000_000
SEGMENT_SIZE = 16 * 1024


@attrs.frozen
class Template:
    path: str
    segments: tuple[int, ...]
    ids: tuple[int, ...]  # queue ids, in log order
    frames: dict[int, list[Frame]]  # segment -> its frames


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """About seven segments of new mail, all live; a checkpoint; two messages after it (a torn tail's room)."""
    path = str(tmp_path_factory.mktemp("agree") / "spool")
    clock = [float(T0)]
    config = SpoolConfig(segment_size=SEGMENT_SIZE, clock=lambda: clock[0])
    sp = Spool.open(path, config, NoSync())
    ids = [sp.enqueue(f"s{i}@example.com", ["r@example.net"], b"x" * 600) for i in range(150)]
    sp.commit()
    sp.checkpoint()
    ids += [sp.enqueue(f"t{i}@example.com", ["r@example.net"], b"y" * 300) for i in range(2)]
    sp.commit()
    sp.close()
    files = LogFiles.open(path)
    reader = files.reader(checkpoint_or_none(files))
    frames: dict[int, list[Frame]] = {}
    for item in reader.read():
        assert isinstance(item, Frame), item
        frames.setdefault(pos_segment(item.pos), []).append(item)
    assert len(files.segments) >= 6
    return Template(path, files.segments, tuple(ids), frames)


def _seg_path(spool: str, seg: int) -> str:
    return segment_path(os.path.join(spool, "log"), seg)


def _middle(t: Template) -> int:
    return t.segments[len(t.segments) // 2]


def zero_4k(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    seg = _middle(t)
    start = 6000
    with open(_seg_path(spool, seg), "r+b") as f:
        f.seek(start)
        f.write(bytes(4096))
    hit = [fr for fr in t.frames[seg] if pos_offset(fr.pos) <= start][-1]  # the frame the zeros begin in
    return [(Kind.DAMAGED_RECORD, seg, pos_offset(hit.pos))]


def flip_bits(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    seg = _middle(t)
    env = [fr for fr in t.frames[seg] if fr.rtype == RecordType.ENVELOPE][2]
    off = pos_offset(env.pos)
    with open(_seg_path(spool, seg), "r+b") as f:
        for i, bit in ((20, 1), (31, 4), (40, 7)):
            f.seek(off + i)
            b = f.read(1)[0]
            f.seek(off + i)
            f.write(bytes([b ^ (1 << bit)]))
    return [(Kind.DAMAGED_RECORD, seg, off)]


def truncate_middle(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    seg = _middle(t)
    victim = t.frames[seg][len(t.frames[seg]) // 2]
    cut = pos_offset(victim.pos) + 10
    os.truncate(_seg_path(spool, seg), cut)
    return [(Kind.DAMAGED_RECORD, seg, pos_offset(victim.pos)), (Kind.SIZE_MISMATCH, seg, cut)]


def remove_middle(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    seg = _middle(t)
    os.unlink(_seg_path(spool, seg))
    return [(Kind.MISSING_SEGMENT, seg, 0)]


def tear_tail(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    seg = t.segments[-1]
    last = t.frames[seg][-1]
    os.truncate(_seg_path(spool, seg), pos_offset(last.pos) + 7)
    return [(Kind.TORN_TAIL, seg, pos_offset(last.pos))]


def damage_header(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    seg = _middle(t)
    with open(_seg_path(spool, seg), "r+b") as f:
        f.write(b"NOTASPOO")
    return [(Kind.BAD_HEADER, seg, 0)]


def _rewrite(t: Template, spool: str, frame: Frame, rtype: int, payload: bytes) -> None:
    """Write ``frame`` again in place with another type or payload of its length, its checksum passing."""
    seg = pos_segment(frame.pos)
    with open(_seg_path(spool, seg), "r+b") as f:
        f.seek(pos_offset(frame.pos))
        f.write(encode_frame(seg, rtype, payload, klass=frame.klass, time=frame.time, flags=frame.flags))


def bad_payload(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    """An envelope whose checksum passes and whose CBOR does not decode (a bug's or a newer writer's)."""
    seg = _middle(t)
    env = [fr for fr in t.frames[seg] if fr.rtype == RecordType.ENVELOPE][2]
    _rewrite(t, spool, env, env.rtype, b"\xff" * len(env.payload))
    return [(Kind.BAD_PAYLOAD, seg, pos_offset(env.pos))]


def unknown_type(t: Template, spool: str) -> list[tuple[Kind, int, int]]:
    """An envelope rewritten as a record type this version does not know, its checksum passing."""
    seg = _middle(t)
    env = [fr for fr in t.frames[seg] if fr.rtype == RecordType.ENVELOPE][2]
    _rewrite(t, spool, env, max(RecordType) + 3, env.payload)
    return [(Kind.UNKNOWN_TYPE, seg, pos_offset(env.pos))]


DAMAGE: dict[str, Callable[[Template, str], list[tuple[Kind, int, int]]]] = {
    "zeroed 4 KiB range in a middle segment": zero_4k,
    "flipped bits": flip_bits,
    "truncated middle segment": truncate_middle,
    "missing middle segment": remove_middle,
    "torn tail": tear_tail,
    "damaged segment header": damage_header,
    "a whole record whose payload does not decode": bad_payload,
    "a whole record of an unknown type": unknown_type,
}


def _where(a: Anomaly) -> tuple[Kind, int, int]:
    return a.kind, a.segment, a.offset


def _place(p: Problem) -> tuple[int, int]:
    """Segment and offset of a problem that is an anomaly of the log (it has both)."""
    assert p.pos is not None and p.offset is not None, p
    return pos_segment(p.pos), p.offset


@pytest.mark.parametrize("how", list(DAMAGE))
def test_every_reader_names_the_same_damage(template: Template, tmp_path: Path, how: str) -> None:
    spool = str(tmp_path / "spool")
    shutil.copytree(template.path, spool)
    expected = DAMAGE[how](template, spool)
    files = LogFiles.open(spool)

    # The reader itself, told what the checkpoint knows.
    found = anomalies(files.reader(checkpoint_or_none(files)).decoded())
    assert [_where(a) for a in found] == expected
    by_place = {(a.segment, a.offset): a for a in found}

    # spoolctl verify: its problems (and its torn tail) are the reader's anomalies.
    report = verify(files)
    named = [(p.anomaly, *_place(p)) for p in report.problems if p.anomaly is not None]
    if report.torn_tail is not None:
        named.append(_where(report.torn_tail))
    assert sorted(named, key=str) == sorted(expected, key=str)
    for p in report.problems:
        if p.anomaly is not None:
            assert p.path == by_place[_place(p)].path

    # The Spark source's error rows, at the same positions and in the same files.
    rows = [r for task in plan([spool]) for r in segment_rows(task, "agree") if r["rtype"] == ERROR_TYPE]
    assert sorted((pos_segment(r["pos"]), pos_offset(r["pos"])) for r in rows) == \
        sorted((seg, off) for _k, seg, off in expected)
    for r in rows:
        a = by_place[(pos_segment(r["pos"]), pos_offset(r["pos"]))]
        assert r["file"] == a.path and (a.kind is not Kind.TORN_TAIL or r["error"].startswith("torn tail"))

    # The admin reads: a torn tail is where the log ends; damage is raised, naming the first anomaly.
    view = admin.SpoolView(spool)
    damage = [a for a in found if a.kind.damage]
    if not damage:
        assert admin.count(view) == len(template.ids) - 1  # the torn record was the last envelope
        assert len(admin.page(view, limit=1000)[0]) == len(template.ids) - 1
        return
    first = damage[0]
    calls: list[Callable[[], Any]] = [lambda: admin.count(view), lambda: admin.page(view, limit=1000),
                                      lambda: admin.find(view, template.ids[-1])]
    for call in calls:
        with pytest.raises(CorruptSegment) as info:
            call()
        assert (info.value.path, info.value.offset) == (first.path, first.offset)

    # A queue runner passing the damage (records are read through its header-only walk) names it too.
    if first.kind in (Kind.DAMAGED_RECORD, Kind.UNKNOWN_TYPE):
        _runner_names(spool, first, found)


def _runner_names(spool: str, first: Anomaly, found: list[Anomaly]) -> None:
    try:
        sp = Spool.open(spool, SpoolConfig(segment_size=SEGMENT_SIZE, clock=lambda: float(T0)), NoSync())
    except CorruptSegment as exc:  # recovery refuses (a truncated sealed segment), naming one of them
        assert (exc.path, exc.offset) in {(a.path, a.offset) for a in found}
        return
    runner = Runner(sp.io, sp.log_dir, 0, 0.0, make_pos(list_segments(sp.io, sp.log_dir)[0], SEGMENT_HEADER_SIZE))
    try:
        with pytest.raises(CorruptSegment) as info:
            runner.scan(sp.writer, 4e9, 10**9, ())
        assert (info.value.path, info.value.offset) == (first.path, first.offset)
    finally:
        runner.close()
        sp.close()
