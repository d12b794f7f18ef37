"""The trio layer's economies: no polling when idle, lazy commits, bodies read lazily or not at all.

trio's MockClock drives time here, and the spool's clock follows it (plus an
epoch), so a deferred message comes due when trio's clock says so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import trio
import trio.testing
from spool_support import running_spool, spool_config

from spool.aio.async_spool import INLINE_READ, AsyncSpool, StoredBody
from spool.engine.core import Attempt
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status

EPOCH = 1_000_000.0


def trio_clock() -> float:
    """The spool's clock: trio's (mock) time after EPOCH; EPOCH outside trio (Spool.open runs in a thread)."""
    try:
        return EPOCH + trio.current_time()
    except RuntimeError:
        return EPOCH


def passes(core: Spool) -> int:
    return sum(r.passes for r in core.runners)



async def claimed_with_outcome(aspool: AsyncSpool, status: Status, code: int) -> Attempt:
    """One message enqueued, claimed, and its outcome recorded (committed): the attempt, not yet finished."""
    await aspool.enqueue("s@src.example", ["r@dest.example"], b"one")
    (a,) = await aspool.next_due()
    await aspool.record_delivery(a, [Outcome("r@dest.example", status, code)])
    return a

async def test_runner_reads_nothing_while_the_log_and_clock_stand_still(tmp_path: Path) -> None:
    async with running_spool(tmp_path, spool_config(trio_clock)) as aspool:
        core = aspool.core
        mid = await aspool.enqueue("s@src.example", ["r@dest.example"], b"hello")
        (a,) = await aspool.next_due()
        assert a.message_id == mid
        assert core.poll_due() == []  # one pass over the START that next_due committed
        before = (passes(core), sum(r.bytes_read for r in core.runners))
        for _ in range(50):
            assert core.poll_due() == []
        assert (passes(core), sum(r.bytes_read for r in core.runners)) == before
        # a new durable record is new work for the new-mail runner again
        second = await aspool.enqueue("s@src.example", ["r@dest.example"], b"again")
        assert [x.message_id for x in core.poll_due()] == [second]


async def test_next_due_sleeps_until_the_deferred_message_is_due(tmp_path: Path,
                                                                 autojump_clock: trio.testing.MockClock) -> None:
    """No polling on a timer: a handful of runner passes over a minute's wait, and it returns on time."""
    async with running_spool(tmp_path, spool_config(trio_clock)) as aspool:
        mid = await aspool.enqueue("s@src.example", ["r@dest.example"], b"hello")
        (a,) = await aspool.next_due()
        await aspool.record_delivery(a, [Outcome("r@dest.example", Status.DEFERRED, 451)])
        aspool.finish(a)
        # (autojump moves trio's clock while a worker thread syncs: let the replacement be durable first)
        await aspool.commit()
        deferred_at = trio.current_time()
        p0 = passes(aspool.core)
        (again,) = await aspool.next_due()
        assert again.message_id == mid and again.klass == 1
        waited = trio.current_time() - deferred_at
        assert 59.0 <= waited <= 62.0, waited
        assert passes(aspool.core) - p0 < 12, f"{passes(aspool.core) - p0} runner passes while waiting"


async def test_idle_spool_neither_checkpoints_nor_syncs(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    """Trio's clock moves only when the test says: one checkpoint interval at a time, once every task waits.

    A checkpoint's fsyncs run in a worker thread: a pass under way is waited
    for on the spool's event at each checkpoint attempt, not on the clock.
    """

    async def intervals(n: int) -> None:
        for _ in range(n):
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(0.02)
        await trio.testing.wait_all_tasks_blocked()

    async def checkpoints_after(n: int) -> None:
        for _ in range(100):
            if aspool.checkpoint_passes > n:
                while aspool.core.checkpoint_state is None \
                        or aspool.core.checkpoint_state.head < aspool.core.writer.durable_end:
                    await aspool.disk_event()
                return
            await intervals(1)
        raise AssertionError(f"no checkpoint pass in 100 intervals after pass {n}")

    async with running_spool(tmp_path, spool_config(trio_clock, checkpoint_interval=0.02)) as aspool:
        core = aspool.core
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"hello")
        await checkpoints_after(0)
        ran, fsyncs = aspool.checkpoint_passes, core.writer.fsyncs
        await intervals(25)  # with nothing to do
        assert aspool.checkpoint_passes == ran, "no checkpoint pass while nothing changes"
        assert core.writer.fsyncs == fsyncs
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"more")
        await checkpoints_after(ran)  # a change is checkpointed again


