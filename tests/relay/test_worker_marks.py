"""A delivery worker's own marks (``mta.delivery.worker_marks``): the marks that arrive during one fdatasync share
the next, and each caller returns only once its mark is in the file, synced."""

from __future__ import annotations

from pathlib import Path

import trio

from mta.delivery.worker_marks import WorkerMarks
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
