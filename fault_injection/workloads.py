"""Deterministic workloads on the spool, recorded for the crash-state builder.

Each workload runs the real engine over a ``RecordingFileIO`` with a fake
clock and a seeded random generator, so the same name and seed always give
the same recording (that is what makes a recipe replayable). Segments are
small (4 KiB) so that rotation, checkpoints and segment deletion all happen
within a few hundred operations.

- ``enqueue-only``: batches of messages, one commit each, checkpoints;
- ``deliver``: enqueue, claim, simulated remote answers (delivered, deferred,
  bounced), DELIVERY records, finish with replacement envelopes, retries from
  the deferred runners, checkpoints that delete segments;
- ``flush-rotate``: bodies big enough that the engine writes them early,
  without a sync (``flush_threshold`` of 1 KiB), so that write-only batches
  end at a segment's tail and the next synced batch begins with the next
  segment's header: every commit must make every segment it covers durable;
- ``recovery``: crash states of ``deliver`` recovered under the recorder,
  followed by a round of deliveries: the crash states of *that* recording are
  crashes during recovery's own writes (recovery of recovery).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable

import attrs

from fault_injection import scratch_dir
from fault_injection.crashstates import Recipe, Walker
from fault_injection.recording import Event, Recording, RecordingFileIO
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status

START_TIME = 1_700_000_000.0
WORKLOADS = ("enqueue-only", "deliver", "flush-rotate", "recovery")


class FakeClock:
    """A manual clock for the spool (``SpoolConfig.clock``): record and due times follow ``now``, which only
    its owner moves. The harnesses and the spool tests share it."""

    def __init__(self, now: float = START_TIME) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_config(clock: Callable[[], float], *, flush_threshold: int = 4 << 20) -> SpoolConfig:
    return SpoolConfig(segment_size=4096, retry_intervals=(1.0, 2.0), body_chunk=1024, clock=clock,
                       checkpoint_interval=float("inf"), flush_threshold=flush_threshold)


# The flush-rotate workload's threshold: a write (no sync) is asked for at half of it.
SMALL_FLUSH = 1024


@attrs.define
class Scenario:
    """One recording plus the events that happened before it began (for recovery-of-recovery)."""

    name: str
    recording: Recording
    prior: list[Event]
    end_time: float


def _rcpts(rng: random.Random) -> tuple[str, ...]:
    return tuple(f"u{rng.randrange(1000)}-{i}@d{rng.randrange(3)}.example" for i in range(rng.randint(1, 3)))


def enqueue_logged(sp: Spool, rio: RecordingFileIO, rng: random.Random, max_body: int) -> None:
    rcpts = _rcpts(rng)
    body = rng.randbytes(rng.randint(1, max_body))
    mid = sp.enqueue("sender@example.org", rcpts, body)
    rio.event("enqueue", mid, rcpts, body)


def commit_logged(sp: Spool, rio: RecordingFileIO) -> None:
    sp.commit()
    rio.event("committed")
    if sp.writer.room_wanted():
        # As the trio committer does between commits (spool.write.room): zeroed, synced room ahead of the next
        # records, so that every crash state of the room (zeros never synced, a cut at rotation) is explored.
        sp.writer.make_room()


def enqueue_only(root: str, seed: int, clock: FakeClock) -> Recording:
    rio = RecordingFileIO(root)
    rng = random.Random(seed)
    sp = Spool.open(root, make_config(clock), io=rio)
    try:
        for batch in range(14):
            for _ in range(rng.randint(1, 3)):
                enqueue_logged(sp, rio, rng, 1400)
            commit_logged(sp, rio)
            clock.advance(0.5)
            if batch % 5 == 4:
                sp.checkpoint()
    finally:
        sp.close()
    return rio.rec


def flush_rotate(root: str, seed: int, clock: FakeClock) -> Recording:
    """Enqueue-and-deliver with early body writes: rotations fall between a write-only batch and a commit."""
    rio = RecordingFileIO(root)
    rng = random.Random(seed)
    sp = Spool.open(root, make_config(clock, flush_threshold=SMALL_FLUSH), io=rio)
    try:
        for step in range(16):
            for _ in range(rng.randint(1, 3)):
                enqueue_logged(sp, rio, rng, 1400)
            commit_logged(sp, rio)
            if step % 2:
                deliver_round(sp, rio, rng, clock)
            clock.advance(0.6)
            if step % 5 == 4:
                sp.checkpoint()
    finally:
        sp.close()
    return rio.rec


def deliver_round(sp: Spool, rio: RecordingFileIO, rng: random.Random, clock: FakeClock) -> None:
    """Claim what is due and give every recipient a simulated remote answer."""
    for attempt in sp.poll_due(now=clock(), limit=3):
        outs = []
        for r in attempt.remaining:
            x = rng.random()
            if x < 0.6:
                rio.event("remote", attempt.message_id, r)
                outs.append(Outcome(r, Status.DELIVERED, 250, "2.0.0", "ok", "mx.example"))
            elif x < 0.85:
                outs.append(Outcome(r, Status.DEFERRED, 451, "4.3.0", "try later", "mx.example"))
            else:
                outs.append(Outcome(r, Status.BOUNCED, 550, "5.1.1", "no such user", "mx.example"))
        sp.record_delivery(attempt, outs)
        for o in outs:
            rio.event("outcome", attempt.message_id, o.recipient, int(o.status))
        commit_logged(sp, rio)
        sp.finish(attempt)


def deliver(root: str, seed: int, clock: FakeClock, steps: int = 18) -> Recording:
    rio = RecordingFileIO(root)
    rng = random.Random(seed)
    sp = Spool.open(root, make_config(clock), io=rio)
    try:
        for step in range(steps):
            for _ in range(rng.randint(0, 2)):
                enqueue_logged(sp, rio, rng, 900)
            commit_logged(sp, rio)
            deliver_round(sp, rio, rng, clock)
            clock.advance(0.7)
            if step % 3 == 2:
                sp.checkpoint()
    finally:
        sp.close()
    return rio.rec


def recovery(workdir: str, seed: int, bases: int = 4) -> list[Scenario]:
    """Record recovery (and a delivery round after it) from a few crash states of ``deliver``."""
    clock = FakeClock()
    base_root = os.path.join(workdir, "base")
    os.makedirs(base_root)
    base = deliver(base_root, seed, clock)
    rng = random.Random(seed ^ 0x5EED)
    mutating = [k for k, op in enumerate(base.ops) if not isinstance(op, Event)]
    points = sorted(rng.sample(mutating[len(mutating) // 4:], bases))
    scenarios: list[Scenario] = []
    walker = Walker(base)
    for k in walker.points():
        if k not in points:
            continue
        files, dirs = walker.choices()
        # alternate the kill -9 state (all issued writes survive) with the power-cut minimum
        full = len(scenarios) % 2 == 0
        recipe = Recipe(k, tuple(max((o for o in g if o[2] < 0), key=lambda o: o[1]) if full else g[0]
                                 for g in files),
                        tuple(g[-1] if full else g[0] for g in dirs))
        state = walker.state(recipe)
        root = os.path.join(workdir, f"rec{len(scenarios)}")
        state.write_to(root)
        prior = [*base.events()[:walker.events], Event("crash", ())]
        rclock = FakeClock(clock.now + 10)
        rio = RecordingFileIO(root)
        try:
            sp = Spool.open(root, make_config(rclock), io=rio)
        except Exception:
            continue  # the base powercut run reports this state; nothing to record here
        try:
            deliver_round(sp, rio, random.Random(seed + k), rclock)
            sp.checkpoint()
        finally:
            sp.close()
        scenarios.append(Scenario(f"recovery@{recipe.text()}", rio.rec, prior, rclock.now))
    return scenarios


def build(name: str, seed: int, workdir: str) -> list[Scenario]:
    """Run workload ``name`` under the recorder in ``workdir``; return its scenarios."""
    if name == "recovery":
        return recovery(workdir, seed)
    root = os.path.join(workdir, "spool")
    os.makedirs(root)
    clock = FakeClock()
    if name == "enqueue-only":
        rec = enqueue_only(root, seed, clock)
    elif name == "deliver":
        rec = deliver(root, seed, clock)
    elif name == "flush-rotate":
        rec = flush_rotate(root, seed, clock)
    else:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return [Scenario(name, rec, [], clock.now)]


def build_in_temp(name: str, seed: int) -> list[Scenario]:
    workdir = tempfile.mkdtemp(prefix=f"logspool-{name}-", dir=scratch_dir())
    try:
        return build(name, seed, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
