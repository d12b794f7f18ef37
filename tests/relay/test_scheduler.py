"""The delivery scheduler over a real spool: one wake-up per job, per-destination limits, batches, oldest first."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio
import trio.testing

from mta.config import parse_config
from mta.delivery.local import DiscardTransport
from mta.delivery.scheduler import Scheduler
from mta.delivery.transport import Destination, Job, OnOutcome, Transport, body_chunks
from mta.observe.metrics import Metrics
from spool.aio.async_spool import AsyncSpool
from spool.config.engine import SpoolConfig
from spool.format.record import Outcome, Status, format_id


class WorkerSteps(trio.abc.Instrument):
    """Counts the steps the scheduler's worker tasks take: each wake-up is at least one."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("Scheduler._worker"):
            self.steps += 1


class GatedTransport:
    """Holds every batch until the test opens the gate; records batches and concurrency."""

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.batches: list[list[str]] = []
        self.bodies: list[bytes] = []
        self.active = 0
        self.most_active = 0
        self.arrived = trio.Event()

    async def deliver(self, destination: Destination, jobs: Sequence[Job],
                      on_outcome: OnOutcome | None = None) -> list[list[Outcome]]:
        self.batches.append([j.queue_id for j in jobs])
        for job in jobs:
            self.bodies.append(b"".join([c async for c in body_chunks(job.body)]))
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        self.arrived.set()
        await self.gate.wait()
        self.active -= 1
        return [[Outcome(r, Status.DELIVERED, 250, "2.0.0", "ok", "test") for r in j.recipients] for j in jobs]


@asynccontextmanager
async def scheduler(tmp_path: Path, transport: Transport, delivery: str) -> AsyncIterator[tuple[AsyncSpool, Scheduler]]:
    cfg = parse_config(f'[spool]\ndir = "{tmp_path}"\n[delivery]\n{delivery}\n[routes]\n"dest.test" = "discard"\n',
                       base_dir=str(tmp_path))
    aspool = await AsyncSpool.open(str(tmp_path), SpoolConfig(checkpoint_interval=math.inf))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(aspool.run)
            sched = Scheduler(aspool, cfg, {"discard": transport}, Metrics())
            await nursery.start(sched.run)
            yield aspool, sched
            nursery.cancel_scope.cancel()
    finally:
        aspool.core.close()


class Delivered:
    """Queue ids whose DELIVERED outcome the scheduler reported durable; tests wait on counts."""

    def __init__(self, sched: Scheduler) -> None:
        self.ids: list[str] = []
        self._changed = trio.Event()
        sched.observers.append(self._observe)

    def _observe(self, qid: str, o: Outcome) -> None:
        if o.status is Status.DELIVERED:
            self.ids.append(qid)
            self._changed.set()
            self._changed = trio.Event()

    async def wait_for(self, n: int) -> None:
        with trio.fail_after(60):
            while len(self.ids) < n:
                await self._changed.wait()


async def test_one_message_wakes_one_worker_not_all(tmp_path: Path) -> None:
    async with scheduler(tmp_path, DiscardTransport(), "concurrency = 50") as (aspool, sched):
        got = Delivered(sched)
        await trio.testing.wait_all_tasks_blocked()
        probe = WorkerSteps()
        trio.lowlevel.add_instrument(probe)
        try:
            for i in range(3):
                await aspool.enqueue("s@src.example", ["r@dest.test"], b"m%d" % i)
                await got.wait_for(i + 1)
        finally:
            trio.lowlevel.remove_instrument(probe)
        # Waking all 50 idle workers per dispatch would take at least 150 steps.
        assert probe.steps < 3 * 12, f"{probe.steps} worker steps for 3 messages"


async def test_per_destination_limit_batches_and_oldest_first(tmp_path: Path) -> None:
    transport = GatedTransport()
    opts = "concurrency = 10\nper_destination = 2\nmax_messages_per_connection = 3"
    async with scheduler(tmp_path, transport, opts) as (aspool, sched):
        got = Delivered(sched)
        ids = await aspool.enqueue_many([("s@src.example", ["r@dest.test"], b"body %d" % i) for i in range(10)])
        with trio.fail_after(30):
            while len(transport.batches) < 2:
                await transport.arrived.wait()
                transport.arrived = trio.Event()
        await trio.testing.wait_all_tasks_blocked()
        assert transport.active == 2, "two connections to the destination, no more"
        # Oldest first, three per connection: the first two batches are the six oldest (which of the two reaches
        # the transport first is the order their points of no return came back from the commit).
        assert sorted(map(sorted, transport.batches[:2])) == \
            [sorted(format_id(m) for m in ids[:3]), sorted(format_id(m) for m in ids[3:6])], "oldest first"
        transport.gate.set()
        await got.wait_for(10)
        assert transport.most_active == 2
        assert all(len(b) <= 3 for b in transport.batches)
        assert sorted(q for b in transport.batches for q in b) == sorted(format_id(m) for m in ids)
        assert sorted(transport.bodies) == sorted(b"body %d" % i for i in range(10))