async def test_finish_rides_with_the_next_commit(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with running_spool(tmp_path, spool_config(trio_clock, lazy_commit_delay=0.1)) as aspool:
        w = aspool.core.writer
        a = await claimed_with_outcome(aspool, Status.DELIVERED, 250)
        fsyncs, commits = w.fsyncs, w.commits
        aspool.finish(a)
        finish_end = w.head
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"two")
        assert w.durable_end >= finish_end
        assert w.commits - commits == 1 and w.fsyncs - fsyncs == 1
        await trio.sleep(1)
        await aspool.commit()
        assert w.fsyncs - fsyncs == 1, "nothing was left for a lazy commit to sync"


async def test_finish_alone_is_committed_after_the_lazy_delay(tmp_path: Path,
                                                              autojump_clock: trio.testing.MockClock) -> None:
    async with running_spool(tmp_path, spool_config(trio_clock, lazy_commit_delay=0.1)) as aspool:
        w = aspool.core.writer
        a = await claimed_with_outcome(aspool, Status.DEFERRED, 451)
        fsyncs = w.fsyncs
        aspool.finish(a)
        assert w.has_pending and w.fsyncs == fsyncs, "finish starts no commit of its own"
        await trio.sleep(1)
        assert aspool.lazy_commits == 1
        await aspool.commit()  # waits for the lazy commit's sync, adds none of its own
        assert w.fsyncs - fsyncs == 1 and not w.has_pending


async def test_a_delivered_finish_alone_is_written_without_an_fsync(tmp_path: Path,
                                                                    autojump_clock: trio.testing.MockClock) -> None:
    """A FINISH that nothing waits for is written (a killed process leaves it) but costs no fsync of its own."""
    async with running_spool(tmp_path, spool_config(trio_clock, lazy_commit_delay=0.1)) as aspool:
        w = aspool.core.writer
        a = await claimed_with_outcome(aspool, Status.DELIVERED, 250)
        fsyncs, durable = w.fsyncs, w.durable_end
        aspool.finish(a)
        finish_end = w.head
        await trio.sleep(1)
        assert aspool.lazy_writes == 1 and aspool.lazy_commits == 0
        await aspool.write_through()  # the lazy pass's thread may still be writing (the mock clock jumped)
        assert w.written_end >= finish_end and not w.has_chunks, "the FINISH is in the file"
        assert w.fsyncs == fsyncs and w.durable_end == durable, "and it cost no fsync"
        # what kill -9 leaves now: the attempt is over, nothing is in flight or due again
        copy = tmp_path.parent / f"{tmp_path.name}-killed"
        shutil.copytree(tmp_path, copy)
        sp = Spool.open(str(copy), spool_config(trio_clock))
        try:
            assert sp.recovery_stats.in_flight == 0 and sp.poll_due() == []
        finally:
            sp.close()
        # the next commit somebody needs makes it durable, with one fsync for both
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"two")
        assert w.durable_end > finish_end and w.fsyncs - fsyncs == 1


