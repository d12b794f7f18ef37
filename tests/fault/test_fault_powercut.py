"""Simulated power loss: the crash-state model, and bounded runs of every workload against the real engine."""

from __future__ import annotations

import pytest

from fault_injection import crashstates, powercut
from fault_injection.ledger import Ledger, judge
from fault_injection.recording import Event, Link, Recording, Rename, Sync, SyncDir, Write
from fault_injection.workloads import build_in_temp

STATES_PER_WORKLOAD = 60


def _states(rec: Recording, point: int) -> list[crashstates.State]:
    cands = crashstates.enumerate_states(rec, per_point=64, only_point=point)
    return [s for _, s, _ in crashstates.materialise(rec, [c.recipe for c in cands])]


def test_unsynced_write_may_vanish_or_tear_synced_write_survives() -> None:
    rec = Recording()
    rec.ops += [Link(0, "f", 1, False), SyncDir(0), Write(1, 0, b"a" * 1000), Sync(1), Write(1, 1000, b"b" * 600)]
    contents = {s.files["f"] for s in _states(rec, len(rec.ops))}
    # nothing, all, or torn at the sector boundaries 1024 and 1536
    assert contents == {b"a" * 1000 + b"b" * n for n in (0, 24, 536, 600)}


def test_rename_survives_only_after_the_directory_fsync() -> None:
    rec = Recording()
    rec.ops += [Link(0, "tmp", 1, False), Write(1, 0, b"x"), Sync(1), Rename(0, "tmp", 0, "ck", 1)]
    names = {tuple(sorted(s.files)) for s in _states(rec, len(rec.ops))}
    assert names == {(), ("tmp",), ("ck",)}
    rec.ops.append(SyncDir(0))
    assert [sorted(s.files) for s in _states(rec, len(rec.ops))] == [["ck"]]


def test_recipe_text_round_trips() -> None:
    r = crashstates.Recipe(12, ((3, 2, 512), (4, 0, -1)), ((0, 1),))
    assert crashstates.Recipe.parse(r.text()) == r


def test_ledger_flags_a_lost_acknowledged_message_and_counts_duplicates() -> None:
    led = Ledger.from_events([Event("enqueue", (1, ("a@x", "b@x"), b"body")), Event("remote", (1, "a@x")),
                              Event("committed", ())])
    lost = judge({}, led)
    assert len(lost.violations) == 2
    kept = judge({1: [(("a@x", "b@x"), b"body")]}, led)
    assert kept.ok and kept.duplicates == 1


@pytest.mark.parametrize("workload", ["enqueue-only", "deliver", "recovery"])
def test_bounded_powercut(workload: str) -> None:
    report = powercut.run(workload, STATES_PER_WORKLOAD, seed=0)
    assert report.explored == STATES_PER_WORKLOAD
    assert report.failed == 0, [f.replay_command() + " " + "; ".join(f.violations[:2]) for f in report.failures]


def test_a_recipe_replays() -> None:
    report = powercut.run("deliver", 3, seed=1)
    assert report.explored == 3
    cands = crashstates.enumerate_states(build_in_temp("deliver", 1)[0].recording)
    res = powercut.replay("deliver", 1, f"S=0;{cands[len(cands) // 2].recipe.text()}")
    assert res.ok, res.violations
