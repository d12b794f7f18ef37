"""The damage policy in the engine: what ``spoolctl verify`` predicts is what the spool does, once.

The relay-level promises are in tests/relay/test_relay_damage.py; here the
engine alone: verify's plan against the quarantine notes a real open and
drain leave; the known bugs (an in-flight envelope in a deleted first
segment; the oldest segments deleted up to a live envelope, silently); the
proof of durability that tells an unacknowledged tail from damage; damage met
again after a restart; a checkpoint whose segments are all gone.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from damage_support import NoSync, Template, build_template

from fault_injection.corrupt import Mutation, claimed_or_damaged, named_lost
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status, format_id, make_pos, pos_offset, pos_segment
from spool.format.segment import segment_path
from spool.read import listing as admin
from spool.tools.inspection import LogFiles
from spool.tools.start_plan import plan
from spool.tools.verify import verify

FAR = 4e9


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return build_template(str(tmp_path_factory.mktemp("policy") / "template"))


def _open(path: str, **kw: object) -> Spool:
    return Spool.open(path, SpoolConfig(segment_size=16 * 1024, retry_intervals=(1.0, 2.0), **kw))  # type: ignore[arg-type]


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        os.unlink(p)


DAMAGE: dict[str, Callable[[Template, str], None]] = {
    "zeroed 4 KiB in a middle segment": lambda t, d: Mutation(t.seg_rel(3), "zero", 6000, 4096).apply(d),
    "truncated middle segment": lambda t, d: Mutation(t.seg_rel(3), "truncate", 8000).apply(d),
    "missing middle segment": lambda t, d: os.unlink(t.seg_file(d, 3)),
    "missing last segment": lambda t, d: os.unlink(t.seg_file(d, t.segments[-1])),
    "missing oldest segments": lambda t, d: _unlink_all([t.seg_file(d, s) for s in t.segments[:2]]),
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_verify_names_what_the_open_and_the_runners_then_name(template: Template, tmp_path: Path, how: str) -> None:
    spool = template.copy(str(tmp_path / "spool"))
    DAMAGE[how](template, spool)
    report = verify(LogFiles.open(spool))
    assert not report.clean
    predicted = {m.queue_id for a in report.plan for m in a.lost}
    assert any(a.what == "quarantine" for a in report.plan)
    # ... and what on_damage = "refuse" would do, when the start meets damage at all
    assert (report.plan[-1].what == "refuse") == any(a.when == "start" for a in report.plan)
    sp = _open(spool)
    try:
        claimed_or_damaged(sp)
    finally:
        sp.close()
    named = named_lost(spool)
    assert named.ids == predicted
    assert predicted or how == "missing oldest segments"  # there, every record that could name them is gone
    # What verify said lies in the quarantine now: every action's damage has its note.
    for action in report.plan:
        if action.anomaly is not None:
            a = action.anomaly
            assert any(n.startswith(f"{a.segment:016x}-{a.offset:010d}-") for n in
                       os.listdir(os.path.join(spool, "quarantine"))), action.text
    # And verify, run again, knows it: quarantined before, nothing to name twice.
    again = verify(LogFiles.open(spool))
    assert all(a.what != "quarantine" for a in again.plan if a.when == "later")


def test_verify_says_what_the_relay_will_do_at_start(template: Template, tmp_path: Path) -> None:
    spool = template.copy(str(tmp_path / "spool"))
    os.unlink(template.seg_file(spool, 3))
    Mutation(template.seg_rel(2), "zero", 6000, 4096).apply(spool)
    report = verify(LogFiles.open(spool))
    text = "\n".join(a.describe() for a in report.plan)
    assert "at start: quarantine no bytes (the file is gone) of segment 3 at 0 (missing segment: segment 3 is " \
           "missing between 2 and 4) and start; 5 messages lost" in text
    assert "later:    quarantine " in text and "bytes of segment 2 at " in text and "when a runner or a read" in text
    assert text.count("lost: queue id ") == sum(len(a.lost) for a in report.plan) > 5
    assert report.as_dict()["relay_will"][0]["when"] == "start"


def test_an_in_flight_envelope_in_a_deleted_first_segment_is_named(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Once a raw FileNotFoundError at open: the attempt's envelope was in segment 1, which an operator
    deleted. Now: damage (the segment is missing), the message named by its START and DELIVERY records."""
    caplog.set_level(logging.WARNING, logger="spool")
    path = str(tmp_path / "spool")
    clock = [1_000_000.0]
    sp = Spool.open(path, SpoolConfig(segment_size=4096, retry_intervals=(600.0,), clock=lambda: clock[0]), NoSync())
    mid = sp.enqueue("a@example.org", ["b@example.net", "c@example.net"], b"x" * 100)
    for i in range(12):  # the rest of segment 1 and more
        sp.enqueue("a@example.org", [f"r{i}@example.net"], b"y" * 400)
    sp.commit()
    (attempt,) = sp.poll_due(limit=1)
    sp.record_delivery(attempt, [Outcome("b@example.net", Status.DEFERRED, 451, "4.3.0", "later")])
    sp.commit()  # the START and its DELIVERY are durable, in segment 2; the crash comes before the FINISH
    sp.close()
    assert pos_segment(attempt.envelope_pos) == 1 and pos_segment(attempt.start_pos) > 1
    os.unlink(segment_path(os.path.join(path, "log"), 1))
    sp = Spool.open(path, SpoolConfig(segment_size=4096, retry_intervals=(600.0,), clock=lambda: clock[0]))
    try:
        assert sp.recovery_stats.in_flight == 1
        assert mid not in {m.message_id for m in admin.iter_live(sp)}
    finally:
        sp.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    assert any("segment 1 is missing" in ln for ln in lines)
    (lost,) = [ln for ln in lines if ln.startswith("lost message:")]
    assert "<b@example.net>" in lost and "in flight at the crash" in lost
    assert os.path.exists(os.path.join(path, "quarantine", f"{1:016x}-{0:010d}-missing-segment.json"))


