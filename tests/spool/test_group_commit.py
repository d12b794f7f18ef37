"""When the group commit cuts a batch: after everything that could join has, never later than the bound.

The durability rules are the same as without a window (a 250 only after the
fsync covering the message, outcomes durable before the FINISH); these tests
check the fsync counts that the window, the delivery batches and the
checkpoint pacing are for, and that an idle loop commits at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from spool_support import running_spool, spool_config

from mta.config import parse_config
from mta.inbound.server import SmtpServer
from mta.observe.metrics import Metrics
from spool.commit import AsyncSpool
from spool.record import Outcome, Status


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

    A spinning task keeps the loop from going idle: before issue 18 the commit waited for an idle loop
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


SERVER_TOML = """
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
[spool]
dir = "{dir}"
[routes]
"dest.test" = "discard"
"""


async def smtp(stream: trio.SocketStream, line: bytes, expect: bytes) -> None:
    await stream.send_all(line)
    got = b""
    with trio.fail_after(30):
        while not got.endswith(b"\r\n") or got.split(b"\r\n")[-2][3:4] == b"-":
            data = await stream.receive_some(4096)
            assert data, f"connection closed waiting for {expect!r}"
            got += data
    assert got.startswith(expect), got


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
            a = await trio.open_tcp_stream("127.0.0.1", port)
            b = await trio.open_tcp_stream("127.0.0.1", port)
            for s in (a, b):
                await smtp(s, b"", b"220")
                await smtp(s, b"EHLO client.test\r\n", b"250")
                await smtp(s, b"MAIL FROM:<s@src.test>\r\n", b"250")
                await smtp(s, b"RCPT TO:<r@dest.test>\r\n", b"250")
                await smtp(s, b"DATA\r\n", b"354")
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
