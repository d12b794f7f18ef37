"""Delivery worker processes: the SMTP client on another core, the spool and its group commit kept here.

Theory of operation. One relay process is one trio loop on one core, and
about half of its CPU per message is the delivery client (the SMTP
conversation, TLS, the body's sends). ``DeliveryWorkers`` is a ``Transport``
that hands each batch (a destination and its jobs) to one of
``[delivery] processes`` worker processes (``mta.delivery.worker_main``),
each running the ordinary ``SmtpTransport`` in its own loop, and gives the
scheduler back their outcomes as they come, as Postfix's qmgr hands
deliveries to smtp(8) processes. The spool, the claims, the group commit and
every record stay in the relay: a worker writes nothing but its log lines
(sent back here), the TLS-RPT journal (lines appended with O_APPEND,
safe between processes; the daily roll-up runs here, once) and its own
marks of the points of no return (``mta.delivery.worker_marks``), for
attempts whose START the relay has said is durable (``durable`` frames).

Bodies. A stored body (``StoredBody``: every body the scheduler hands over)
goes to the worker as the positions of its DATA records, with the spool's
log directory; the worker reads the records from the segment files itself,
each checked against its checksum, one at a time as it sends
(``mta.delivery.worker_body``). So the relay's loop neither reads nor copies
a body for a worker, and neither process holds one whole. A record the worker
cannot read is asked of the relay (``read``/``chunk`` frames): the relay reads
it through the spool, so a damaged body is found, named and quarantined here
exactly as without workers and the scheduler sees it on
``StoredBody.damaged``. Any other body (not from the spool) goes inline in
the batch frame up to ``INLINE_BODY`` bytes and is pulled chunk by chunk
beyond.

Starting. Under ``mta serve`` each worker's first life was forked before the
relay's loop started (``mta.delivery.worker_fork``: it shares the relay's
pages) and is adopted here; a worker started again after a death, and every
worker of a relay run inside another program's loop, is a new interpreter
(``python -P -m mta.delivery.worker_main``).

Picking a worker: the one with the fewest batches in flight. A worker holds
many batches at once (its own trio tasks), so ``processes`` is about cores,
not about concurrency (that stays ``[delivery] concurrency``).

Crash-only. A worker may die at any moment (kill -9, a bug): its socket
reaches EOF, and every batch it had in flight ends with ``WorkerLost``,
which the scheduler defers as a local error (no destination backoff), like
any deferral retried at its next interval. Outcomes already sent back stand
(they were recorded as they came); a job past its point of no return (its
``dot`` answered, or marked in the worker's own file, read here once the
worker is gone) with no outcome is in doubt and held with ``in_doubt =
"hold"``, exactly as after a relay crash mid-delivery; a job before it is
simply due again. The worker is started
again after a back-off (0.5 s, doubling to 30 s while it dies within 10 s of
its start), with one log line per death and per start; the relay itself never
stops because of a worker. A worker whose relay died sees EOF and exits.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import logging
import math
import os
import pickle
import socket
import subprocess
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import trio

import mta
from mta.config import Config
from mta.containment import is_fatal
from mta.delivery import mx
from mta.delivery.tlspolicy.plan import Planner
from mta.delivery.transport import BeforeDot, Destination, Job, OnOutcome, TransportLost, body_chunks
from mta.delivery.worker_fork import Forked
from mta.delivery.worker_protocol import (
    FrameReader,
    ProtocolError,
    SocketReceiver,
    decode_outcomes,
    destination_item,
    encode,
    job_header,
    marks_prefix,
)
from mta.observe.logline import LogEvent, event
from spool import Outcome, StoredBody, marks_dir, marks_of

log = logging.getLogger("mta.workers")

# Bodies up to this size go inline in the batch frame; bigger ones not in the spool's cache are pulled.
INLINE_BODY = 256 * 1024
RESTART_MIN = 0.5
RESTART_MAX = 30.0
# A worker that lived this long before dying is restarted after RESTART_MIN again.
STABLE_AFTER = 10.0
# A ``durable`` frame goes to a worker once this many of its jobs' STARTs became durable since it last heard (the
# batch frames and ``dot_ok`` answers carry the durable end too). One job alone (a lone client's message) asks the
# relay at its dot instead: the frame's wake-ups in both loops cost that client more than the relay's commit it
# saves (docs/benchmarks.md, "The point of no return: its cost").
DURABLE_FRAME_JOBS = 2
# How long a batch waits for a worker to be running before it is deferred.
WAIT_FOR_WORKER = 30.0


class WorkerLost(TransportLost):
    """The worker delivering this batch died, or none is running: the batch is deferred (a local error)."""


class WorkerFailed(RuntimeError):
    """The transport raised in the worker (a bug there): the batch is deferred, as the scheduler's boundary does."""


