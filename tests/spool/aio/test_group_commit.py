"""When the group commit cuts a batch: after everything that could join has, never later than the bound.

The durability rules are the same as without a window (a 250 only after the
fsync covering the message, outcomes durable before the FINISH); these tests
check the fsync counts that the window, the delivery batches and the
checkpoint pacing are for, and that an idle loop commits at once.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from session_support import SERVER_TOML, greeted, inline_spool, lone_enqueues, smtp, to_data
from spool_support import running_spool, spool_config

from mta.config import parse_config
from mta.inbound.server import SmtpServer
from mta.observe.metrics import Metrics
from spool.aio.async_spool import AsyncSpool
from spool.aio.inline_commit import INLINE_SYNC_SAMPLES
from spool.fileio import OsFileIO
from spool.format.record import Outcome, Status


def cpu(seconds: float) -> None:
    """Work that holds the event loop, as receiving and parsing a message does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def busy_then_enqueue(aspool: AsyncSpool, steps: int, i: int) -> None:
    """A session that needs ``steps`` slices of a millisecond of CPU before its end of data."""
    for _ in range(steps):
        cpu(0.001)
        await trio.lowlevel.checkpoint()
    await aspool.enqueue("s@src.example", ["r@dest.example"], b"message %d" % i)


async def test_enqueues_still_being_worked_on_join_the_commit(tmp_path: Path,
                                                              mock_clock: trio.testing.MockClock) -> None:
    """Twenty sessions ending their data a millisecond of CPU apart: one fsync, not one each."""
    async with running_spool(tmp_path, spool_config(commit_delay=1.0)) as aspool:
        w = aspool.core.writer
        commits, fsyncs = w.commits, w.fsyncs
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(busy_then_enqueue, aspool, i, i)
        assert w.commits - commits == 1
        assert w.fsyncs - fsyncs == 1


async def test_without_a_window_the_same_load_takes_many_fsyncs(tmp_path: Path,
                                                                mock_clock: trio.testing.MockClock) -> None:
    """The control for the test above: commit_delay 0 cuts at once, so the count there is the window's doing."""
    async with running_spool(tmp_path, spool_config(commit_delay=0.0)) as aspool:
        w = aspool.core.writer
        commits = w.commits
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(busy_then_enqueue, aspool, i, i)
        assert w.commits - commits > 1


async def test_an_idle_loop_commits_at_once(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """One session: the window costs no time (autojump would have skipped the clock to the bound)."""
    async with running_spool(tmp_path, spool_config(commit_delay=1.0)) as aspool:
        for i in range(3):
            t0 = trio.current_time()
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"alone %d" % i)
            assert trio.current_time() == t0


async def test_a_loop_that_never_idles_still_commits_within_the_bound(tmp_path: Path) -> None:
    """A task that never blocks keeps the loop busy; the bound (real time here) cuts the commit anyway."""
    async with running_spool(tmp_path, spool_config(commit_delay=0.05)) as aspool:
        stop = False

        async def spinner() -> None:
            while not stop:
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(spinner)
            with trio.fail_after(30):
                await aspool.enqueue("s@src.example", ["r@dest.example"], b"while busy")
            stop = True
        assert aspool.core.writer.durable_end >= aspool.core.writer.written_end


async def spin_until(done: Callable[[], bool], limit: int) -> int:
    """A task that never blocks (CPU work between checkpoints), at most ``limit`` turns; returns the turns taken."""
    turns = 0
    while not done() and turns < limit:
        turns += 1
        await trio.lowlevel.checkpoint()
    return turns


