"""``spool.aio.idle.wait_idle``: the group commit's "no task can run" without trio.testing (and pytest) in the relay."""

from __future__ import annotations

import subprocess
import sys

import trio
import trio.testing

from spool.aio.idle import wait_idle


async def steps(n: int, done: list[int], i: int) -> None:
    for _ in range(n):
        await trio.lowlevel.checkpoint()
    done.append(i)


async def test_returns_only_once_every_other_task_has_blocked() -> None:
    done: list[int] = []
    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(steps, 50 * i, done, i)
        await wait_idle()
        assert sorted(done) == list(range(10)), "a task could still run"


async def test_a_task_woken_by_io_is_waited_for() -> None:
    """A reader whose data is already in its socket is runnable through the I/O poll, not the run queue."""
    left, right = trio.socket.socketpair()
    got: list[bytes] = []

    async def reader() -> None:
        for _ in range(20):
            got.append(await right.recv(1))  # noqa: PERF401 -- one by one, as the checks below see it fill

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await wait_idle()
        assert got == []
        await left.send(b"x" * 20)
        await wait_idle()
        assert len(got) == 20
    left.close()
    right.close()


async def test_a_task_that_never_blocks_keeps_it_waiting(autojump_clock: trio.testing.MockClock) -> None:
    turns = 0

    async def spinner() -> None:
        nonlocal turns
        while turns < 3_000:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spinner)
        await wait_idle()
        assert turns == 3_000


async def test_it_is_a_cancellable_checkpoint() -> None:
    stop = trio.Event()

    async def spinner() -> None:
        for _ in range(10_000_000):
            if stop.is_set():
                return
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spinner)
        with trio.move_on_after(0.05) as scope:
            await wait_idle()
        stop.set()
    assert scope.cancelled_caught


async def test_several_waiters_do_not_keep_each_other_waiting() -> None:
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await wait_idle()
        woken.append(i)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(waiter, i)
    assert sorted(woken) == [0, 1, 2]
    await wait_idle()  # and the shared counter is gone: a later wait starts afresh


def test_the_relay_imports_no_test_framework() -> None:
    """trio.testing imports pytest: tens of milliseconds and a test framework in every relay process."""
    code = ("import sys, mta.process.relay, mta.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest') "
            "or m.startswith('trio.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


async def test_enough_ends_the_wait_while_others_still_run() -> None:
    """The group commit's window: a lone client's message ends the wait for idle at once."""
    flag = False
    turns = 0

    async def spinner() -> None:
        nonlocal turns
        while turns < 100_000:
            turns += 1
            await trio.lowlevel.checkpoint()

    async def raise_flag() -> None:
        nonlocal flag
        for _ in range(10):
            await trio.lowlevel.checkpoint()
        flag = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spinner)
        nursery.start_soon(raise_flag)
        await wait_idle(lambda: flag)
        assert flag and turns < 100_000, "returned while the spinner still ran, because enough() said so"
        nursery.cancel_scope.cancel()
