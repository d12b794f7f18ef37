"""The trio layer: group commit, wake-ups without polling, durable deliveries, admin changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from spool_support import running_spool, spool_config

from fault_injection.workloads import FakeClock as Clock
from spool.engine.spool import Spool
from spool.errors import MessageBusy, NotFound
from spool.format.record import HELD_CLASS, Outcome, Status
from spool.read import listing as admin


def reopen(path: Path, clock: Clock) -> Spool:
    return Spool.open(str(path), spool_config(clock))


async def test_concurrent_enqueues_share_fsyncs(tmp_path: Path) -> None:
    clock = Clock()
    ids: list[int] = []
    async with running_spool(tmp_path, spool_config(clock)) as aspool:
        writer = aspool.core.writer
        commits, fsyncs = writer.commits, writer.fsyncs

        async def one(i: int) -> None:
            ids.append(await aspool.enqueue("s@src.example", [f"r{i}@dest.example"], b"body %d" % i))
            # durable when enqueue returns: the caller may say 250 now
            assert writer.durable_end > ids[-1]

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
        assert len(set(ids)) == 200
        assert writer.commits - commits < 200 / 5, f"{writer.commits - commits} commits for 200 messages"
        assert writer.fsyncs - fsyncs < 200 / 5
    sp = reopen(tmp_path, clock)
    try:
        assert {m.message_id for m in admin.iter_live(sp)} == set(ids)
    finally:
        sp.close()


async def test_next_due_wakes_for_new_mail_without_time_passing(tmp_path: Path,
                                                                mock_clock: trio.testing.MockClock) -> None:
    """trio's clock is frozen (no autojump): a waiter that polled on a timer would never return."""
    clock = Clock()
    got: list[int] = []
    async with running_spool(tmp_path, spool_config(clock)) as aspool:

        returned = trio.Event()

        async def waiter() -> None:
            got.extend(a.message_id for a in await aspool.next_due())
            returned.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            t0 = trio.current_time()
            mid = await aspool.enqueue("s@src.example", ["r@dest.example"], b"hello")
            await returned.wait()  # next_due commits its claims (a thread) before it returns
            assert got == [mid]
            assert trio.current_time() == t0


async def test_next_due_at_the_active_limit_wakes_when_a_finish_frees_room(tmp_path: Path) -> None:
    """A finish wakes next_due only when it frees room under active_limit (no wake-up per finish otherwise).

    With no room, next_due waits on no timer, and the lazy commit of the FINISH is an hour away: only the
    finish's own wake-up can end the wait before the 30 s bound.
    """
    clock = Clock()
    async with running_spool(tmp_path, spool_config(clock, active_limit=1, lazy_commit_delay=3600.0)) as aspool:
        first, second = await aspool.enqueue_many([("s@src.example", ["r@dest.example"], b"m%d" % i)
                                                   for i in range(2)])
        (attempt,) = await aspool.next_due()
        assert attempt.message_id == first
        got: list[int] = []
        returned = trio.Event()

        async def waiter() -> None:
            got.extend(a.message_id for a in await aspool.next_due())
            returned.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # the second is due, but there is no room
            await aspool.record_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])
            await trio.testing.wait_all_tasks_blocked()  # the commit's wake-up came and went: no room yet
            assert got == []
            aspool.finish(attempt)
            with trio.fail_after(30):
                await returned.wait()
            assert got == [second]


async def test_next_due_returns_at_once_when_mail_is_waiting(tmp_path: Path,
                                                             mock_clock: trio.testing.MockClock) -> None:
    clock = Clock()
    async with running_spool(tmp_path, spool_config(clock)) as aspool:
        ids = await aspool.enqueue_many([("s@src.example", ["r@dest.example"], b"m%d" % i) for i in range(5)])
        first = await aspool.next_due(limit=3)
        rest = await aspool.next_due()
        assert [a.message_id for a in first + rest] == ids
        assert trio.current_time() == 0