async def test_a_lone_announced_session_is_committed_without_waiting_for_an_idle_loop(
        tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    """Where sessions announce their commits, a message with none announced beside it is cut at once.

    A spinning task keeps the loop from going idle: a commit once waited for an idle loop
    (or the bound, which the mock clock never reaches), so a lone client's fsync came after every other
    task's CPU work: here, after the spinner's million turns.
    """
    async with running_spool(tmp_path, spool_config(commit_delay=1.0)) as aspool:
        aspool.withdraw_commit(aspool.expect_commit())  # a session announced, then its data arrived: a relay
        done = False
        turns = 0

        async def spinner() -> None:
            nonlocal turns
            turns = await spin_until(lambda: done, 1_000_000)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(spinner)
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"lone")
            done = True
        assert turns < 1_000_000, "the commit waited for the spinner to stop"
        assert aspool.core.writer.durable_end == aspool.core.writer.written_end


async def test_without_announcements_a_commit_still_waits_for_an_idle_loop(
        tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    """The control: a caller that never announces (the engine's own API) keeps the idle-loop window."""
    async with running_spool(tmp_path, spool_config(commit_delay=1.0)) as aspool:
        turns = 0

        async def spinner() -> None:
            nonlocal turns
            turns = await spin_until(lambda: False, 2_000)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(spinner)
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"unannounced")
            finished_at = turns
        assert finished_at == 2_000, "the commit was cut while another task could still run"


async def test_the_sender_hears_before_the_runners_are_woken(tmp_path: Path) -> None:
    """After the fsync, the enqueue returns (the 250) before the runners' wake-up is signalled.

    trio runs the tasks woken in one step in either order; the runners' pass (read, claim, start the
    delivery) must not stand between a lone client and its reply. Twenty rounds: the wrong order would
    show in about half of them.
    """
    async with running_spool(tmp_path, spool_config()) as aspool:
        aspool.withdraw_commit(aspool.expect_commit())
        for i in range(20):
            order: list[str] = []

            async def runner(changed: trio.Event, order: list[str] = order) -> None:
                await changed.wait()
                order.append("runners woken")

            async def sender(body: bytes = b"m%d" % i, order: list[str] = order) -> None:
                await aspool.enqueue("s@src.example", ["r@dest.example"], body)
                order.append("enqueue returned")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(runner, aspool._changed)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(sender)
            assert order == ["enqueue returned", "runners woken"], f"round {i}"


async def test_outcomes_of_one_connection_share_one_fsync(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    async with running_spool(tmp_path, spool_config()) as aspool:
        await aspool.enqueue_many([("s@src.example", ["r@dest.example"], b"m%d" % i) for i in range(10)])
        attempts = await aspool.next_due()
        assert len(attempts) == 10
        w = aspool.core.writer
        commits, fsyncs = w.commits, w.fsyncs
        await aspool.record_deliveries([(a, [Outcome("r@dest.example", Status.DELIVERED, 250)], 5)
                                        for a in attempts])
        assert w.commits - commits == 1 and w.fsyncs - fsyncs == 1
        assert w.durable_end == w.written_end == w.head, "every DELIVERY is durable before any FINISH"


# -- checkpoint pacing -------------------------------------------------------------


def sequence(aspool: AsyncSpool) -> int:
    state = aspool.core.checkpoint_state
    return 0 if state is None else state.sequence


async def checkpointed(aspool: AsyncSpool, before: int) -> None:
    """Wait (bounded, real time: the checkpoint's fsyncs run in a thread) for a checkpoint after ``before``."""
    deadline = time.monotonic() + 30
    while sequence(aspool) <= before:
        assert time.monotonic() < deadline, "checkpoint not written"
        await trio.lowlevel.checkpoint()


async def settle(aspool: AsyncSpool) -> None:
    """Let every task (the checkpointer above all) run until it blocks: on the mock clock or a thread."""
    await trio.testing.wait_all_tasks_blocked()


async def tick(aspool: AsyncSpool, clock: trio.testing.MockClock) -> None:
    """One interval passes: the checkpointer has begun its sleep before the jump and looked after it."""
    await settle(aspool)
    clock.jump(1.0)
    await settle(aspool)


async def test_checkpoints_wait_for_a_quiet_interval_or_enough_bytes(tmp_path: Path,
                                                                     mock_clock: trio.testing.MockClock) -> None:
    cfg = spool_config(checkpoint_interval=1.0, checkpoint_bytes=64 * 1024, checkpoint_max_interval=100.0)
    async with running_spool(tmp_path, cfg) as aspool:
        await settle(aspool)
        seq = sequence(aspool)
        for i in range(5):  # mail every interval, far below checkpoint_bytes: no checkpoint
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"small %d" % i)
            await tick(aspool, mock_clock)
        assert aspool.checkpoint_passes == 0
        await tick(aspool, mock_clock)  # a quiet interval
        await checkpointed(aspool, seq)
        seq = sequence(aspool)
        for i in range(3):  # a burst: more than checkpoint_bytes within one interval
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"x" * 30_000 + b"%d" % i)
        await tick(aspool, mock_clock)
        await checkpointed(aspool, seq)
        assert aspool.checkpoint_passes == 2


