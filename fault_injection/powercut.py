"""Simulated power loss: recover from every crash state of a workload and check the ledger.

``python -m fault_injection powercut [--workload NAME] [--max-states N] [--seed S] [--replay RECIPE]``

A failing state prints its recipe (``S=<scenario>;K=<crash point>;F<ino>=...``):
the same workload and seed rebuild the same recording, so ``--replay`` with
that recipe materialises exactly that state again, recovers it and prints
what was wrong.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable

import attrs

from fault_injection import crashstates, scratch_dir
from fault_injection.ledger import CheckResult, Ledger, check
from fault_injection.workloads import WORKLOADS, FakeClock, Scenario, build, make_config
from spool.engine.spool import Spool


@attrs.define
class Failure:
    workload: str
    seed: int
    recipe: str
    violations: list[str]

    def replay_command(self) -> str:
        return (f"python -m fault_injection powercut --workload {self.workload} --seed {self.seed} "
                f"--replay '{self.recipe}'")


@attrs.define
class PowercutReport:
    explored: int = 0
    passed: int = 0
    failed: int = 0
    duplicates: int = 0
    candidates: int = 0
    failures: list[Failure] = attrs.field(factory=list)

    def line(self) -> str:
        return (f"crash states explored {self.explored}, passed {self.passed}, failed {self.failed}; "
                f"duplicates {self.duplicates} (of {self.candidates} distinct states enumerated)")


def check_state(scn: Scenario, state: crashstates.State, events: int, workdir: str) -> CheckResult:
    """Materialise ``state``, recover it with the real engine, and check it against the ledger."""
    root = tempfile.mkdtemp(prefix="state-", dir=workdir)
    try:
        state.write_to(root)
        led = Ledger.from_events(scn.prior + scn.recording.events()[:events])
        clock = FakeClock(scn.end_time + 5)
        try:
            sp = Spool.open(root, make_config(clock))
        except Exception as exc:
            return CheckResult([f"recovery raised {type(exc).__name__}: {exc}"])
        try:
            return check(sp, led)
        except Exception as exc:
            return CheckResult([f"checking the recovered spool raised {type(exc).__name__}: {exc}"])
        finally:
            sp.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(workload: str, max_states: int, seed: int = 0, *, per_point: int = 16, max_seeds: int = 200,
        progress: Callable[[str], None] | None = None) -> PowercutReport:
    """Explore up to ``max_states`` crash states of ``workload``.

    One seed's recording yields a few hundred distinct states; when they are
    used up, the next seeds (seed+1, seed+2, ...) record fresh runs.
    """
    report = PowercutReport()
    for s in range(seed, seed + max_seeds):
        if report.explored >= max_states:
            break
        _run_seed(workload, max_states - report.explored, s, per_point, report, progress)
    return report


def _run_seed(workload: str, budget: int, seed: int, per_point: int, report: PowercutReport,
              progress: Callable[[str], None] | None) -> None:
    workdir = tempfile.mkdtemp(prefix=f"logspool-powercut-{workload}-", dir=scratch_dir())
    try:
        scenarios = build(workload, seed, os.path.join(workdir, "build"))
        pool: list[tuple[int, crashstates.Candidate]] = []
        for i, scn in enumerate(scenarios):
            pool += [(i, c) for c in crashstates.enumerate_states(scn.recording, per_point=per_point, seed=seed)]
        report.candidates += len(pool)
        picked = pool if len(pool) <= budget else [pool[i] for i in sorted(random.Random(seed).sample(
            range(len(pool)), budget))]
        for i, scn in enumerate(scenarios):
            recipes = [c.recipe for j, c in picked if j == i]
            for recipe, state, events in crashstates.materialise(scn.recording, recipes):
                res = check_state(scn, state, events, workdir)
                report.explored += 1
                report.duplicates += res.duplicates
                if res.ok:
                    report.passed += 1
                    continue
                report.failed += 1
                fail = Failure(workload, seed, f"S={i};{recipe.text()}", res.violations)
                report.failures.append(fail)
                if progress:
                    progress(f"FAIL {fail.replay_command()}\n  " + "\n  ".join(res.violations[:5]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def replay(workload: str, seed: int, recipe_text: str) -> CheckResult:
    """Rebuild the recording, materialise the one state, recover and check it."""
    parts = recipe_text.split(";")
    scenario = 0
    if parts and parts[0].startswith("S="):
        scenario = int(parts[0][2:])
        parts = parts[1:]
    recipe = crashstates.Recipe.parse(";".join(parts))
    workdir = tempfile.mkdtemp(prefix=f"logspool-replay-{workload}-", dir=scratch_dir())
    try:
        scn = build(workload, seed, os.path.join(workdir, "build"))[scenario]
        state, events = crashstates.state_of(scn.recording, recipe)
        return check_state(scn, state, events, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def workloads_for(name: str | None) -> list[str]:
    return list(WORKLOADS) if name in (None, "all") else [str(name)]