async def test_record_delivery_is_durable_when_it_returns(tmp_path: Path) -> None:
    clock = Clock()
    async with running_spool(tmp_path, spool_config(clock)) as aspool:
        done = await aspool.enqueue("s@src.example", ["a@x.example", "b@y.example"], b"one")
        half = await aspool.enqueue("s@src.example", ["c@x.example", "d@y.example"], b"two")
        attempts = {a.message_id: a for a in await aspool.next_due()}
        await aspool.pass_point_of_no_return(attempts[half], ["c@x.example", "d@y.example"])
        await aspool.record_delivery(attempts[done], [Outcome("a@x.example", Status.DELIVERED, 250),
                                                      Outcome("b@y.example", Status.BOUNCED, 550)])
        await aspool.record_delivery(attempts[half], [Outcome("c@x.example", Status.DELIVERED, 250)])
        # crash now: no finish, no commit of anything else
    sp = reopen(tmp_path, clock)
    try:
        live = {m.message_id: m for m in admin.iter_live(sp)}
        assert done not in live
        assert live[half].envelope.recipients == ("d@y.example",)
        assert live[half].envelope.in_doubt == ("d@y.example",)
        assert sp.recovery_stats.in_flight == 2
        assert sp.recovery_stats.in_doubt == 1
    finally:
        sp.close()


async def test_finish_is_rebuilt_after_a_crash(tmp_path: Path) -> None:
    clock = Clock()
    async with running_spool(tmp_path, spool_config(clock)) as aspool:
        mid = await aspool.enqueue("s@src.example", ["a@x.example"], b"body")
        (a,) = await aspool.next_due()
        await aspool.record_delivery(a, [Outcome("a@x.example", Status.DEFERRED, 451)])
        assert aspool.finish(a) is not None
        assert list(await aspool.read_body(a)) == [b"body"]
    sp = reopen(tmp_path, clock)
    try:
        (m,) = admin.iter_live(sp)
        assert m.message_id == mid and m.envelope.recipients == ("a@x.example",)
        assert m.envelope.in_doubt == ()
    finally:
        sp.close()


async def test_admin_operations(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    clock = Clock()
    async with running_spool(tmp_path, spool_config(clock)) as aspool:
        held, deferred, busy, doomed = await aspool.enqueue_many(
            [("s@src.example", [f"r{i}@dest.example"], b"m%d" % i) for i in range(4)])
        await aspool.hold(held)
        assert (await aspool.find(held)).held
        await aspool.delete(doomed)
        with pytest.raises(NotFound):
            await aspool.find(doomed)

        attempts = {a.message_id: a for a in await aspool.next_due()}
        assert set(attempts) == {deferred, busy}, "held and deleted mail is not started"
        with pytest.raises(MessageBusy):
            await aspool.hold(busy)

        a = attempts[deferred]
        await aspool.record_delivery(a, [Outcome("r1@dest.example", Status.DEFERRED, 451)])
        aspool.finish(a)
        await aspool.commit()
        assert (await aspool.find(deferred)).klass == 1
        # flush: due now, though its class would wait a minute (the spool's clock does not move)
        await aspool.flush(deferred)
        (again,) = await aspool.next_due()
        assert again.message_id == deferred and again.klass == 0

        await aspool.release(held)
        (released,) = await aspool.next_due()
        assert released.message_id == held and not released.envelope.held
        assert list(await aspool.read_body(released)) == [b"m0"]

        await aspool.commit()
        assert isinstance(await aspool.checkpoint(), list)
        assert admin.count(aspool.core) == 3
    # All three were being delivered at the close: "redeliver", or recovery would hold them in doubt.
    sp = Spool.open(str(tmp_path), spool_config(clock, in_doubt="redeliver"))
    try:
        ids = {m.message_id for m in admin.iter_live(sp)}
        assert ids == {held, deferred, busy}
        assert all(m.klass != HELD_CLASS for m in admin.iter_live(sp))
    finally:
        sp.close()