async def test_a_trickle_is_checkpointed_after_the_max_interval(tmp_path: Path,
                                                               mock_clock: trio.testing.MockClock) -> None:
    cfg = spool_config(checkpoint_interval=1.0, checkpoint_bytes=1 << 30, checkpoint_max_interval=5.0)
    async with running_spool(tmp_path, cfg) as aspool:
        await settle(aspool)
        seq = sequence(aspool)
        for i in range(4):
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"trickle %d" % i)
            await tick(aspool, mock_clock)
        assert aspool.checkpoint_passes == 0
        for i in range(3):
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"more %d" % i)
            await tick(aspool, mock_clock)
        await checkpointed(aspool, seq)


async def test_checkpoint_bytes_zero_checkpoints_every_interval_as_before(tmp_path: Path,
                                                                          mock_clock: trio.testing.MockClock) -> None:
    cfg = spool_config(checkpoint_interval=1.0, checkpoint_bytes=0)
    async with running_spool(tmp_path, cfg) as aspool:
        await settle(aspool)
        for i in range(3):
            seq = sequence(aspool)
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"busy %d" % i)
            await tick(aspool, mock_clock)
            await checkpointed(aspool, seq)


async def test_nothing_moved_no_checkpoint_no_fsync(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    async with running_spool(tmp_path, spool_config(checkpoint_interval=1.0)) as aspool:
        await settle(aspool)
        seq = sequence(aspool)
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"one")
        for _ in range(2):  # the interval with the enqueue, then a quiet one
            await tick(aspool, mock_clock)
        await checkpointed(aspool, seq)
        await settle(aspool)
        fsyncs, passes = aspool.core.writer.fsyncs, aspool.checkpoint_passes
        for _ in range(10):
            await tick(aspool, mock_clock)
        assert aspool.checkpoint_passes == passes
        assert aspool.core.writer.fsyncs == fsyncs


# -- sessions in a mail transaction are waited for ------------------------------------------


@pytest.mark.parametrize("order", ["a first", "b first"])
async def test_a_session_between_rcpt_and_end_of_data_joins_the_commit(
        tmp_path: Path, mock_clock: trio.testing.MockClock, order: str) -> None:
    """Session A has a recipient, B ends its data: B's commit waits for A's message (no time passes: the
    mock clock is frozen, so only A's arrival can cut it), and one fsync covers both."""
    cfg = parse_config(SERVER_TOML.format(dir=tmp_path / "spool"), base_dir=str(tmp_path))
    async with running_spool(tmp_path / "spool", spool_config(commit_delay=1.0)) as aspool:
        server = SmtpServer(cfg, aspool, Metrics())
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            port = listeners[0].socket.getsockname()[1]
            a, b = await greeted(port), await greeted(port)
            for s in (a, b):
                await to_data(s)
            w = aspool.core.writer
            commits = w.commits
            first, second = (a, b) if order == "a first" else (b, a)
            await first.send_all(b"Subject: one\r\n\r\nfirst\r\n.\r\n")
            await trio.testing.wait_all_tasks_blocked()
            assert w.commits == commits, "the commit waits for the other session's message"
            await second.send_all(b"Subject: two\r\n\r\nsecond\r\n.\r\n")
            await smtp(first, b"", b"250")
            await smtp(second, b"", b"250")
            assert w.commits - commits == 1
            for s in (a, b):
                await smtp(s, b"QUIT\r\n", b"221")
            nursery.cancel_scope.cancel()


