"""``GroupCommit.commit_riding``: records in no hurry (delivery outcomes) ride the next commit somebody needs.

Real spool, real fdatasync; the spool's own sync counter (``writer.fsyncs``)
says how many commits a step cost. Bounds passed to ``commit_riding`` here are
long (``LONG``) where a test needs the ride to wait for something it does
next, so that a slow machine cannot make it run out first.
"""

from __future__ import annotations

import threading
from pathlib import Path

import trio
import trio.testing
from spool_support import running_spool, spool_config

from spool.aio.async_spool import AsyncSpool
from spool.engine.spool import Attempt
from spool.fileio import OsFileIO
from spool.format.record import Outcome, Status

LONG = 30.0


async def _claimed(aspool: AsyncSpool) -> Attempt:
    await aspool.enqueue("s@src.example", ["r@dest.example"], b"body " * 100)
    (attempt,) = await aspool.next_due()
    return attempt


async def test_an_outcome_rides_the_next_enqueue_commit_and_costs_no_sync_of_its_own(tmp_path: Path) -> None:
    async with running_spool(tmp_path, spool_config()) as aspool:
        attempt = await _claimed(aspool)
        token = aspool.expect_commit()  # a session between its RCPT and its end of data: a commit is coming
        aspool.append_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])
        upto = aspool.core.writer.head
        before = aspool.core.writer.fsyncs
        done = trio.Event()

        async def ride() -> None:
            await aspool.commit_riding(upto, LONG)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ride)
            await aspool.write_through()  # the outcome's bytes reach the file; nobody has asked for a sync
            assert not done.is_set() and aspool.core.writer.durable_end < upto
            aspool.withdraw_commit(token)  # the session's data has arrived: its message is enqueued
            await aspool.enqueue("s@src.example", ["q@dest.example"], b"next " * 100)
            await done.wait()
        assert aspool.core.writer.durable_end >= upto
        assert aspool.core.writer.fsyncs - before == 1  # the enqueue's commit, covering the outcome too
        assert aspool.rides == 1 and aspool.rides_run_out == 0


async def test_a_ride_that_no_commit_takes_is_committed_when_its_bound_runs_out(tmp_path: Path) -> None:
    async with running_spool(tmp_path, spool_config()) as aspool:
        attempt = await _claimed(aspool)
        token = aspool.expect_commit()  # announced, and never comes
        aspool.append_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])
        upto = aspool.core.writer.head
        await aspool.commit_riding(upto, 0.01)
        assert aspool.core.writer.durable_end >= upto
        assert aspool.rides == 1 and aspool.rides_run_out == 1
        aspool.withdraw_commit(token)


async def test_with_nothing_to_come_an_outcome_is_committed_at_once(tmp_path: Path) -> None:
    async with running_spool(tmp_path, spool_config()) as aspool:
        attempt = await _claimed(aspool)
        aspool.append_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])
        before = aspool.core.writer.fsyncs
        with trio.fail_after(LONG / 2):  # no ride: a ride would wait out the whole bound
            await aspool.commit_riding(None, LONG)
        assert aspool.rides == 0 and aspool.core.writer.fsyncs - before == 1


async def test_an_outcome_waits_for_its_own_records_only(tmp_path: Path) -> None:
    async with running_spool(tmp_path, spool_config()) as aspool:
        attempt = await _claimed(aspool)
        aspool.append_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])
        upto = aspool.core.writer.head
        await aspool.commit_riding(upto, LONG)
        aspool.finish(attempt)  # appended after the outcome: needs no sync, and gets none here
        before = aspool.core.writer.fsyncs
        await aspool.commit_riding(upto, LONG)
        assert aspool.core.writer.fsyncs == before
        assert aspool.core.writer.durable_end < aspool.core.writer.head  # the FINISH is still not durable


class GatedIO(OsFileIO):
    """The real file calls, where the test can hold the next write or fdatasync in its thread until released."""

    def __init__(self) -> None:
        self.gates: dict[str, tuple[threading.Event, threading.Event]] = {}  # call: (entered, release)

    def _gate(self, call: str) -> None:
        gate = self.gates.pop(call, None)
        if gate is not None:
            gate[0].set()
            gate[1].wait(LONG)

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        self._gate("write")
        return super().write(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        self._gate("fdatasync")
        super().fdatasync(fd)

    def hold(self, call: str) -> tuple[threading.Event, threading.Event]:
        """Hold the next ``call``: (set once a thread waits in it, set it to let the thread go on)."""
        gate = self.gates[call] = (threading.Event(), threading.Event())
        return gate


async def test_a_waiter_woken_before_the_sync_that_covers_it_asks_for_no_second_one(tmp_path: Path) -> None:
    """An enqueue woken by the write-only pass before its sync batch asked again for a sync, and after that
    batch the committer synced what was appended meanwhile (a FINISH) for nobody."""
    io = GatedIO()
    async with running_spool(tmp_path, spool_config(), io) as aspool:
        attempt = await _claimed(aspool)
        aspool.withdraw_commit(aspool.expect_commit())  # sessions announce: a lone message is cut at once
        in_write, end_write = io.hold("write")
        aspool.append_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])  # a write-only pass
        await trio.to_thread.run_sync(in_write.wait, LONG)
        before = aspool.core.writer.fsyncs
        async with trio.open_nursery() as nursery:
            nursery.start_soon(aspool.enqueue, "s@src.example", ["q@dest.example"], b"next " * 100)
            await trio.testing.wait_all_tasks_blocked()  # the enqueue waits for the pass in the thread
            in_sync, end_sync = io.hold("fdatasync")
            end_write.set()  # the write-only pass ends, waking the enqueue; its sync batch is taken at once
            await trio.to_thread.run_sync(in_sync.wait, LONG)
            await trio.testing.wait_all_tasks_blocked()  # the enqueue ran while its sync batch is in the thread
            aspool.finish(attempt)  # appended while that sync runs: needs none
            end_sync.set()
        await aspool.write_through()  # the FINISH written: by a pass that synced it (the bug) or by one that did not
        assert aspool.core.writer.fsyncs - before == 1
