"""A delivery worker's own marks (``mta.delivery.worker_marks``): the marks that arrive during one fdatasync share
the next, each caller returns only once its mark is in the file, synced, and a dead worker's marks name the jobs
of its lost batches that passed their point."""

from __future__ import annotations

from pathlib import Path

import trio
from spool_support import spool_config

from mta.config import parse_config
from mta.delivery.transport import Job
from mta.delivery.worker_marks import GATHER_MAX, WorkerMarks
from mta.delivery.workers import DeliveryWorkers, _Batch, _Worker
from spool import StoredBody
from spool.engine.spool import Spool
from spool.format.marks import marks_dir
from spool.read.marks import marks_of
from spool.write.marks import MarksWriter


async def test_marks_that_arrive_during_one_sync_share_the_next_and_all_read_back(tmp_path: Path) -> None:
    marks = WorkerMarks(await trio.to_thread.run_sync(MarksWriter, str(tmp_path), "w0-7"))
    returned: list[int] = []

    async def one(i: int) -> None:
        await marks.mark(1000 + i, [f"r{i}@x.example"])
        returned.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(one, i)
    marks.close()
    assert sorted(returned) == list(range(20))
    assert marks.syncs < 20  # shared: one for the first, the rest for those that came during it
    got = {m.start_pos: m.recipients for m in marks_of(str(tmp_path), "w0-7")}
    assert got == {1000 + i: (f"r{i}@x.example",) for i in range(20)}


async def test_a_sync_waits_for_a_mark_on_its_way_and_one_fdatasync_covers_both(tmp_path: Path) -> None:
    coming = [1]  # the second delivery is on its way to its dot when the first asks for its mark
    marks = WorkerMarks(await trio.to_thread.run_sync(MarksWriter, str(tmp_path), "w0-8"), lambda: coming[0])
    first_done = trio.Event()

    async def first() -> None:
        await marks.mark(1000, ["a@x.example"])
        first_done.set()

    async def second() -> None:
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()  # after the sync has started waiting
        assert not first_done.is_set()
        coming[0] = 0
        await marks.mark(2000, ["b@x.example"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        nursery.start_soon(second)
    marks.close()
    assert marks.syncs == 1
    assert {m.start_pos for m in marks_of(str(tmp_path), "w0-8")} == {1000, 2000}


async def test_a_mark_that_nobody_joins_is_synced_after_the_gathering_bound(tmp_path: Path) -> None:
    # A batch that said it was coming never asks (its job failed before its dot): the mark is not held past the
    # bound. The bound is short (GATHER_MAX); the clock here is trio's real one.
    marks = WorkerMarks(await trio.to_thread.run_sync(MarksWriter, str(tmp_path), "w0-9"), lambda: 1)
    t0 = trio.current_time()
    await marks.mark(1000, ["a@x.example"])
    marks.close()
    assert marks.syncs == 1
    assert trio.current_time() - t0 >= GATHER_MAX
    assert [m.start_pos for m in marks_of(str(tmp_path), "w0-9")] == [1000]


async def test_a_dead_workers_marks_name_the_jobs_of_its_lost_batches_past_their_point(tmp_path: Path) -> None:
    """What the relay reads once a worker is gone: its marks, mapped to the lost batches' jobs by START, so that
    those jobs are held in doubt (``TransportLost.marked``) and the others go again."""
    sp = Spool.open(str(tmp_path / "spool"), spool_config())
    try:
        for i in range(3):
            sp.enqueue("a@src.example", [f"r{i}@x.example", f"s{i}@x.example"], b"body")
        sp.commit()
        attempts = sorted(sp.poll_due(), key=lambda a: a.start_pos)
        sp.commit()
        jobs = [Job(f"{a.message_id:X}", "a@src.example", tuple(a.remaining), StoredBody(sp, a), 4)
                for a in attempts]
        worker = _Worker(0)
        worker.pid = 4242
        with MarksWriter(marks_dir(sp.path), "w0-4242") as marks:  # job 1 passed its point for one recipient
            marks.add(attempts[1].start_pos, ["r1@x.example"])
            marks.sync()
        with MarksWriter(marks_dir(sp.path), "w0-4243") as other:  # another worker's life: not this one's
            other.add(attempts[2].start_pos, ["r2@x.example"])
            other.sync()
        workers = DeliveryWorkers(parse_config("", source=str(tmp_path / "x.toml"), base_dir=str(tmp_path)), 1)
        found = await workers._marks_of(worker, {7: _Batch(jobs, None)})
        assert found == {attempts[1].start_pos: ("r1@x.example",)}
    finally:
        sp.close()