# -- a lone committer writes in the event loop's thread ------------------------------------------


class TimedSync(OsFileIO):
    """Real files; each fdatasync says which thread ran it, and may take ``extra`` seconds more or skip the disk.

    The disk's speed is what the inline rule reads; a test sets it here (``fast``: no real fdatasync,
    so the machine's own disk, shared with other jobs, cannot decide the path; ``extra``: a slow disk).
    """

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.extra = 0.0
        self.fast = False
        self.before_sync: Callable[[], None] | None = None
        self._wrote: dict[int, bool] = {}  # per descriptor since its last sync: were all its writes zeros?

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        zeros = not bytes(data).strip(b"\0")
        self._wrote[fd] = self._wrote.get(fd, True) and zeros
        return super().write(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        if self._wrote.pop(fd, False):
            # The zeroed room's own sync (spool.write.room), made between commits: not a commit's, not counted.
            if not self.fast:
                super().fdatasync(fd)
            return
        self.threads.append(threading.get_ident())
        if self.before_sync is not None:
            self.before_sync()
        if not self.fast:
            super().fdatasync(fd)
        if self.extra:
            time.sleep(self.extra)  # the disk's latency, not a synchronisation

    def in_loop(self, since: int = 0) -> list[bool]:
        """For each fdatasync from ``since`` on: did it run in this (the event loop's) thread?"""
        me = threading.get_ident()
        return [t == me for t in self.threads[since:]]


async def test_a_lone_commit_on_a_fast_disk_syncs_in_the_loop_and_a_slow_disk_sends_it_back_to_the_thread(
        tmp_path: Path) -> None:
    """Inline once the last INLINE_SYNC_SAMPLES syncs were fast; the thread again as soon as their median is
    slow (a slow disk never holds the loop for long); inline again when the disk is fast again."""
    io = TimedSync()
    io.fast = True
    async with inline_spool(tmp_path, io) as aspool:
        w = aspool.core.writer
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES, "warm-up")  # no history yet: the thread
        assert aspool.inline_commits == 0
        since = len(io.threads)
        await lone_enqueues(aspool, 5, "fast")
        assert io.in_loop(since) == [True] * 5
        assert aspool.inline_commits == 5 and w.durable_end == w.head

        io.fast, io.extra = False, 0.005  # the disk slows down: 5 ms a sync
        since = len(io.threads)
        await lone_enqueues(aspool, 8, "slow")
        path = io.in_loop(since)
        assert path[:3] == [True] * 3, "the median of five still fast syncs says inline"
        assert path[3:] == [False] * 5, "three slow syncs of five: back to the thread"
        assert w.durable_end == w.head

        io.fast, io.extra = True, 0.0  # fast again: the thread's syncs are timed too, so inline comes back
        since = len(io.threads)
        await lone_enqueues(aspool, 6, "fast again")
        assert io.in_loop(since) == [False] * 3 + [True] * 3


async def test_by_default_every_commit_keeps_the_thread(tmp_path: Path) -> None:
    """Off by default (measured slower for a lone client: docs/benchmarks.md), even on the fastest disk."""
    io = TimedSync()
    io.fast = True
    aspool = await AsyncSpool.open(str(tmp_path), spool_config(), io)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(aspool.run)
            await lone_enqueues(aspool, 12, "default")
            nursery.cancel_scope.cancel()
    finally:
        aspool.core.close()
    assert aspool.inline_commits == 0 and len(io.threads) >= 12 and not any(io.in_loop())


