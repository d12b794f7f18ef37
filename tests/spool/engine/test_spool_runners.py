"""Runners and space: retry classes, fairness, the active limit, expiry, held mail, segment reclaiming,
batched enqueue and streamed bodies. All with a fake clock and real files."""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path

import pytest

from fault_injection.workloads import FakeClock as Clock
from spool.config.engine import SpoolConfig
from spool.config.fairness import QUIET
from spool.engine.spool import Attempt, Spool
from spool.format.record import HELD_CLASS, Outcome, Status
from spool.format.segment import list_segments, segment_path
from spool.read import listing as admin

RCPT = "r@dest.example"


def defer(sp: Spool, attempts: list[Attempt]) -> None:
    for a in attempts:
        sp.record_delivery(a, [Outcome(r, Status.DEFERRED, 451, "4.4.1", "later") for r in a.remaining])
    sp.commit()
    for a in attempts:
        assert sp.finish(a) is not None
    sp.commit()


def deliver(sp: Spool, attempts: list[Attempt]) -> None:
    """Deliver and finish; the FINISH records ride on the next commit (they need no fsync of their own)."""
    for a in attempts:
        sp.record_delivery(a, [Outcome(r, Status.DELIVERED, 250) for r in a.remaining])
    sp.commit()
    for a in attempts:
        assert sp.finish(a) is None


def segments(sp: Spool) -> list[int]:
    return list_segments(sp.io, sp.log_dir)


# -- retry classes ----------------------------------------------------------------


