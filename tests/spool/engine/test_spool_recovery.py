"""Recovery: it reads only the working suffix, cuts a torn tail, and reports recipients in doubt.

A crash here is ``close()`` without ``commit()`` and a new ``Spool.open``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import pytest
from spool_support import spool_config

from fault_injection.workloads import FakeClock as Clock
from spool.engine.spool import Spool
from spool.errors import CorruptSegment
from spool.format.record import HELD_CLASS, Outcome, Status, format_id, pos_offset, pos_segment
from spool.format.segment import list_segments, segment_path
from spool.read import listing as admin
from spool.read.anomaly import Anomaly, Kind

RCPT = "r@dest.example"


# Deferred classes of ten minutes and an hour.
config = functools.partial(spool_config, retry_intervals=(600.0, 3600.0))


def log_bytes(sp: Spool) -> int:
    return sum(os.path.getsize(segment_path(sp.log_dir, s)) for s in list_segments(sp.io, sp.log_dir))


def live(sp: Spool) -> dict[int, admin.LiveMessage]:
    return {m.message_id: m for m in admin.iter_live(sp)}


def build_backlog(path: Path, deferred: int, clock: Clock) -> tuple[int, list[int]]:
    """A spool with ``deferred`` messages in the first deferred class, then a few new ones; crashed.

    Returns the log's size on disk and the ids of the new messages.
    """
    sp = Spool.open(str(path), config(clock, segment_size=256 * 1024))
    try:
        for _ in range(deferred // 2500):
            sp.enqueue_many([("s@src.example", [RCPT], b"deferred body %d" % i) for i in range(2500)])
            clock.now += 1
            attempts = sp.poll_due()
            assert len(attempts) == 2500
            for a in attempts:
                sp.record_delivery(a, [Outcome(RCPT, Status.DEFERRED, 451, "4.4.1", "try later")])
            sp.commit()
            for a in attempts:
                assert sp.finish(a) is not None
            sp.commit()
        sp.checkpoint()
        clock.now += 1
        fresh = [sp.enqueue("s@src.example", [RCPT], b"new %d" % i) for i in range(5)]
        sp.commit()
        size = log_bytes(sp)
    finally:
        sp.close()  # crash: no checkpoint after the new mail
    return size, fresh


def reopen_stats(path: Path, clock: Clock) -> tuple[Spool, int, int]:
    sp = Spool.open(str(path), config(clock, segment_size=256 * 1024))
    return sp, sp.recovery_stats.bytes_read, sp.recovery_stats.records_read


def test_recovery_reads_only_the_working_suffix(tmp_path: Path) -> None:
    clock = Clock()
    size, fresh = build_backlog(tmp_path / "big", 5000, clock)
    sp, read, records = reopen_stats(tmp_path / "big", clock)
    try:
        assert len(list_segments(sp.io, sp.log_dir)) > 3, "the backlog should span several segments"
        assert read < size / 20, f"recovery read {read} of {size} bytes"
        assert records < 50
        # Nothing was lost by reading so little: the backlog and the new mail are all there, bodies too.
        msgs = live(sp)
        assert len(msgs) == 5005
        assert set(fresh) <= set(msgs)
        assert sum(1 for m in msgs.values() if m.klass == 1) == 5000
        bodies = {b"".join(sp.read_body(m.envelope)) for m in msgs.values()}
        assert {b"deferred body %d" % i for i in range(2500)} <= bodies
    finally:
        sp.close()

    # The counter is honest: with the checkpoint gone, recovery scans every segment and says so.
    os.unlink(tmp_path / "big" / "checkpoint")
    sp, full_read, full_records = reopen_stats(tmp_path / "big", clock)
    try:
        assert full_read >= size * 0.9
        assert full_records > 15000  # envelopes, starts, deliveries, finishes, bodies
        assert len(live(sp)) == 5005
    finally:
        sp.close()


def test_recovery_read_does_not_grow_with_the_deferred_backlog(tmp_path: Path) -> None:
    figures = []
    for n in (2500, 5000):
        clock = Clock()
        size, _ = build_backlog(tmp_path / str(n), n, clock)
        sp, read, records = reopen_stats(tmp_path / str(n), clock)
        sp.close()
        figures.append((size, read, records))
    (size1, read1, records1), (size2, read2, records2) = figures
    assert size2 > 1.8 * size1
    # The suffix is the same five messages: the figure must not follow the backlog.
    assert read2 < read1 + 1024, f"doubling the deferred backlog grew recovery's read from {read1} to {read2}"
    assert records2 == records1


# -- torn tail -------------------------------------------------------------------


def last_segment(sp: Spool) -> str:
    return segment_path(sp.log_dir, list_segments(sp.io, sp.log_dir)[-1])


@pytest.mark.parametrize("cut", [1, 7, 16, 40])
def test_torn_tail_is_cut_and_committed_messages_survive(tmp_path: Path, cut: int) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    kept = [sp.enqueue("s@src.example", [RCPT], b"kept %d" % i) for i in range(3)]
    sp.commit()
    sp.checkpoint()
    end_of_kept = os.path.getsize(last_segment(sp))
    # The last message's write is the one a crash tears: its bytes reach the file only in part.
    torn = sp.enqueue("s@src.example", [RCPT], b"torn" * 20)
    sp.commit()
    path = last_segment(sp)
    sp.close()
    os.truncate(path, end_of_kept + cut)

    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.tail_cut_bytes == cut
        assert os.path.getsize(path) == end_of_kept
        msgs = live(sp)
        assert set(msgs) == set(kept)
        assert torn not in msgs
        for i, mid in enumerate(kept):
            assert b"".join(sp.read_body(msgs[mid].envelope)) == b"kept %d" % i
        # The log goes on from the cut: new mail is accepted and survives the next crash.
        again = sp.enqueue("s@src.example", [RCPT], b"after the cut")
        sp.commit()
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.tail_cut_bytes == 0
        assert set(live(sp)) == {*kept, again}
    finally:
        sp.close()


def test_zeroed_tail_after_crash_is_the_clean_end(tmp_path: Path) -> None:
    """A file extended by the crash with zeros (the filesystem allocated, the data never came), or by the
    writer's zeroed room (format version 3): the log ends there cleanly. Nothing is cut or quarantined, and
    the next record is written over the first zero, where the last one ended."""
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    kept = sp.enqueue("s@src.example", [RCPT], b"kept")
    sp.commit()
    path = last_segment(sp)
    size = os.path.getsize(path)
    sp.close()
    with open(path, "ab") as f:
        f.write(b"\0" * (4096 - size % 512))
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.tail_cut_bytes == 0
        assert not os.path.exists(os.path.join(str(tmp_path), "quarantine")) or not os.listdir(
            os.path.join(str(tmp_path), "quarantine"))
        assert set(live(sp)) == {kept}
        assert pos_offset(sp.writer.head) == size
        after = sp.enqueue("s@src.example", [RCPT], b"after")
        sp.commit()
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert set(live(sp)) == {kept, after}
    finally:
        sp.close()


def test_damage_before_the_checkpointed_head_is_not_a_torn_tail(tmp_path: Path) -> None:
    """Records a checkpoint vouched for are never cut silently: the loss is quarantined as damage (or the
    open refuses, naming the file, with on_damage = "refuse"), and the log goes on in a new segment, so that
    no queue id of a lost message is given again."""
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    start = os.path.getsize(last_segment(sp))
    lost = sp.enqueue("s@src.example", [RCPT], b"durable" * 10)
    sp.commit()
    sp.checkpoint()
    path = last_segment(sp)
    sp.close()
    os.truncate(path, start + 20)
    with pytest.raises(CorruptSegment) as info:
        Spool.open(str(tmp_path), config(clock, on_damage="refuse"))
    assert info.value.path == path and "spoolctl verify" in str(info.value)
    assert os.path.getsize(path) == start + 20  # refusing touched nothing
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        notes = sorted(os.listdir(tmp_path / "quarantine"))
        assert [n for n in notes if n.endswith(".json")] == [
            f"{1:016x}-{start:010d}-damaged-record.json", f"{1:016x}-{start + 20:010d}-ends-early.json"]
        assert os.path.getsize(path) == start + 20  # the damaged segment is kept as it is
        fresh = sp.enqueue("s@src.example", [RCPT], b"new")
        sp.commit()
        assert fresh > lost and pos_segment(fresh) == 2
        assert set(live(sp)) == {fresh}
    finally:
        sp.close()


# -- in doubt ----------------------------------------------------------------------


def test_attempt_past_its_point_of_no_return_without_outcome_is_in_doubt_and_held_until_released(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``in_doubt = "hold"`` (the default): the message is held at recovery, says so in one line naming its
    queue id and recipients, stays held across another restart, and goes on once released."""
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    mid = sp.enqueue("s@src.example", ["a@x.example", "b@y.example"], b"body")
    sp.commit()
    (attempt,) = sp.poll_due()
    sp.record_sending(attempt, attempt.remaining)
    sp.commit()  # START and sending durable (the final dot may be out); no outcome when the crash comes
    sp.close()

    qid = format_id(mid)
    with caplog.at_level(logging.INFO, logger="spool.engine.recovery"):
        sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.in_flight == 1
        assert sp.recovery_stats.in_doubt == 2
        assert sp.recovery_stats.held == 1
        lines = [r.getMessage() for r in caplog.records if "in doubt: queue id" in r.getMessage()]
        assert lines == [f"in doubt: queue id {qid} recipients a@x.example,b@y.example: an attempt was in flight "
                         "at the crash with no outcome recorded; the message is held: `mta queue release "
                         f"{qid}` delivers it again, `mta queue delete {qid}` drops it"]
        assert any("2 in doubt (1 message held: mta queue list --in-doubt)" in r.getMessage()
                   for r in caplog.records)
        msg = live(sp)[mid]
        assert msg.envelope.recipients == msg.envelope.in_doubt == ("a@x.example", "b@y.example")
        assert msg.held and msg.klass == HELD_CLASS and msg.envelope.held
        assert admin.count(sp, admin.Filter(in_doubt=True)) == admin.count(sp, admin.Filter(held=True)) == 1
        clock.now += 100_000
        assert sp.poll_due() == []  # held: never claimed for delivery
    finally:
        sp.close()

    sp = Spool.open(str(tmp_path), config(clock))  # a second restart: the held replacement is on disk
    try:
        assert sp.recovery_stats.in_doubt == 0
        assert live(sp)[mid].held
        assert sp.poll_due() == []  # the sweeper carries it, still held
        sp.commit()
        assert sp.change(mid, "release")
        (again,) = sp.poll_due()
        assert again.message_id == mid and again.klass == 0
        assert again.envelope.in_doubt == ("a@x.example", "b@y.example")
        assert b"".join(sp.read_body(again.envelope)) == b"body"
    finally:
        sp.close()


