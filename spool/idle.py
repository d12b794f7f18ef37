"""Waiting for an idle event loop: the group commit's window (``spool.group_commit._gather``).

Why our own: trio offers this only as ``trio.testing.wait_all_tasks_blocked``,
and importing ``trio.testing`` imports pytest (its ``RaisesGroup``): tens of
milliseconds and a test framework's machinery in every relay process.

What "idle" means here is what trio's means with no cushion: one whole pass
of the event loop ran no task but the waiter, so nothing was runnable and
the poll for I/O (non-blocking, since the waiter itself was runnable) woke
nobody. Counting passes needs to see every task step: an instrument that
counts them is installed only while somebody waits, so the loop pays nothing
for it otherwise.
"""

from __future__ import annotations

import trio


class _StepCounter(trio.abc.Instrument):
    """Counts the task steps the event loop runs, but for those of the tasks waiting for idle."""

    def __init__(self) -> None:
        self.steps = 0
        self.waiters: set[trio.lowlevel.Task] = set()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task not in self.waiters:
            self.steps += 1


_COUNTER: trio.lowlevel.RunVar[_StepCounter | None] = trio.lowlevel.RunVar("spool_idle_counter", default=None)


async def wait_idle() -> None:
    """Return once a whole pass of the event loop ran no task but those waiting here (a checkpoint).

    A waiter steps once per pass. Between two of its steps run the tasks
    after it in one pass and those before it in the next; two such
    intervals in a row with no other step mean a pass held only waiters.
    Several waiters share one counter and do not count each other. A loop
    that never idles keeps this waiting: bound it (``trio.move_on_after``).
    """
    counter = _COUNTER.get()
    if counter is None:
        counter = _StepCounter()
        _COUNTER.set(counter)
        trio.lowlevel.add_instrument(counter)
    me = trio.lowlevel.current_task()
    counter.waiters.add(me)
    try:
        quiet = 0
        while quiet < 2:
            seen = counter.steps
            await trio.lowlevel.checkpoint()
            quiet = quiet + 1 if counter.steps == seen else 0
    finally:
        counter.waiters.discard(me)
        if not counter.waiters:
            _COUNTER.set(None)
            trio.lowlevel.remove_instrument(counter)
