"""A lone client's commit without hand-offs: its enqueue writes and syncs its own batch, write-only batches
stay in the loop's thread, and a lone client's reads skip the yield a bounded number of times.

Real sessions on 127.0.0.1 against the real server and spool (``LoopIO``'s files are real; its
fdatasync is left out so that the machine's shared disk cannot decide which path a commit takes).
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import trio
import trio.testing
from session_support import SERVER_TOML, greeted, inline_spool, lone_enqueues, smtp, to_data

from mta.config import parse_config
from mta.inbound import wire
from mta.inbound.server import SmtpServer
from mta.observe.metrics import Metrics
from spool.aio.inline_commit import INLINE_SYNC_SAMPLES
from spool.fileio import OsFileIO
from spool.read import listing as admin


class LoopIO(OsFileIO):
    """Real files; says which thread made each write and each commit's fdatasync; ``full``: ENOSPC.

    Its fdatasyncs skip the disk (``fast``), so that the machine's shared disk cannot decide which path a
    commit takes. The zeroed room's own syncs (spool.write.room: only zeros written since) are not a commit's.
    """

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.write_threads: list[int] = []
        self.full = False
        self.before_sync: Callable[[], None] | None = None
        self._wrote: dict[int, bool] = {}

    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        zeros = not bytes(data).strip(b"\0")
        self._wrote[fd] = self._wrote.get(fd, True) and zeros
        if not zeros:
            self.write_threads.append(threading.get_ident())
        return super().write(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        if self._wrote.pop(fd, False):
            return
        self.threads.append(threading.get_ident())
        if self.before_sync is not None:
            self.before_sync()

    def in_loop(self, since: int = 0) -> list[bool]:
        me = threading.get_ident()
        return [t == me for t in self.threads[since:]]


async def test_a_lone_sessions_commit_is_made_by_its_enqueue_and_the_250_follows_its_fdatasync(
        tmp_path: Path) -> None:
    """No committer in between: the session's own step writes and fdatasyncs the message (in the loop's
    thread), and the client has nothing before that fdatasync; the 250 comes after it, durable."""
    io = LoopIO()
    cfg = parse_config(SERVER_TOML.format(dir=tmp_path / "spool"), base_dir=str(tmp_path))
    async with inline_spool(tmp_path / "spool", io) as aspool:
        server = SmtpServer(cfg, aspool, Metrics())
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES, "warm-up")
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            port = listeners[0].socket.getsockname()[1]
            client = await greeted(port)
            raw = socket.fromfd(client.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            seen: list[bytes | None] = []

            def peek() -> None:  # in the fdatasync: what has the client been sent so far?
                try:
                    seen.append(raw.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT))
                except BlockingIOError:
                    seen.append(None)

            for i in range(3):
                await to_data(client)
                direct, since = aspool.direct_commits, len(io.threads)
                io.before_sync = peek
                await smtp(client, b"Subject: lone %d\r\n\r\nbody\r\n.\r\n" % i, b"250 2.0.0 Ok: queued as")
                io.before_sync = None
                assert aspool.direct_commits == direct + 1, "the enqueue made its own commit"
                assert io.in_loop(since) == [True]
                assert seen.pop() is None, "the client had a reply before the fdatasync"
                w = aspool.core.writer
                assert w.durable_end == w.written_end == w.head
            raw.close()
            await smtp(client, b"QUIT\r\n", b"221")
            nursery.cancel_scope.cancel()
    assert len(list(admin.iter_live(aspool.core))) == INLINE_SYNC_SAMPLES + 3


async def test_a_lone_sessions_own_commit_on_a_full_disk_gets_452_and_its_message_is_never_kept(
        tmp_path: Path) -> None:
    """The enqueue's write finds no room: the batch goes back to the committer (which retries), the client
    gets 452, and once the disk has room again the message is not among the live ones."""
    io = LoopIO()
    cfg = parse_config(SERVER_TOML.format(dir=tmp_path / "spool"), base_dir=str(tmp_path))
    async with inline_spool(tmp_path / "spool", io) as aspool:
        server = SmtpServer(cfg, aspool, Metrics())
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES, "warm-up")
        aspool.core.writer.room.enabled = False  # no zeroed room: every commit writes (and so meets ENOSPC)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            port = listeners[0].socket.getsockname()[1]
            client = await greeted(port)
            await to_data(client)
            io.full = True
            await smtp(client, b"Subject: no room\r\n\r\nbody\r\n.\r\n", b"452 4.3.1")
            assert aspool.disk_full
            io.full = False
            with trio.fail_after(30):
                await aspool.wait_for_space()
            await smtp(client, b"QUIT\r\n", b"221")
            nursery.cancel_scope.cancel()
    live = list(admin.iter_live(aspool.core))
    assert len(live) == INLINE_SYNC_SAMPLES, "only the warm-up's messages: the refused one was cancelled"


async def test_a_lone_relays_write_only_batches_stay_in_the_loops_thread(tmp_path: Path) -> None:
    """A claim (written through, not synced) is written in the event loop's thread when the inline path is
    on; its fdatasync comes with the next commit."""
    io = LoopIO()
    async with inline_spool(tmp_path, io) as aspool:
        await lone_enqueues(aspool, INLINE_SYNC_SAMPLES + 1, "warm-up")
        writes, since = aspool.inline_writes, len(io.write_threads)
        attempts = await aspool.next_due()
        assert attempts
        assert aspool.inline_writes > writes
        me = threading.get_ident()
        assert io.write_threads[since:] and all(t == me for t in io.write_threads[since:])


class Passes(trio.abc.Instrument):
    """Notes, at every pass of the scheduler, how many reads the session had done by then."""

    def __init__(self, done: list[int]) -> None:
        self.done = done
        self.marks: list[int] = []

    def before_io_wait(self, timeout: float) -> None:
        self.marks.append(self.done[0])


async def reads_per_pass(lone: bool, reads: int = 40) -> list[int]:
    """Read a socket whose bytes are always waiting, one byte a read: how many reads each pass of the
    scheduler saw (every other runnable task runs once a pass)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(a))
    pace = wire.Pace()
    pace.lone = lone
    b.sendall(b"x" * reads)
    done = [0]
    passes = Passes(done)
    trio.lowlevel.add_instrument(passes)
    try:
        for _ in range(reads):
            assert await wire.receive(stream, 1, pace) == b"x"
            done[0] += 1
    finally:
        trio.lowlevel.remove_instrument(passes)
        stream.socket.close()
        b.close()
    marks = [*passes.marks, done[0]]
    return [later - earlier for earlier, later in itertools.pairwise(marks)]


async def test_a_lone_clients_reads_yield_at_least_every_lone_burst_reads() -> None:
    """A lone client whose bytes are always waiting (a fire hose) still lets the other tasks run: at most
    LONE_BURST reads in a row go without a yield. Not lone: every read that found its bytes yields."""
    lone = await reads_per_pass(True)
    assert lone and max(lone) == wire.LONE_BURST + 1, lone
    shared = await reads_per_pass(False)
    assert shared and max(shared) == 1, shared