@attrs.define(eq=False)
class _Batch:
    jobs: Sequence[Job]
    on_outcome: OnOutcome | None
    before_dot: BeforeDot | None = None
    starts: list[int | None] = attrs.field(factory=list)  # each job's START (``_starts``): what a mark names
    done: trio.Event = attrs.field(factory=trio.Event)
    results: list[list[Outcome]] | None = None
    error: BaseException | None = None
    early: dict[int, list[Outcome]] = attrs.field(factory=dict)  # outcomes sent as each job was answered
    # A pulled body's reader: (job index) -> (next chunk number, the iterator).
    pulls: dict[int, tuple[int, Any]] = attrs.field(factory=dict)


class _Once:
    """A ``task_status`` that may be told ``started`` any number of times (the first one counts)."""

    def __init__(self, task_status: trio.TaskStatus[None]) -> None:
        self._status: trio.TaskStatus[None] | None = task_status

    def started(self) -> None:
        if self._status is not None:
            status, self._status = self._status, None
            status.started()


class _Worker:
    """One worker process and the relay's end of its socket (non-blocking; see ``send`` and ``_converse``)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.pid = 0
        self.sock: socket.socket | None = None
        self.ready = False
        self.batches: dict[int, _Batch] = {}
        self.send_lock = trio.Lock()
        self.told_durable = 0  # the log's durable end as last sent to this worker (``durable`` frames)
        self.durable_changed = trio.Event()

    async def send(self, frame: bytes) -> None:
        """``frame`` to the worker: written at once when the socket buffer takes it (a batch frame nearly always:
        a stored body goes by position, not in it), else the rest waits under ``send_lock``, so frames never
        interleave. Cancelled with part of the frame out, it shuts the socket down: a stream cut mid-frame is of
        no more use, and the worker's death path (WorkerLost for its batches) follows.

        Why not trio's ``SocketStream.send_all``: its checkpoint and wrapping cost the relay's loop a pass of
        the scheduler a batch, on the path a lone client waits behind.
        """
        sock = self.sock
        if sock is None:
            raise WorkerLost(f"delivery worker {self.index} is not running")
        view = memoryview(frame)
        if not self.send_lock.locked():
            try:
                view = view[sock.send(view):]
            except BlockingIOError:
                pass
            except OSError as exc:
                raise WorkerLost(f"delivery worker {self.index} (pid {self.pid}) is gone: {exc}") from None
            if not view:
                return
        try:
            async with self.send_lock:
                while view:
                    try:
                        await trio.lowlevel.wait_writable(sock)
                        view = view[sock.send(view):]
                    except BlockingIOError:
                        continue
                    except (trio.ClosedResourceError, OSError) as exc:
                        raise WorkerLost(f"delivery worker {self.index} (pid {self.pid}) is gone: {exc}") from None
        except trio.Cancelled:
            if len(view) < len(frame):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # both ends see EOF
            raise


class _Process(Protocol):
    """A running worker as ``_life`` needs it: ``trio.Process`` (a new interpreter) or ``worker_fork.Forked``."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