def test_attempt_past_its_point_of_no_return_is_redelivered_with_in_doubt_redeliver(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock, in_doubt="redeliver"))
    mid = sp.enqueue("s@src.example", ["a@x.example", "b@y.example"], b"body")
    sp.commit()
    (attempt,) = sp.poll_due()
    sp.record_sending(attempt, attempt.remaining)
    sp.commit()
    sp.close()

    sp = Spool.open(str(tmp_path), config(clock, in_doubt="redeliver"))
    try:
        assert sp.recovery_stats.in_doubt == 2
        assert sp.recovery_stats.held == 0
        msg = live(sp)[mid]
        assert msg.envelope.in_doubt == ("a@x.example", "b@y.example")
        assert not msg.held and msg.klass == attempt.klass == 0
        assert admin.count(sp, admin.Filter(in_doubt=True)) == 1
        # It is delivered again, and says so.
        (again,) = sp.poll_due()
        assert again.envelope.in_doubt == ("a@x.example", "b@y.example")
    finally:
        sp.close()


def test_only_recipients_without_an_outcome_are_in_doubt(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    mid = sp.enqueue("s@src.example", ["a@x.example", "b@y.example", "c@z.example"], b"body")
    sp.commit()
    (attempt,) = sp.poll_due()
    sp.record_sending(attempt, attempt.remaining)
    sp.record_delivery(attempt, [Outcome("a@x.example", Status.DELIVERED, 250),
                                 Outcome("b@y.example", Status.DEFERRED, 451)])
    sp.commit()
    sp.close()

    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.in_doubt == 1
        msg = live(sp)[mid]
        assert msg.envelope.recipients == ("b@y.example", "c@z.example")
        assert msg.envelope.in_doubt == ("c@z.example",)
    finally:
        sp.close()


def test_a_claim_alone_is_not_doubt_the_message_is_due_again(tmp_path: Path) -> None:
    """A durable START with no ``sending``: the attempt never reached its final dot, so no next hop can have
    the message. Recovery holds nothing and the message is due again at once, in its class."""
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    mid = sp.enqueue("s@src.example", ["a@x.example", "b@y.example"], b"body")
    sp.commit()
    (attempt,) = sp.poll_due()
    sp.commit()  # the START is durable; the crash came before any final dot
    sp.close()

    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.in_flight == 1
        assert (sp.recovery_stats.in_doubt, sp.recovery_stats.held) == (0, 0)
        msg = live(sp)[mid]
        assert not msg.held and msg.envelope.in_doubt == () and msg.klass == attempt.klass
        (again,) = sp.poll_due()
        assert again.message_id == mid and again.remaining == ["a@x.example", "b@y.example"]
    finally:
        sp.close()


def test_only_the_recipients_sending_names_are_in_doubt(tmp_path: Path) -> None:
    """Two transactions of one attempt (two next hops): the one whose final dot may be out is in doubt, the
    other is simply due again; the message is held for the first."""
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock, in_doubt="redeliver"))
    mid = sp.enqueue("s@src.example", ["a@x.example", "b@y.example"], b"body")
    sp.commit()
    (attempt,) = sp.poll_due()
    sp.record_sending(attempt, ["b@y.example"])
    sp.commit()
    sp.close()

    sp = Spool.open(str(tmp_path), config(clock, in_doubt="redeliver"))
    try:
        assert sp.recovery_stats.in_doubt == 1
        msg = live(sp)[mid]
        assert msg.envelope.recipients == ("a@x.example", "b@y.example")
        assert msg.envelope.in_doubt == ("b@y.example",)
    finally:
        sp.close()


