"""Real crashes: bounded kill -9 cycles of the spool worker, checked against the ledger."""

from __future__ import annotations

from fault_injection import kill9


def test_twenty_kill_cycles_lose_nothing() -> None:
    summary = kill9.run(cycles=20, messages=12, concurrency=6, seed=3)
    assert summary.cycles == 20
    assert summary.acknowledged > 0
    assert summary.ok, summary.problems[:10]
    assert summary.lost == 0
    assert summary.delivered == summary.acknowledged