async def test_a_checkpoint_waiting_for_a_finish_alone_gets_it_synced(tmp_path: Path,
                                                                     autojump_clock: trio.testing.MockClock) -> None:
    """A FINISH only written is synced when a checkpoint waits for it (it may not name what is not durable)."""
    async with running_spool(tmp_path, spool_config(trio_clock, lazy_commit_delay=0.1)) as aspool:
        w = aspool.core.writer
        a = await claimed_with_outcome(aspool, Status.DELIVERED, 250)
        aspool.finish(a)
        await trio.sleep(1)
        await aspool.write_through()
        assert aspool.lazy_writes == 1 and w.durable_end < w.written_end == w.head
        await aspool.checkpoint()
        cp = aspool.core.checkpoint_state
        assert cp is not None and cp.head == w.head == w.durable_end
        assert aspool.lazy_commits == 1


async def test_body_of_fresh_mail_comes_from_the_cache(tmp_path: Path) -> None:
    async with running_spool(tmp_path, spool_config(trio_clock)) as aspool:
        core = aspool.core
        body = b"Subject: x\r\n\r\n" + b"y" * 5000
        await aspool.enqueue("s@src.example", ["r@dest.example"], body)
        (a,) = await aspool.next_due()
        stored = await aspool.read_body(a)
        assert isinstance(stored, StoredBody) and stored.cached
        assert b"".join(stored) == body
        assert b"".join([c async for c in stored]) == body
        await aspool.record_delivery(a, [Outcome("r@dest.example", Status.DEFERRED, 451)])
        aspool.finish(a)
        assert len(core.body_cache) == 0 and core.body_cache.bytes == 0, "an ended attempt leaves the cache"
        assert b"".join(core.read_body(a.envelope)) == body


async def test_big_body_is_read_lazily_and_again(tmp_path: Path) -> None:
    cfg = spool_config(trio_clock, body_chunk=16 * 1024, body_cache=64 * 1024)
    async with running_spool(tmp_path, cfg) as aspool:
        body = bytes(range(256)) * (4 * INLINE_READ // 256)
        writer = aspool.begin_body()
        for i in range(0, len(body), 10_000):
            writer.write(body[i:i + 10_000])
        await aspool.enqueue("s@src.example", ["r@dest.example"], writer)
        assert len(aspool.core.body_cache) == 0, "too big for the cache"
        (a,) = await aspool.next_due()
        stored = await aspool.read_body(a)
        assert not stored.cached
        chunks = [c async for c in stored]
        assert len(chunks) == len(body) // (16 * 1024) and b"".join(chunks) == body
        assert b"".join(stored) == body, "iterable again, from the start"


async def test_wait_flushed_brings_the_backlog_under_the_threshold(tmp_path: Path) -> None:
    cfg = spool_config(trio_clock, flush_threshold=64 * 1024, body_chunk=16 * 1024)
    async with running_spool(tmp_path, cfg) as aspool:
        writer = aspool.begin_body()
        writer.write(b"z" * 200 * 1024)  # no await: the committer has not run
        assert aspool.unflushed_bytes >= 192 * 1024  # all but the last partial chunk
        await aspool.wait_flushed()
        assert aspool.unflushed_bytes < 64 * 1024
        await aspool.wait_flushed()  # under the threshold: returns at once
        await aspool.enqueue("s@src.example", ["r@dest.example"], writer)
        (a,) = await aspool.next_due()
        assert b"".join(await aspool.read_body(a)) == b"z" * 200 * 1024


async def test_claims_are_written_before_delivery_without_an_fsync(tmp_path: Path) -> None:
    async with running_spool(tmp_path, spool_config(trio_clock)) as aspool:
        w = aspool.core.writer
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"hello")
        fsyncs = w.fsyncs
        (a,) = await aspool.next_due()
        assert w.written_end > a.start_pos, "the START is in the file: a killed process leaves it"
        assert w.fsyncs == fsyncs and w.durable_end <= a.start_pos, "and it cost no fsync"
        # recovery from the files as they are now (what kill -9 would leave) finds the attempt
        copy = tmp_path.parent / f"{tmp_path.name}-killed"
        shutil.copytree(tmp_path, copy)
        sp = Spool.open(str(copy), spool_config(trio_clock))
        try:
            assert sp.recovery_stats.in_flight == 1
        finally:
            sp.close()