def test_uncommitted_start_leaves_nothing_in_doubt(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    mid = sp.enqueue("s@src.example", ["a@x.example"], b"body")
    sp.commit()
    sp.poll_due()
    sp.close()  # the START never reached the disk: no attempt began, as far as anyone can tell
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.in_flight == 0
        assert sp.recovery_stats.in_doubt == 0
        assert live(sp)[mid].envelope.in_doubt == ()
    finally:
        sp.close()


def test_committed_final_outcomes_survive_and_message_is_done(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), config(clock))
    mid = sp.enqueue("s@src.example", ["a@x.example", "b@y.example"], b"body")
    sp.commit()
    (attempt,) = sp.poll_due()
    sp.record_delivery(attempt, [Outcome("a@x.example", Status.DELIVERED, 250),
                                 Outcome("b@y.example", Status.BOUNCED, 550)])
    sp.commit()
    sp.finish(attempt)  # FINISH not committed: recovery must rebuild it
    sp.close()
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert mid not in live(sp)
        assert sp.recovery_stats.in_flight == 1
        assert sp.recovery_stats.in_doubt == 0
        assert sp.poll_due() == []
    finally:
        sp.close()


# -- damage: one policy ------------------------------------------------------------


def test_damage_goes_to_the_one_damage_policy_once(tmp_path: Path) -> None:
    """Recovery meets a damaged record twice (finding the log's end, scanning the suffix) and hands it to
    its policy once. ``refuse`` stops the open there; a policy that returns (the default quarantine) lets
    recovery go on past it, on the next valid record. The garbage marks of the claims after it prove the
    damage durable (it is not an unacknowledged tail, which would be cut)."""
    clock = Clock()
    sp = Spool.open(str(tmp_path / "a"), config(clock))
    for i in range(3):
        sp.enqueue("s@src.example", [RCPT], b"body %d" % i)
    sp.commit()
    attempts = sp.poll_due()
    sp.commit()  # three STARTs durable, no outcome: three attempts in flight at the crash
    damaged = attempts[1].envelope.body[0]  # the middle message's body, with valid records after it
    sp.close()
    path = segment_path(sp.log_dir, pos_segment(damaged))
    with open(path, "r+b") as f:
        f.seek(pos_offset(damaged) + 20)
        byte = f.read(1)
        f.seek(pos_offset(damaged) + 20)
        f.write(bytes([byte[0] ^ 0x40]))
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    with pytest.raises(CorruptSegment) as info:
        Spool.open(str(tmp_path / "a"), config(clock, on_damage="refuse"))
    assert (info.value.path, info.value.offset) == (path, pos_offset(damaged))

    met: list[Anomaly] = []
    sp = Spool.open(str(tmp_path / "b"), config(clock), on_damage=met.append)
    try:
        assert [(a.kind, a.offset, a.resume is not None) for a in met] == [
            (Kind.DAMAGED_RECORD, pos_offset(damaged), True)]
        assert met[0].path == str(tmp_path / "b" / "log" / os.path.basename(path))
        # The scan resynchronised after the damage: the attempts after it were found and replaced too.
        assert sp.recovery_stats.in_flight == 3
        assert sp.recovery_stats.replacements == 3
    finally:
        sp.close()