def test_deleting_the_oldest_segments_up_to_a_live_envelope_is_loud(template: Template, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Once a silent start with those messages gone: the checkpoint says which segments must be there."""
    caplog.set_level(logging.WARNING, logger="spool")
    spool = template.copy(str(tmp_path / "spool"))
    gone = template.segments[:2]
    for seg in gone:
        os.unlink(template.seg_file(spool, seg))
    sp = _open(spool)
    sp.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    for seg in gone:
        assert any(f"segment {seg} is missing; the checkpoint needs every segment from 1 on" in ln for ln in lines)
    assert sorted(n for n in os.listdir(os.path.join(spool, "quarantine")) if n.endswith(".json")) == [
        f"{seg:016x}-{0:010d}-missing-segment.json" for seg in gone]


def test_a_garbage_mark_proves_the_log_durable_up_to_it(tmp_path: Path) -> None:
    """Damage in the last segment past the checkpoint's head is an unacknowledged tail (cut) unless a record
    after it bears a garbage mark: marks are written only on durable records, after the commit that made
    their START durable, so the damage was synced too and is damage (quarantined, the rest kept)."""
    def build(path: str, claim: bool) -> int:
        sp = Spool.open(path, SpoolConfig(retry_intervals=(600.0,)), NoSync())
        sp.checkpoint()
        mids = [sp.enqueue("a@example.org", [f"r{i}@example.net"], b"z" * 300) for i in range(3)]
        sp.commit()
        if claim:
            sp.poll_due(now=FAR)
            sp.commit()  # the STARTs are durable, the marks written
        first = next(m for m in admin.iter_live(sp) if m.message_id == mids[0]).envelope.body[0]
        sp.close()
        with open(segment_path(os.path.join(path, "log"), pos_segment(first)), "r+b") as f:
            f.seek(pos_offset(first) + 40)
            f.write(b"\xff")
        return first

    unmarked = build(str(tmp_path / "a"), claim=False)
    sp = Spool.open(str(tmp_path / "a"))
    try:
        assert sp.recovery_stats.tail_cut_bytes > 0 and list(admin.iter_live(sp)) == []
        assert os.path.exists(os.path.join(tmp_path, "a", "quarantine",
                                           f"{pos_segment(unmarked):016x}-{pos_offset(unmarked):010d}-cut.bin"))
    finally:
        sp.close()
    marked = build(str(tmp_path / "b"), claim=True)
    sp = Spool.open(str(tmp_path / "b"))
    try:
        assert sp.recovery_stats.tail_cut_bytes == 0
        assert sp.recovery_stats.in_flight == 3  # all three attempts found past the damage, and replaced
        assert len(list(admin.iter_live(sp))) == 3
        assert os.path.exists(os.path.join(tmp_path, "b", "quarantine",
                                           f"{pos_segment(marked):016x}-{pos_offset(marked):010d}-damaged-record.bin"))
    finally:
        sp.close()


def test_damage_met_again_after_a_restart_is_not_kept_or_named_twice(template: Template, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="spool")
    spool = template.copy(str(tmp_path / "spool"))
    os.unlink(template.seg_file(spool, 3))
    _open(spool).close()
    first = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    caplog.clear()
    sp = _open(spool)
    try:
        assert sp.damage.known_met == 1 and sp.damage.lost_named == 0
        assert sp.damage.quarantine.totals()[2] == len([ln for ln in first if ln.startswith("lost message:")])
    finally:
        sp.close()
    again = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    assert len(again) == 1 and "quarantined before" in again[0]


def test_a_checkpoint_whose_segments_are_all_gone_starts_a_new_log_after_its_head(template: Template,
                                                                                    tmp_path: Path) -> None:
    spool = template.copy(str(tmp_path / "spool"))
    shutil.rmtree(os.path.join(spool, "log"))
    os.makedirs(os.path.join(spool, "log"))
    sp = _open(spool)
    try:
        head_seg = template.segments[-1]
        assert sp.writer.segment_id == head_seg + 1
        mid = sp.enqueue("a@example.org", ["b@example.net"], b"new")
        sp.commit()
        assert format_id(mid) not in {m.qid for m in template.messages}
        assert mid >= make_pos(head_seg + 1, 0)
    finally:
        sp.close()
    notes = os.listdir(os.path.join(spool, "quarantine"))
    assert f"{head_seg:016x}-{0:010d}-missing-segment.json" in notes


def test_the_plan_of_a_clean_spool_is_empty(template: Template) -> None:
    files = LogFiles.open(template.path)
    report = verify(files)
    assert report.clean and plan(files, report) == [] and report.plan == []