async def test_a_slow_disk_keeps_every_commit_in_the_thread(tmp_path: Path) -> None:
    io = TimedSync()
    io.extra = 0.002  # over INLINE_SYNC_FAST, whatever the machine's own disk does
    async with inline_spool(tmp_path, io) as aspool:
        await lone_enqueues(aspool, 12, "slow")
        assert aspool.inline_commits == 0
        assert not any(io.in_loop())


async def test_the_deliveries_commits_keep_the_thread(tmp_path: Path) -> None:
    """Claims and outcomes wait alone too, but no client waits on them: inline they held the loop while a
    lone client's next command waited (docs/benchmarks.md)."""
    io = TimedSync()
    io.fast = True
    async with inline_spool(tmp_path, io) as aspool:
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES + 1, "warm-up")
        inline, since = aspool.inline_commits, len(io.threads)
        attempts = await aspool.next_due()  # the claims (written through, synced with the outcomes)
        await aspool.record_deliveries([(a, [Outcome("r@dest.example", Status.DELIVERED, 250)], 5)
                                        for a in attempts])
        assert attempts and len(io.threads) - since >= 1
        assert aspool.inline_commits == inline and not any(io.in_loop(since))


async def test_concurrent_commits_keep_the_thread_and_their_batching(tmp_path: Path) -> None:
    """Twenty enqueues at once on a fast disk: one batch in the thread, as before (fsyncs do not rise)."""
    io = TimedSync()
    io.fast = True
    async with inline_spool(tmp_path, io, commit_delay=1.0) as aspool:
        w = aspool.core.writer
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES + 1, "warm-up")
        inline, fsyncs, since = aspool.inline_commits, w.fsyncs, len(io.threads)
        assert inline == 1, "the lone one after the warm-up went inline"
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(lone_enqueues, aspool, 1, f"together {i}")
        assert w.fsyncs - fsyncs == 1
        assert aspool.inline_commits == inline and io.in_loop(since) == [False]


async def test_a_commit_waiting_for_an_announced_session_keeps_the_thread(tmp_path: Path) -> None:
    """A session between its RCPT and its end of data: the lone waiter's commit waits for its message, and
    the two go in one batch, in the thread (two waiters), as before."""
    io = TimedSync()
    io.fast = True
    async with inline_spool(tmp_path, io, commit_delay=1.0) as aspool:
        w = aspool.core.writer
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES + 1, "warm-up")
        inline, fsyncs, since = aspool.inline_commits, w.fsyncs, len(io.threads)
        token = aspool.expect_commit()

        async def announced() -> None:
            aspool.withdraw_commit(token)  # its data has arrived: withdrawn and appended in one step
            await aspool.enqueue("s@src.example", ["r@dest.example"], b"the announced one")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lone_enqueues, aspool, 1, "beside an announced session")
            await trio.testing.wait_all_tasks_blocked()
            assert w.durable_end < w.head, "the commit waits for the announced message"
            nursery.start_soon(announced)
        assert w.fsyncs - fsyncs == 1
        assert aspool.inline_commits == inline and io.in_loop(since) == [False]


