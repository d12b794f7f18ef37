"""Waiting for an idle event loop: the group commit's window (``spool.aio.group_commit._gather``).

Why our own: trio offers this only as ``trio.testing.wait_all_tasks_blocked``,
and importing ``trio.testing`` imports pytest (its ``RaisesGroup``): tens of
milliseconds and a test framework's machinery in every relay process.

What "idle" means here is what trio's means with no cushion: a pass of the
event loop whose poll for I/O (non-blocking, since the waiters themselves are
runnable) woke nobody and found nothing runnable but the waiters. An
instrument looks at the run queue after each poll, once a pass (not once a
task step), and only while somebody waits: the loop pays nothing for it
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


class _IdleWatch(trio.abc.Instrument):
    """Counts the passes in a row whose poll left only the waiters runnable."""

    def __init__(self) -> None:
        self.quiet = 0
        self.waiters: set[trio.lowlevel.Task] = set()

    def after_io_wait(self, timeout: float) -> None:
        if trio.lowlevel.current_statistics().tasks_runnable <= len(self.waiters):
            self.quiet += 1
        else:
            self.quiet = 0


_WATCH: trio.lowlevel.RunVar[_IdleWatch | None] = trio.lowlevel.RunVar("spool_idle_watch", default=None)


async def wait_idle(enough: Callable[[], bool] | None = None) -> None:
    """Return once two passes of the event loop in a row had nothing to run but the waiters (a checkpoint),
    or ``enough()`` says the wait is over (asked once a pass).

    Every waiter steps once a pass, so each is in the run queue when the
    instrument looks. Two passes: a task woken by an expired deadline joins
    the batch after the look; the next look sees it if it is still
    runnable. A loop that never idles keeps this waiting: bound it
    (``trio.move_on_after``).
    """
    watch = _WATCH.get()
    if watch is None:
        watch = _IdleWatch()
        _WATCH.set(watch)
        trio.lowlevel.add_instrument(watch)
    me = trio.lowlevel.current_task()
    watch.waiters.add(me)
    watch.quiet = 0
    try:
        while True:
            await trio.lowlevel.checkpoint()
            if watch.quiet >= 2 or (enough is not None and enough()):
                return
    finally:
        watch.waiters.discard(me)
        if not watch.waiters:
            _WATCH.set(None)
            trio.lowlevel.remove_instrument(watch)
