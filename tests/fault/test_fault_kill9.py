"""Real crashes: bounded kill -9 cycles of the spool worker and of the real relay, checked against the ledger."""

from __future__ import annotations

import pytest

from fault_injection import kill9


@pytest.mark.slow
def test_twenty_kill_cycles_lose_nothing() -> None:
    summary = kill9.run(cycles=20, messages=12, concurrency=6, seed=3)
    assert summary.cycles == 20
    assert summary.acknowledged > 0
    assert summary.ok, summary.problems[:10]
    assert summary.lost == 0
    assert summary.delivered == summary.acknowledged


@pytest.mark.slow
def test_relay_kill_cycles_lose_nothing() -> None:
    """``mta serve`` killed with SIGKILL under SMTP load, restarted on its spool, drained: nothing lost.

    The next hop defers and refuses some recipients, so the count includes
    messages accounted for by a DSN that reached the sender.
    """
    summary = kill9.run(cycles=4, messages=8, concurrency=4, seed=5, relay=True)
    assert summary.cycles == 4
    assert summary.acknowledged > 0
    assert summary.ok, summary.problems[:10]
    assert summary.lost == 0
    assert summary.delivered + summary.bounced == summary.acknowledged
    assert summary.line().startswith("kill9 --relay: cycles 4, ")