class DeliveryWorkers:
    """The ``smtp`` and ``mx`` transports of a relay with ``[delivery] processes`` > 0 (see the module's text).

    ``observers``: told each TLS-policy outcome the workers count, as ``Planner.observers`` are (the
    relay's metrics). ``reused``: connections the workers took from their caches and found alive.
    ``deaths``: workers that ended, for tests and the log.
    """

    def __init__(self, config: Config, count: int, forked: Sequence[Forked] = ()) -> None:
        self.config = config
        self.count = count
        # Workers forked before the relay's loop started (worker_fork), for their first lives; the rest, and
        # every restart, are new interpreters.
        self._forked = dict(enumerate(forked))
        self.observers: list[Callable[[str, str], None]] = []
        # Told how many points of no return a worker marked itself, as each batch ends (the relay's metrics).
        self.mark_observers: list[Callable[[int], None]] = []
        # Told how many fdatasyncs of its marks file a worker made since it last said (the relay's metrics).
        self.sync_observers: list[Callable[[int], None]] = []
        self.reused = 0
        self.deaths = 0
        self.served = 0  # body chunks read here for a worker (a body not given by position, or its fallback)
        self.workers = [_Worker(i) for i in range(count)]
        self.durable_end = 0  # the spool log's durable end, as the group commit last told it (``durable``)
        self._next_batch = 0
        self._ready_changed = trio.Event()
        self._nursery: trio.Nursery | None = None

    def durable(self, end: int) -> None:
        """The log is durable up to ``end`` (``GroupCommit.durable_observers``): the workers with batches out are
        told, so that each marks the point of no return of an attempt whose START is durable in its own file
        (``mta.delivery.worker_marks``) instead of asking for it here."""
        self.durable_end = end
        for worker in self.workers:
            newly = sum(1 for batch in worker.batches.values() for start in batch.starts
                        if start is not None and worker.told_durable <= start < end)
            if newly >= DURABLE_FRAME_JOBS:
                worker.durable_changed.set()

    async def _tell_durable(self, worker: _Worker, scope: trio.CancelScope) -> None:
        """One ``durable`` frame per wake-up, with the newest end: commits that come while one is sent coalesce.
        Ends with the worker's life (``scope``), or when its socket is gone (its death path follows)."""
        with scope, contextlib.suppress(WorkerLost):
            while True:
                await worker.durable_changed.wait()
                worker.durable_changed = trio.Event()
                end = self.durable_end
                if end > worker.told_durable and worker.ready:
                    worker.told_durable = end
                    await worker.send(encode(["durable", end]))

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.ready]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker (``started`` once each has said it is ready), keep them running, roll up TLS-RPT."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            r = self.config.delivery.resolver
            reporter = Planner(self.config, mx.make_resolver(r.host if r else None, r.port if r else 53)).reporter
            if reporter is not None:
                await nursery.start(reporter.run)
            for worker in self.workers:
                await nursery.start(self._keep, worker)
            task_status.started()

    async def _keep(self, worker: _Worker, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run ``worker``, and again after each death, with a bounded back-off."""
        delay = RESTART_MIN
        first = _Once(task_status)  # the relay starts even if a worker cannot: deliveries wait or defer
        while True:
            started = trio.current_time()
            how = await self._life(worker, first)
            first.started()
            lived = trio.current_time() - started
            delay = RESTART_MIN if lived >= STABLE_AFTER else min(RESTART_MAX, delay * 2)
            self.deaths += 1
            event(log, "worker_died", None, level=logging.ERROR, worker=worker.index, worker_pid=worker.pid, status=how,
                  lived=lived, restart_in=delay)
            await trio.sleep(delay)

    async def _life(self, worker: _Worker, task_status: _Once) -> str:
        """One worker process from its start to its death; returns how it ended (``signal 9``, ``exit 1``)."""
        forked = self._forked.pop(worker.index, None)
        process: _Process
        if forked is not None and forked.sock is not None:
            ours, process = forked.sock, forked
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                process = await self._spawn(worker, theirs)
            except OSError as exc:  # out of processes or descriptors: try again after the back-off
                ours.close()
                return f"could not start: {exc}"
            finally:
                theirs.close()
        worker.pid = process.pid
        ours.setblocking(False)
        worker.sock = ours
        worker.told_durable = 0
        telling = trio.CancelScope()  # this life's ``durable`` frames
        try:
            await worker.send(encode(["config", dump_config(self.config), logging.getLogger().getEffectiveLevel()]))
            assert self._nursery is not None
            self._nursery.start_soon(self._tell_durable, worker, telling)
            await self._converse(worker, task_status)
        except (WorkerLost, ProtocolError) as exc:
            if isinstance(exc, ProtocolError):
                event(log, "worker_protocol", None, level=logging.ERROR, worker=worker.index, worker_pid=worker.pid,
                      error=str(exc))
        finally:
            telling.cancel()
            worker.ready = False
            worker.sock = None
            trio.lowlevel.notify_closing(ours)  # a sender waiting for room gets ClosedResourceError: WorkerLost
            ours.close()
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()  # the socket is gone or garbled: this worker is of no use
                await process.wait()
                lost = worker.batches
                worker.batches = {}
                marks = await self._marks_of(worker, lost) if lost else {}
            for batch in lost.values():
                if batch.error is None:
                    died = WorkerLost(f"delivery worker {worker.index} (pid {worker.pid}) died during the delivery "
                                      f"({_status(process.returncode)}); the message may have been delivered")
                    died.marked = {i: marks[start] for i, start in enumerate(batch.starts)
                                   if start is not None and start in marks}
                    batch.error = died
                batch.done.set()
        return _status(process.returncode)

    async def _marks_of(self, worker: _Worker, lost: dict[int, _Batch]) -> dict[int, tuple[str, ...]]:
        """The points of no return the dead ``worker`` marked in its own files, by START position (read once it
        is gone: nobody writes them any more)."""
        dirs = {marks_dir(job.body.spool_path) for batch in lost.values() for job in batch.jobs
                if isinstance(job.body, StoredBody)}
        found: dict[int, tuple[str, ...]] = {}
        for directory in dirs:
            for mark in await trio.to_thread.run_sync(marks_of, directory, marks_prefix(worker.index, worker.pid)):
                found[mark.start_pos] = tuple(dict.fromkeys(found.get(mark.start_pos, ()) + mark.recipients))
        return found

    async def _spawn(self, worker: _Worker, theirs: socket.socket) -> trio.Process:
        """Worker ``worker`` on ``theirs``, as a new interpreter."""
        code_dir = os.path.dirname(os.path.dirname(os.path.abspath(mta.__file__)))  # noqa: ASYNC240 -- no file access
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (code_dir, os.environ.get("PYTHONPATH")) if p))
        return await trio.lowlevel.open_process(
            [sys.executable, "-P", "-m", "mta.delivery.worker_main", str(theirs.fileno()), str(worker.index)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)

    async def _converse(self, worker: _Worker, task_status: _Once) -> None:
        """Frames from ``worker`` until its socket ends (one ``recv`` a wake-up: ``SocketReceiver``)."""
        assert worker.sock is not None and self._nursery is not None
        receiver = SocketReceiver(worker.sock)
        reader = FrameReader()
        while True:
            data = await receiver.receive()
            if not data:
                return
            for message in reader.feed(data):
                try:
                    self._take(worker, message, task_status)
                except (TypeError, ValueError, IndexError, KeyError) as exc:  # a frame with the wrong fields
                    raise ProtocolError(f"a malformed {message[0]!r} frame: {type(exc).__name__}: {exc}") from None

    def _take(self, worker: _Worker, message: list[Any], task_status: _Once) -> None:
        """One frame from ``worker``."""
        assert self._nursery is not None
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            event(log, "worker_started", None, worker=worker.index, worker_pid=worker.pid)
            task_status.started()
            self._wake()
        elif kind == "log":
            _relog(worker, message)
        elif kind == "tls_policy":
            self._tell(str(message[1]), str(message[2]))
        elif kind == "read":
            self._nursery.start_soon(self._serve_read, worker, int(message[1]), int(message[2]),
                                     int(message[3]))
        elif kind == "dot":
            self._nursery.start_soon(self._serve_dot, worker, int(message[1]), int(message[2]),
                                     tuple(str(r) for r in message[3]))
        else:
            self._batch_message(worker, kind, message)

    def _tell(self, policy: str, result: str) -> None:
        """A TLS-policy outcome to the observers (the metrics); a broken observer costs its count, nothing more."""
        for observe in self.observers:
            try:
                observe(policy, result)
            except Exception as exc:
                event(log, "observer_error", None, level=logging.ERROR, exc_info=exc, error=str(exc))

    def _batch_message(self, worker: _Worker, kind: str, message: list[Any]) -> None:
        batch = worker.batches.get(int(message[1]))
        if batch is None:
            raise ProtocolError(f"a {kind!r} frame for batch {message[1]}, which is not in flight")
        if kind == "outcome":
            index, outcomes = int(message[2]), decode_outcomes(message[3])
            batch.early[index] = outcomes
            if batch.on_outcome is not None and batch.error is None:
                try:
                    batch.on_outcome(index, outcomes)
                except Exception as exc:  # the scheduler's boundary decides, as if the transport had raised it
                    batch.error = exc
        elif kind == "done":
            results = [batch.early.get(i) if outs is None else decode_outcomes(outs)
                       for i, outs in enumerate(message[2])]
            if len(results) != len(batch.jobs) or any(r is None for r in results):
                raise ProtocolError(f"a done frame with {len(results)} results for {len(batch.jobs)} jobs, or a "
                                    "job's outcomes neither sent before nor now")
            batch.results = [r for r in results if r is not None]
            self.reused += int(message[3])
            if message[4]:
                for observe in self.mark_observers:
                    observe(int(message[4]))
            if message[5]:
                for observe in self.sync_observers:
                    observe(int(message[5]))
            del worker.batches[int(message[1])]
            batch.done.set()
        elif kind == "failed":
            if batch.error is None:
                batch.error = WorkerFailed(f"in delivery worker {worker.index} (pid {worker.pid}): {message[2]}")
                event(log, "worker_error", None, level=logging.ERROR, worker=worker.index, worker_pid=worker.pid,
                      qids=[job.queue_id for job in batch.jobs], error=str(message[2]), traceback=str(message[3]))
            del worker.batches[int(message[1])]
            batch.done.set()
        else:
            raise ProtocolError(f"a {kind!r} frame from a worker")

    async def _serve_read(self, worker: _Worker, bid: int, index: int, k: int) -> None:
        """Chunk ``k`` of job ``index``'s body, read through the spool (a damaged one is named there)."""
        batch = worker.batches.get(bid)
        data: bytes | None = None
        error: str | None = None
        if batch is None or not 0 <= index < len(batch.jobs):
            error = "no such body"
        else:
            try:
                data = await self._chunk(batch, index, k)
            except Exception as exc:  # DamagedBody: the scheduler sees it on the StoredBody and decides
                batch.error = batch.error or exc
                error = f"{type(exc).__name__}: {exc}"
        try:
            await worker.send(encode(["chunk", bid, index, k, data, error]))
        except WorkerLost:
            pass  # its death fails the batch

    async def _serve_dot(self, worker: _Worker, bid: int, index: int, recipients: tuple[str, ...]) -> None:
        """Job ``index``'s point of no return made durable (the scheduler's ``before_dot``), then ``dot_ok``:
        the worker writes the final dot only after that answer."""
        batch = worker.batches.get(bid)
        error: str | None = None
        if batch is None or not 0 <= index < len(batch.jobs):
            error = "no such job"
        elif batch.before_dot is not None:
            try:
                await batch.before_dot(index, recipients)
            except Exception as exc:  # DiskFull: the dot is not sent, and the batch is deferred
                if is_fatal(exc):  # a failed fsync ends the relay, as at every other boundary
                    raise
                batch.error = batch.error or exc
                error = f"{type(exc).__name__}: {exc}"
        try:
            worker.told_durable = max(worker.told_durable, self.durable_end)
            await worker.send(encode(["dot_ok", bid, index, error, self.durable_end]))
        except WorkerLost:
            pass  # its death fails the batch

    async def _chunk(self, batch: _Batch, index: int, k: int) -> bytes | None:
        """Chunk ``k``: the next one of this body's reader, or (a retry, or a worker that read the chunks before
        ``k`` itself and could not read ``k``) a new reader that reads and drops the chunks before it."""
        at, chunks = batch.pulls.get(index, (0, None))
        if chunks is None or k < at:
            at, chunks = 0, body_chunks(batch.jobs[index].body).__aiter__()
        chunk: bytes | None = None
        try:
            while at <= k:
                chunk = await chunks.__anext__()
                at += 1
        except StopAsyncIteration:
            chunk = None
        batch.pulls[index] = (at, chunks)
        self.served += 1
        return chunk

    def _wake(self) -> None:
        changed, self._ready_changed = self._ready_changed, trio.Event()
        changed.set()

    def _least_busy(self) -> _Worker | None:
        """The ready worker with the fewest batches in flight; None while none is ready."""
        ready = [w for w in self.workers if w.ready]
        return min(ready, key=lambda w: len(w.batches)) if ready else None

    async def _pick(self) -> _Worker:
        worker = self._least_busy()
        if worker is not None:  # the common case, without the cancel scope's deadline (a few us of the loop's time)
            return worker
        with trio.move_on_after(WAIT_FOR_WORKER):
            while (worker := self._least_busy()) is None:
                await self._ready_changed.wait()
            return worker
        raise WorkerLost(f"no delivery worker running after {WAIT_FOR_WORKER:g} s")

    PASSES_DOT = True  # a worker asks for each job's point of no return before its final dot (``dot`` frames)

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        """Hand the batch to a worker; its outcomes as the worker sends them (``Transport.deliver``).

        Raises WorkerLost (the worker died, or none runs) or WorkerFailed (the
        transport raised there), which the scheduler's batch boundary turns into
        deferrals; DamagedBody when a body could not be read.
        """
        items: list[list[Any]] = []
        log_dir: str | None = None
        own_marks = ""  # where the worker marks each job's point of no return itself (mta.delivery.worker_marks)
        for job in jobs:
            if isinstance(job.body, StoredBody):  # its DATA records' positions: the worker reads them (worker_body)
                items.append([job_header(job), list(job.body.positions)])
                if log_dir is None:  # absolute: a spool dir may be given relative to the relay's cwd
                    log_dir = os.path.abspath(job.body.log_dir)  # noqa: ASYNC240 -- getcwd, no file access
                    own_marks = os.path.abspath(marks_dir(job.body.spool_path))  # noqa: ASYNC240 -- getcwd
            else:
                items.append([job_header(job), await _inline(job)])
        worker = await self._pick()
        self._next_batch += 1
        bid = self._next_batch
        batch = _Batch(jobs, on_outcome, before_dot, _starts(jobs))
        worker.batches[bid] = batch
        try:
            marks = None
            if own_marks:
                marks = [own_marks, batch.starts, self.durable_end]
                worker.told_durable = max(worker.told_durable, self.durable_end)
            frame = encode(["batch", bid, destination_item(destination), items, log_dir, marks])
            del items  # an inline body is not held here for the batch's whole delivery
            await worker.send(frame)
            del frame
            await batch.done.wait()
        finally:
            worker.batches.pop(bid, None)
        if batch.error is not None:
            raise batch.error
        assert batch.results is not None
        return batch.results


def _starts(jobs: Sequence[Job]) -> list[int | None]:
    """Each job's START position (what a worker's mark names), None for a body not from the spool."""
    return [job.body.start_pos if isinstance(job.body, StoredBody) else None for job in jobs]


async def _inline(job: Job) -> list[bytes] | None:
    """The body's chunks, for the batch frame; None: the worker pulls it (big and not in memory)."""
    body = job.body
    if isinstance(body, StoredBody) and not body.cached and body.size > INLINE_BODY:
        return None
    if not isinstance(body, StoredBody) and job.size > INLINE_BODY:
        return None
    return [bytes(chunk) async for chunk in body_chunks(body)]


def _relog(worker: _Worker, message: list[Any]) -> None:
    """A worker's log record, through this process's handlers (its pid is the worker's, as smtp[pid])."""
    _, name, level, created, event_name, qid, fields, tb = message
    logger = logging.getLogger(str(name))
    if not logger.isEnabledFor(int(level)):
        return
    if event_name is not None:
        if tb:
            fields = {**fields, "traceback": tb}
        msg: object = LogEvent(str(event_name), qid, fields)
    else:
        msg = str(fields) + (f" | {tb}" if tb else "")
    record = logger.makeRecord(str(name), int(level), "(worker)", 0, msg, (), None)
    record.created = float(created)
    record.msecs = math.modf(record.created)[0] * 1000
    record.process = worker.pid
    logger.handle(record)


def _mapping(items: dict[Any, Any]) -> types.MappingProxyType[Any, Any]:
    return types.MappingProxyType(items)


def dump_config(config: Config) -> bytes:
    """The config, pickled for a worker (its routes are a read-only mapping, which pickle does not know)."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table,
                              types.MappingProxyType: lambda m: (_mapping, (dict(m),))}
    pickler.dump(config)
    return out.getvalue()


def _status(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    return f"signal {-returncode}" if returncode < 0 else f"exit {returncode}"
