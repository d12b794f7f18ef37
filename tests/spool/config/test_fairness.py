"""The deferred budget: new mail keeps most of the claims, the backlog never starves. Fake clock, real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_injection.workloads import FakeClock as Clock
from spool.config.engine import SpoolConfig
from spool.config.fairness import BURST, DEFAULT_SHARE, QUIET, TRICKLE, DeferredBudget
from spool.engine.spool import Attempt, Spool
from spool.format.record import Outcome, Status

RCPT = "r@dest.example"
BACKLOG = 400


def work(sp: Spool, attempts: list[Attempt]) -> None:
    """What the scheduler does with instant outcomes: new mail delivered, deferred mail deferred again."""
    for a in attempts:
        status = Status.DELIVERED if a.klass == 0 else Status.DEFERRED
        sp.record_delivery(a, [Outcome(RCPT, status, 250 if a.klass == 0 else 451)])
    sp.commit()
    for a in attempts:
        sp.finish(a, next_class=None if a.klass == 0 else 1)
    sp.commit()


def backlog_spool(path: Path, clock: Clock) -> Spool:
    """BACKLOG messages deferred into class 1 (1 s interval) and already due again."""
    sp = Spool.open(str(path), SpoolConfig(retry_intervals=(1.0, 3600.0), active_limit=1000, clock=clock))
    sp.enqueue_many([("s@src.example", [RCPT], b"old %d" % i) for i in range(BACKLOG)])
    first = sp.poll_due()
    assert len(first) == BACKLOG
    for a in first:
        sp.finish(a, next_class=1)
    sp.commit()
    clock.now += 5
    return sp


def flow(sp: Spool, clock: Clock, ticks: int, new_per_tick: int, step: float = 0.1) -> tuple[int, int]:
    """New mail arriving every ``step`` s while a consumer claims up to 64 per poll. Returns (new, deferred)."""
    new = old = 0
    for _ in range(ticks):
        clock.now += step
        if new_per_tick:
            sp.enqueue_many([("s@src.example", [RCPT], b"new")] * new_per_tick)
        got = sp.poll_due(limit=64)
        new += sum(1 for a in got if a.klass == 0)
        old += sum(1 for a in got if a.klass != 0)
        work(sp, got)
    return new, old


# -- the spool -----------------------------------------------------------------------------


def test_new_mail_keeps_its_share_of_claims_while_a_backlog_is_due(tmp_path: Path) -> None:
    clock = Clock()
    sp = backlog_spool(tmp_path, clock)
    try:
        new, old = flow(sp, clock, ticks=50, new_per_tick=40)  # 400 new/s for 5 s
        assert new == 50 * 40  # new mail is never held back
        share = old / (new + old)
        # share of claims, plus the burst the budget may hold at the start
        assert 0.15 < share <= DEFAULT_SHARE + BURST / (new + old)
    finally:
        sp.close()


def test_the_backlog_drains_at_the_trickle_under_a_flood_of_new_mail(tmp_path: Path) -> None:
    clock = Clock()
    sp = backlog_spool(tmp_path, clock)
    sp.budget.share = 0.0  # the share alone would give the backlog nothing
    try:
        flow(sp, clock, ticks=1, new_per_tick=20)
        sp.budget.reset()  # no credit left from building the backlog
        new, old = flow(sp, clock, ticks=50, new_per_tick=20)
        assert new == 50 * 20
        assert TRICKLE * 5 - 1 <= old <= TRICKLE * 5 + 1
    finally:
        sp.close()


def test_the_backlog_runs_at_full_rate_once_new_mail_stops(tmp_path: Path) -> None:
    clock = Clock()
    sp = backlog_spool(tmp_path, clock)
    try:
        flow(sp, clock, ticks=10, new_per_tick=40)
        sp.budget.reset()
        clock.now += QUIET / 2
        rationed = sp.poll_due(limit=64)  # no new mail for half the quiet time: still only the trickle
        assert len(rationed) == int(TRICKLE * QUIET / 2) and all(a.klass == 1 for a in rationed)
        work(sp, rationed)
        clock.now += QUIET
        got = sp.poll_due(limit=64)
        assert len(got) == 64 and all(a.klass == 1 for a in got)
    finally:
        sp.close()


def test_share_one_turns_the_budget_off(tmp_path: Path) -> None:
    clock = Clock()
    sp = backlog_spool(tmp_path, clock)
    sp.budget.share = 1.0
    try:
        new, old = flow(sp, clock, ticks=5, new_per_tick=8)
        assert new == 40
        assert old == 5 * (64 - 8)  # deferred mail fills whatever room new mail leaves
    finally:
        sp.close()


def test_next_wake_waits_for_the_budget_instead_of_saying_now(tmp_path: Path) -> None:
    """A caller that sleeps until next_wake must not spin while deferred mail is due but rationed."""
    clock = Clock()
    sp = backlog_spool(tmp_path, clock)
    sp.budget.share = 0.0
    try:
        flow(sp, clock, ticks=3, new_per_tick=5)
        sp.budget.reset()
        assert sp.poll_due(limit=64) == []
        wake = sp.next_wake()
        assert wake is not None and wake == pytest.approx(clock.now + 1.0 / TRICKLE)
        clock.now = wake
        got = sp.poll_due(limit=64)
        assert len(got) == 1 and got[0].klass == 1
    finally:
        sp.close()


def test_a_poll_at_an_explicit_time_is_not_rationed(tmp_path: Path) -> None:
    """Checkers drain the queue with poll_due(now=...) until it returns nothing: that must mean nothing is due."""
    clock = Clock()
    sp = backlog_spool(tmp_path, clock)
    try:
        flow(sp, clock, ticks=3, new_per_tick=10)  # few enough that every poll claims all new mail
        sp.budget.reset()
        assert sp.budget.limited(clock.now)
        assert sp.poll_due(limit=BACKLOG) == []  # rationed: nothing allowed at this instant
        got = sp.poll_due(now=clock.now, limit=BACKLOG)
        assert len(got) > BACKLOG // 2 and all(a.klass == 1 for a in got)
        assert sp.poll_due(now=clock.now, limit=BACKLOG) == []  # so [] means: nothing due
    finally:
        sp.close()


def test_next_wake_is_now_for_a_due_backlog_with_no_new_mail(tmp_path: Path) -> None:
    clock = Clock()
    sp = backlog_spool(tmp_path, clock)
    try:
        assert len(sp.poll_due(limit=10)) == 10
        assert sp.next_wake() == clock.now
    finally:
        sp.close()


# -- the budget alone ----------------------------------------------------------------------


def test_budget_is_unlimited_until_new_mail_is_claimed_and_after_quiet() -> None:
    b = DeferredBudget(0.2)
    assert b.allowance(100.0) is None
    b.note_new(8, 100.0)
    assert b.allowance(100.0) == 2  # 8 * 0.2 / 0.8
    assert b.allowance(100.0 + QUIET) is None


def test_budget_takes_the_larger_of_share_and_trickle_not_their_sum() -> None:
    b = DeferredBudget(0.5, trickle=4.0)
    b.note_new(1, 0.0)
    b.allowance(0.0)
    b.note_new(3, 0.5)  # earned 4; the trickle earned 2 meanwhile
    assert b.allowance(0.5) == 4
    b.spend(4)
    assert b.allowance(0.5) == 0
    assert b.next_allowed(0.5) == pytest.approx(0.75)


def test_budget_buckets_are_capped_and_a_clock_set_back_earns_nothing() -> None:
    b = DeferredBudget(0.5, trickle=10.0, burst=5.0)
    b.note_new(100, 0.0)
    assert b.allowance(0.0) == 5
    b.spend(5)
    b.note_new(1, 0.5)
    assert b.allowance(0.5) == 5  # 1 earned, but the trickle filled its bucket to the cap
    b.spend(5)
    b.note_new(1, 0.2)  # the clock went back
    assert b.allowance(0.2) == 1


def test_budget_allows_a_claim_at_the_time_next_allowed_names() -> None:
    """The share's bucket short of a claim does not shorten the trickle's wait (a wake that finds nothing)."""
    b = DeferredBudget(0.2, trickle=10.0)
    b.note_new(1, 0.0)  # the share earned 0.25 of a claim; the trickle nothing yet
    assert b.allowance(0.0) == 0
    wake = b.next_allowed(0.0)
    assert wake == pytest.approx(0.1)
    assert b.allowance(wake) == 1


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_budget_refuses_a_share_outside_zero_to_one(share: float) -> None:
    with pytest.raises(ValueError, match="deferred_share"):
        DeferredBudget(share)