def test_deferred_message_trails_by_its_class_interval(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    sp = Spool.open(str(tmp_path), SpoolConfig(retry_intervals=(60.0, 300.0), clock=clock))
    try:
        mid = sp.enqueue("s@src.example", [RCPT], b"body")
        sp.commit()
        (a,) = sp.poll_due()
        assert a.klass == 0
        defer(sp, [a])

        clock.now = 1059.0
        assert sp.poll_due() == []
        assert sp.next_wake() == 1060.0
        clock.now = 1060.0
        (a,) = sp.poll_due()
        assert (a.message_id, a.klass, a.envelope.attempts) == (mid, 1, 1)
        defer(sp, [a])

        clock.now = 1060.0 + 299
        assert sp.poll_due() == []
        clock.now = 1060.0 + 300
        (a,) = sp.poll_due()
        assert (a.message_id, a.klass) == (mid, 2)
        defer(sp, [a])  # the last class keeps it
        clock.now += 299
        assert sp.poll_due() == []
        clock.now += 1
        (a,) = sp.poll_due()
        assert (a.message_id, a.klass, a.envelope.attempts) == (mid, 2, 3)
    finally:
        sp.close()


def test_new_mail_is_due_at_once(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    sp = Spool.open(str(tmp_path), SpoolConfig(retry_intervals=(60.0,), clock=clock))
    try:
        mid = sp.enqueue("s@src.example", [RCPT], b"body")
        assert sp.poll_due() == [], "not due before it is durable"
        sp.commit()
        assert [a.message_id for a in sp.poll_due()] == [mid]
        assert sp.poll_due() == [], "started once"
    finally:
        sp.close()


def test_deferred_backlog_does_not_starve_new_mail(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    sp = Spool.open(str(tmp_path), SpoolConfig(retry_intervals=(60.0, 600.0), clock=clock))
    try:
        sp.enqueue_many([("s@src.example", [RCPT], b"old %d" % i) for i in range(400)])
        defer(sp, sp.poll_due())
        clock.now += 61  # the whole backlog is due at once
        new = set(sp.enqueue_many([("s@src.example", [RCPT], b"new %d" % i) for i in range(100)]))
        for _ in range(5):
            batch = sp.poll_due(limit=20)
            assert len(batch) == 20
            fresh = sum(1 for a in batch if a.message_id in new)
            assert 8 <= fresh <= 12, f"{fresh} new messages out of 20"
            deliver(sp, batch)
        # Once the limit is lifted the rest of the new mail comes at once; the backlog follows in
        # full as soon as no new mail has been claimed for QUIET (until then the deferred budget
        # rations it: tests/spool/config/test_fairness.py).
        rest = sp.poll_due()
        assert sum(1 for a in rest if a.message_id in new) == 50
        clock.now += QUIET
        rest += sp.poll_due()
        assert len(rest) == 400  # 500 queued, 100 delivered above
    finally:
        sp.close()


def test_active_limit_pauses_runners_until_attempts_finish(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    sp = Spool.open(str(tmp_path), SpoolConfig(retry_intervals=(60.0,), active_limit=5, clock=clock))
    try:
        ids = sp.enqueue_many([("s@src.example", [RCPT], b"m %d" % i) for i in range(12)])
        first = sp.poll_due()
        assert len(first) == 5
        assert sp.poll_due() == []
        assert len(sp.attempts) == 5
        deliver(sp, first[:2])
        second = sp.poll_due()
        assert len(second) == 2
        assert sp.poll_due(limit=10) == []
        deliver(sp, first[2:] + second)
        third = sp.poll_due()
        assert len(third) == 5
        deliver(sp, third)
        assert sp.poll_due() == []
        started = {a.message_id for a in first + second + third}
        assert len(started) == 12 and started == set(ids)
    finally:
        sp.close()


def test_message_older_than_max_queue_lifetime_is_expired(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    # "redeliver": the attempt in flight at the close below must come due again, not be held in doubt.
    config = SpoolConfig(retry_intervals=(600.0,), max_queue_lifetime=3600.0, clock=clock, in_doubt="redeliver")
    sp = Spool.open(str(tmp_path), config)
    try:
        mid = sp.enqueue("s@src.example", [RCPT], b"body")
        sp.commit()
        (a,) = sp.poll_due()
        assert not a.expired
        defer(sp, [a])
        for _ in range(5):
            clock.now += 600
            (a,) = sp.poll_due()
            assert not a.expired, f"expired after {clock.now - 1000} s"
            defer(sp, [a])
        clock.now += 600  # 3600 s after arrival
        (a,) = sp.poll_due()
        assert a.message_id == mid and a.expired
        sp.commit()
    finally:
        sp.close()
    # Expiry is measured from arrival, which a crash does not reset. (The attempt was in flight:
    # recovery's replacement keeps its class, and is due one interval after the recovery.)
    sp = Spool.open(str(tmp_path), config)
    try:
        assert sp.poll_due() == []
        clock.now += 600
        (a,) = sp.poll_due()
        assert a.message_id == mid and a.expired
        sp.record_delivery(a, [Outcome(RCPT, Status.EXPIRED, 0, "4.4.7", "expired")])
        sp.commit()
        assert sp.finish(a) is None
        sp.commit()
        assert admin.count(sp) == 0
    finally:
        sp.close()


# -- held mail and reclaiming segments -----------------------------------------------


def churn(sp: Spool, clock: Clock, rounds: int) -> None:
    """Traffic that fills segments and leaves them garbage."""
    for i in range(rounds):
        sp.enqueue_many([("s@src.example", ["x@busy.example"], b"%d" % i * 100)] * 10)
        deliver(sp, [a for a in sp.poll_due() if a.envelope.recipients == ("x@busy.example",)])
        clock.now += 25
        if i % 3 == 2:
            sp.checkpoint()


def test_held_message_is_carried_forward_and_survives_segment_deletion(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    config = SpoolConfig(retry_intervals=(10.0, 20.0), segment_size=4096, clock=clock)
    sp = Spool.open(str(tmp_path), config)
    body = bytes(range(256)) * 3
    try:
        mid = sp.enqueue("s@src.example", ["a@held.example", "b@held.example"], body)
        sp.commit()
        assert sp.change(mid, "hold")
        churn(sp, clock, 15)
        assert segments(sp)[0] > 3, f"nothing reclaimed: {segments(sp)}"
        msg = admin.find(sp, mid)
        assert msg.held and msg.klass == HELD_CLASS
        assert msg.envelope.recipients == ("a@held.example", "b@held.example")
        assert b"".join(sp.read_body(msg.envelope)) == body
        assert admin.count(sp, admin.Filter(held=True)) == 1
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), config)  # and after a crash
    try:
        churn(sp, clock, 6)
        msg = admin.find(sp, mid)
        assert msg.held
        assert b"".join(sp.read_body(msg.envelope)) == body
        assert sp.change(mid, "release")
        (a,) = sp.poll_due()
        assert a.message_id == mid and a.klass == 0
        assert b"".join(sp.read_body(a.envelope)) == body
    finally:
        sp.close()


def fill_and_finish(sp: Spool, clock: Clock) -> None:
    for i in range(10):
        sp.enqueue_many([("s@src.example", [RCPT], b"%d" % i * 200)] * 8)
        deliver(sp, sp.poll_due())
    clock.now += 100  # past every interval: the runners may pass it all
    assert sp.poll_due() == []


def digests(directory: str) -> dict[str, str]:
    return {n: hashlib.sha256(Path(directory, n).read_bytes()).hexdigest() for n in os.listdir(directory)
            if n.endswith(".seg")}


def test_segments_are_deleted_only_after_a_checkpoint(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    sp = Spool.open(str(tmp_path), SpoolConfig(retry_intervals=(10.0, 20.0), segment_size=4096, clock=clock))
    try:
        fill_and_finish(sp, clock)
        before = segments(sp)
        assert len(before) > 5
        assert segments(sp) == before, "nothing may go before a checkpoint covers it"
        gone = sp.checkpoint()
        assert gone and gone == before[: len(gone)]
        after = segments(sp)
        assert not set(gone) & set(after)
        assert after == before[len(gone):]
        assert not (tmp_path / "archive").exists()
    finally:
        sp.close()


def test_archive_dir_receives_reclaimed_segments_unchanged(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    archive = tmp_path / "archive"
    sp = Spool.open(str(tmp_path / "spool"), SpoolConfig(retry_intervals=(10.0, 20.0), segment_size=4096,
                                                         archive_dir=str(archive), clock=clock))
    try:
        fill_and_finish(sp, clock)
        sp.commit()
        before = digests(sp.log_dir)
        gone = sp.checkpoint()
        assert gone
        moved = digests(str(archive))
        names = {os.path.basename(segment_path(sp.log_dir, s)) for s in gone}
        assert set(moved) == names
        assert all(moved[n] == before[n] for n in names)
        assert not names & set(os.listdir(sp.log_dir))
    finally:
        sp.close()


# -- enqueue -------------------------------------------------------------------------


def test_enqueue_many_is_one_fsync(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), SpoolConfig(clock=Clock()))
    try:
        fsyncs, commits = sp.writer.fsyncs, sp.writer.commits
        ids = sp.enqueue_many([("s@src.example", [RCPT, "b@dest.example"], b"m %d" % i) for i in range(500)])
        assert sp.writer.fsyncs - fsyncs == 1
        assert sp.writer.commits - commits == 1
        assert len(set(ids)) == 500
        assert admin.count(sp) == 500
    finally:
        sp.close()


def stream(sp: Spool, data: bytes, rnd: random.Random) -> int:
    w = sp.begin_body()
    i = 0
    while i < len(data):
        n = rnd.randint(1, 40_000)
        w.write(data[i:i + n])
        i += n
    mid = sp.enqueue("s@src.example", [RCPT], w)
    sp.commit()
    return mid


def test_streamed_body_larger_than_several_segments(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    config = SpoolConfig(retry_intervals=(10.0, 20.0), segment_size=64 * 1024, body_chunk=16 * 1024,
                         flush_threshold=64 * 1024, clock=clock)
    rnd = random.Random(7)
    data = rnd.randbytes(512 * 1024)
    sp = Spool.open(str(tmp_path), config)
    try:
        mid = stream(sp, data, rnd)
        assert len(segments(sp)) > 8
        msg = admin.find(sp, mid)
        assert msg.envelope.body_size == len(data)
        assert b"".join(sp.read_body(msg.envelope)) == data
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), config)
    try:
        (a,) = sp.poll_due()
        assert b"".join(sp.read_body(a.envelope)) == data
        clock.now += 50
        defer(sp, [a])  # the replacement shares the body: it lies within BODY_SLACK of the body's extent
        clock.now += 5
        assert sp.poll_due() == []  # the runners pass the first envelope, not yet the replacement
        sp.checkpoint()
        msg = admin.find(sp, mid)
        assert set(msg.envelope.body) == set(a.envelope.body)
        assert b"".join(sp.read_body(msg.envelope)) == data  # reclaiming kept every shared chunk
        assert sp.body_span >= 8, "recovery re-learned how far this body reaches behind its envelope"
    finally:
        sp.close()


def test_checkpoint_keeps_the_body_of_a_message_in_flight(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    config = SpoolConfig(retry_intervals=(10.0, 20.0), segment_size=64 * 1024, body_chunk=16 * 1024,
                         flush_threshold=64 * 1024, clock=clock)
    rnd = random.Random(9)
    data = rnd.randbytes(512 * 1024)
    sp = Spool.open(str(tmp_path), config)
    try:
        sp.enqueue("s@src.example", [RCPT], data)
        sp.commit()
        clock.now += 100  # every runner passes the body; the new-mail runner claims the message
        (a,) = sp.poll_due()
        sp.checkpoint()
        assert b"".join(sp.read_body(a.envelope)) == data
    finally:
        sp.close()


def test_streamed_body_with_default_flush_threshold_and_small_segments(tmp_path: Path) -> None:
    rnd = random.Random(8)
    data = rnd.randbytes(1 << 20)
    config = SpoolConfig(segment_size=64 * 1024, body_chunk=16 * 1024, clock=Clock())
    sp = Spool.open(str(tmp_path), config)
    try:
        mid = stream(sp, data, rnd)
        assert b"".join(sp.read_body(admin.find(sp, mid).envelope)) == data
    finally:
        sp.close()


@pytest.mark.parametrize("action", ["delete", "hold", "flush"])
def test_admin_change_is_respected_by_a_runner_that_already_read_the_envelope(tmp_path: Path, action: str) -> None:
    clock = Clock(900.0)
    sp = Spool.open(str(tmp_path), SpoolConfig(retry_intervals=(60.0,), clock=clock))
    try:
        first = sp.enqueue("s@src.example", [RCPT], b"first")
        sp.commit()
        defer(sp, sp.poll_due())  # deferred at 900
        clock.now = 1000.0
        second = sp.enqueue("s@src.example", [RCPT], b"second")
        sp.commit()
        defer(sp, sp.poll_due(limit=1))  # deferred at 1000; with limit 1 the class-1 runner did not scan
        # Now it does: it starts the first (due) and reads on into the second's replacement (not due).
        (a,) = sp.poll_due()
        assert a.message_id == first
        deliver(sp, [a])
        assert sp.change(second, action)
        clock.now = 1061.0
        started = [a.message_id for a in sp.poll_due()]
        if action == "flush":
            assert started == [second], "flushed mail must be started once, not twice"
        else:
            assert started == []
    finally:
        sp.close()


def test_a_flushed_message_that_fails_again_keeps_its_backoff(tmp_path: Path) -> None:
    """Issue 25, decided: ``flush`` retries now and does not reset the backoff (as Postfix's ``postqueue -f``):
    failing again, the message goes on from the class its attempts earned, not from the first retry interval.
    A whole-queue flush towards a dead destination must not put every message back on the shortest interval."""
    sp = Spool.open(str(tmp_path / "spool"), SpoolConfig(retry_intervals=(60.0, 600.0, 3600.0)))
    try:
        mid = sp.enqueue("a@example.org", ["b@far.example"], b"Subject: x\r\n\r\ny\r\n")
        sp.commit()

        def fail_once() -> int:
            (attempt,) = [a for a in sp.poll_due(time.time() + 1) if a.message_id == mid]
            sp.record_delivery(attempt, [Outcome("b@far.example", Status.DEFERRED, 451, "4.3.0", "later", "mx")])
            sp.finish(attempt)
            sp.commit()
            return admin.find(sp, mid).klass

        assert fail_once() == 1
        assert sp.change(mid, "flush") and admin.find(sp, mid).klass == 0
        assert fail_once() == 2  # not 1: the flush did not reset it
        assert sp.change(mid, "flush")
        assert fail_once() == 3
    finally:
        sp.close()