async def test_with_a_second_client_connected_the_commit_stays_in_the_thread(tmp_path: Path) -> None:
    """A real session on a fast disk while another client is connected and has not yet said RCPT (so no
    commit of its is announced): the message's fdatasync runs in the worker thread, not in the loop,
    which the other client may need at any moment; once it has gone, the next message's runs inline."""
    io = TimedSync()
    io.fast = True
    cfg = parse_config(SERVER_TOML.format(dir=tmp_path / "spool"), base_dir=str(tmp_path))
    async with inline_spool(tmp_path / "spool", io) as aspool:
        server = SmtpServer(cfg, aspool, Metrics())
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES, "warm-up")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            port = listeners[0].socket.getsockname()[1]
            other = await greeted(port, "other.test")
            client = await greeted(port)
            await to_data(client)
            inline, since = aspool.inline_commits, len(io.threads)
            await smtp(client, b"Subject: one of two\r\n\r\nbody\r\n.\r\n", b"250 2.0.0 Ok: queued as")
            assert aspool.inline_commits == inline and io.in_loop(since) == [False]
            await smtp(other, b"QUIT\r\n", b"221")
            await other.aclose()
            await trio.testing.wait_all_tasks_blocked()  # the other session's task has ended, its slot given back
            assert server.slots.total == 1
            await to_data(client)
            since = len(io.threads)
            await smtp(client, b"Subject: alone now\r\n\r\nbody\r\n.\r\n", b"250 2.0.0 Ok: queued as")
            assert aspool.inline_commits == inline + 1 and io.in_loop(since) == [True]
            await smtp(client, b"QUIT\r\n", b"221")
            nursery.cancel_scope.cancel()


async def test_a_checkpoint_holding_the_files_sends_a_lone_commit_to_the_thread(tmp_path: Path) -> None:
    """The loop never waits behind another thread's I/O: the log's lock is tried, not waited for."""
    io = TimedSync()
    io.fast = True
    async with inline_spool(tmp_path, io) as aspool:
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES, "warm-up")
        w = aspool.core.writer
        # No zeroed room from here on (spool.write.room): the committer would otherwise be making room in its
        # thread, behind the lock taken below, and try the lone commit only once the lock is free again.
        # The commit of one more message lets any room being made finish first.
        w.room.enabled = False
        await lone_enqueues(aspool, 1, "after the room")
        since, inline = len(io.threads), aspool.inline_commits
        async with trio.open_nursery() as nursery:
            w.io_lock.acquire()  # as a checkpoint's sync_all in a worker thread holds it
            try:
                nursery.start_soon(lone_enqueues, aspool, 1, "while the files are busy")
                await trio.testing.wait_all_tasks_blocked()
                assert w.durable_end < w.head, "not written: the commit waits for the lock in its thread"
            finally:
                w.io_lock.release()
        assert io.in_loop(since) == [False] and aspool.inline_commits == inline
        assert w.durable_end == w.head


async def test_an_inline_commit_sends_the_250_only_after_its_fdatasync(tmp_path: Path) -> None:
    """A real session on a fast disk: each fdatasync runs in the loop's thread and, while it runs, the
    client has no 250 in its socket; the 250 comes after it, for a message the spool holds durably."""
    io = TimedSync()
    io.fast = True
    cfg = parse_config(SERVER_TOML.format(dir=tmp_path / "spool"), base_dir=str(tmp_path))
    async with inline_spool(tmp_path / "spool", io) as aspool:
        server = SmtpServer(cfg, aspool, Metrics())
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES, "warm-up")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            port = listeners[0].socket.getsockname()[1]
            client = await greeted(port)
            await to_data(client)
            seen: list[bytes | None] = []
            raw = socket.fromfd(client.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a blocking twin

            def peek() -> None:  # in the fdatasync: what has the client been sent so far?
                try:
                    seen.append(raw.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT))
                except BlockingIOError:
                    seen.append(None)

            io.before_sync = peek
            inline, since = aspool.inline_commits, len(io.threads)
            await smtp(client, b"Subject: lone\r\n\r\nbody\r\n.\r\n", b"250 2.0.0 Ok: queued as")
            io.before_sync = None
            raw.close()
            assert aspool.inline_commits > inline and io.in_loop(since)[0], "the message's sync ran inline"
            assert seen[0] is None, f"the client had {seen[0]!r} before the fdatasync"
            w = aspool.core.writer
            assert w.durable_end == w.written_end
            await smtp(client, b"QUIT\r\n", b"221")
            nursery.cancel_scope.cancel()
