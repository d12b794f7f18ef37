"""A delivery worker: the SMTP transport in its own process and trio loop, fed by the relay over a socketpair.

``python -P -m mta.delivery.worker_main FD INDEX`` (``mta.delivery.workers``
starts it; nobody else should), or ``serve`` in a process forked by the relay's
forker (``mta.delivery.worker_fork``, under ``mta serve``). FD is this
process's end of the socketpair.
The first frame is the relay's config; then every ``batch`` frame is handed
to one ``SmtpTransport`` (its connection cache, MX lookups, TLS policies and
TLS-RPT journal are this process's), each outcome is sent back the moment
the next hop answers, and the batch ends with ``done`` or ``failed``. Before
each final dot the job's point of no return is made durable: in this
worker's own marks file when the job's START is durable (the relay says how
far the log is, in ``durable`` frames and in each batch and ``dot_ok``;
``mta.delivery.worker_marks``), else asked of the relay (``dot``, answered
``dot_ok`` once its record is durable); the dot goes only after either. A
stored body comes as its DATA records' positions and is read here from the
spool's segment files as it is sent (``mta.delivery.worker_body``).

Crash-only, as the relay: there is no shutdown. The relay ends a worker with
SIGKILL; a worker whose relay died sees EOF on its socket and exits at once,
cancelling whatever it was sending (the relay's recovery names those
messages in doubt, as after any crash mid-delivery).

What the transport logs and counts goes back to the relay (``log`` and
``tls_policy`` frames) and comes out of the relay's own log handler and
metrics. Only the line that this worker is leaving because its relay is gone
is written here, to the stderr it shares with the relay, since there is no
relay left to write it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pickle
import signal
import socket
import sys
import traceback
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import trio

from mta.config import Config
from mta.delivery.worker_body import SegmentBody, SegmentReader
from mta.delivery.worker_marks import WorkerMarks
from mta.delivery.worker_protocol import (
    FrameReader,
    ProtocolError,
    SocketReceiver,
    decode_destination,
    encode,
    encode_outcomes,
    job_from,
    marks_prefix,
)
from mta.observe import logline
from spool import MarksWriter

log = logging.getLogger("mta.worker")


class BodyUnavailable(Exception):
    """The relay could not read a body this worker asked for (damaged data, say): the batch fails."""


class PointNotRecorded(Exception):
    """The relay could not make a job's point of no return durable (a full disk, say): its dot is not sent."""


class PulledBody:
    """A big body read from the relay chunk by chunk as the transport sends it; again from the start on a retry.

    Why not inline: a 50 MB body would sit whole in both processes' memory;
    this way one chunk (one DATA record) is in flight at a time.
    """

    def __init__(self, worker: Worker, batch: int, index: int) -> None:
        self.worker = worker
        self.batch = batch
        self.index = index

    def __iter__(self) -> Iterator[bytes]:
        raise TypeError("a body pulled from the relay is read with async for")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        k = 0
        while True:
            chunk = await self.worker.pull(self.batch, self.index, k)
            if chunk is None:
                return
            yield chunk
            k += 1


class _Forward(logging.Handler):
    """Every record the transport logs, as a ``log`` frame for the relay's own handler."""

    def __init__(self, worker: Worker) -> None:
        super().__init__()
        self.worker = worker

    def emit(self, record: logging.LogRecord) -> None:
        tb = "".join(traceback.format_exception(*record.exc_info)) if record.exc_info and record.exc_info[0] \
            else None
        msg = record.msg
        if isinstance(msg, logline.LogEvent):
            body: list[Any] = [msg.name, msg.qid, dict(msg.fields)]
        else:
            body = [None, None, record.getMessage()]
        self.worker.send(["log", record.name, record.levelno, record.created, *body, tb])


class Worker:
    def __init__(self, sock: socket.socket, index: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.index = index
        self.readers: dict[str, SegmentReader] = {}  # by the spool's log directory (one: its relay's)
        self.transport: Any = None  # the SmtpTransport, once the config came
        self._out_send, self._out_recv = trio.open_memory_channel[bytes](math.inf)
        self._reader = FrameReader()
        self._pulls: dict[tuple[int, int, int], trio.Event] = {}
        self._chunks: dict[tuple[int, int, int], tuple[bytes | None, str | None]] = {}
        self._dots: dict[tuple[int, int], trio.Event] = {}  # (batch, job) -> its point of no return answered
        self._dot_errors: dict[tuple[int, int], str | None] = {}
        # Own marks (mta.delivery.worker_marks): each batch's jobs' START positions, the log's durable end as the
        # relay last said, and the writer (None until the first batch names the spool's marks directory; False
        # once it failed: every point of no return is then asked of the relay).
        self._starts: dict[int, list[int | None]] = {}
        self._own: dict[int, int] = {}  # each batch's points marked here (told to the relay in its ``done``)
        self._told_syncs = 0  # the marks' fdatasyncs told to the relay so far (in ``done`` frames)
        self._unmarked: dict[int, int] = {}  # each batch's jobs that may still be marked here
        self._marking: set[int] = set()  # batches whose job waits for its mark now
        self.durable = 0
        self.marks: WorkerMarks | bool | None = None
        self._marks_opening: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.format = "text"  # the relay's [log] format, for the one line written here

    def send(self, message: list[Any]) -> None:
        """Queue a frame for the relay; callable from this loop's tasks and from worker threads."""
        frame = encode(message)
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            if self._token is not None:  # a worker thread (a policy cache's file write, say) logged
                trio.from_thread.run_sync(self._out_send.send_nowait, frame, trio_token=self._token)
            return
        self._out_send.send_nowait(frame)

    async def _sender(self) -> None:
        """Write queued frames, all that are queued in one write: an outcome and its ``done``, log lines and
        the frames of batches answered together wake the relay once, not once a frame."""
        async for frame in self._out_recv:
            await trio.lowlevel.checkpoint()  # let the task that queued this one queue what follows it
            frames = [frame]
            while True:
                try:
                    frames.append(self._out_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            view = memoryview(frames[0] if len(frames) == 1 else b"".join(frames))
            while view:
                try:
                    view = view[self.sock.send(view):]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.sock)

    async def pull(self, batch: int, index: int, k: int) -> bytes | None:
        key = (batch, index, k)
        self._pulls[key] = done = trio.Event()
        self.send(["read", batch, index, k])
        try:
            await done.wait()
        finally:
            self._pulls.pop(key, None)
        data, error = self._chunks.pop(key)
        if error is not None:
            raise BodyUnavailable(error)
        return data

    def _coming(self) -> int:
        """Batches whose next job may ask for a mark soon: one with jobs left to mark and none waiting for one."""
        return sum(1 for batch, left in self._unmarked.items() if left > 0 and batch not in self._marking)

    async def before_dot(self, batch: int, index: int, recipients: Sequence[str]) -> None:
        """Make the point of no return of job ``index``'s ``recipients`` durable: in this worker's own marks
        when the job's START is durable, else asked of the relay (and wait until it says it is).

        Raises PointNotRecorded when it could not (the final dot must not go)."""
        starts = self._starts.get(batch)
        start = starts[index] if starts is not None and 0 <= index < len(starts) else None
        if start is not None and start < self.durable and isinstance(self.marks, WorkerMarks):
            self._unmarked[batch] -= 1
            self._marking.add(batch)
            try:
                await self.marks.mark(start, recipients)
            except OSError as exc:  # the relay's log still can: every later point goes there
                log.error("delivery worker %d: its own marks failed (%s); each point of no return is asked of the "
                          "relay from now on", self.index, exc)
                self.marks = False
            else:
                self._own[batch] = self._own.get(batch, 0) + 1
                return
            finally:
                self._marking.discard(batch)
        key = (batch, index)
        self._dots[key] = done = trio.Event()
        self.send(["dot", batch, index, list(recipients)])
        try:
            await done.wait()
        finally:
            self._dots.pop(key, None)
        error = self._dot_errors.pop(key, None)
        if error is not None:
            raise PointNotRecorded(error)

    async def run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sender)
            receiver = SocketReceiver(self.sock)
            while True:
                data = await receiver.receive()
                if not data:
                    if self.transport is not None:  # before its config: the relay failed to start, and says why
                        gone(self.index, self.format)
                    nursery.cancel_scope.cancel()
                    return
                for message in self._reader.feed(data):
                    await self._dispatch(nursery, message)

    async def _dispatch(self, nursery: trio.Nursery, message: list[Any]) -> None:
        kind = message[0]
        if kind == "config":
            await self._configure(nursery, pickle.loads(message[1]), int(message[2]))
        elif kind == "batch":
            nursery.start_soon(self._deliver, message)
        elif kind == "chunk":
            _, batch, index, k, data, error = message
            key = (int(batch), int(index), int(k))
            done = self._pulls.get(key)
            if done is not None:
                self._chunks[key] = (data, error)
                done.set()
        elif kind == "durable":
            self.durable = max(self.durable, int(message[1]))
        elif kind == "dot_ok":
            _, batch, index, error, durable = message
            self.durable = max(self.durable, int(durable))
            dot_key = (int(batch), int(index))
            waiting = self._dots.get(dot_key)
            if waiting is not None:
                self._dot_errors[dot_key] = None if error is None else str(error)
                waiting.set()
        else:
            raise ProtocolError(f"a {kind!r} frame from the relay")

    async def _configure(self, nursery: trio.Nursery, config: Config, level: int) -> None:
        from mta.delivery.smtp_transport import SmtpTransport

        self.format = config.log.format
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.addHandler(_Forward(self))
        root.setLevel(level)
        transport = SmtpTransport(config)
        transport.policies.observers.append(lambda policy, result: self.send(["tls_policy", policy, result]))
        await nursery.start(transport.cache.run)  # the TLS-RPT roll-up is the relay's, once for all workers
        self.transport = transport
        self.send(["ready", os.getpid()])

    async def _open_marks(self, directory: str) -> None:
        """This life's marks file under ``directory`` (once; the batches that come meanwhile wait for it)."""
        if self._marks_opening is not None:
            await self._marks_opening.wait()
            return
        self._marks_opening = trio.Event()
        try:
            writer = await trio.to_thread.run_sync(MarksWriter, directory, marks_prefix(self.index, os.getpid()))
        except OSError as exc:
            log.error("delivery worker %d: no marks file of its own in %s (%s); each point of no return is asked "
                      "of the relay", self.index, directory, exc)
            self.marks = False
        else:
            self.marks = WorkerMarks(writer, self._coming)
        finally:
            self._marks_opening.set()

    def _body(self, batch: int, index: int, header: list[Any], body: Any, log_dir: str | None) -> Any:
        """A job's body as the batch frame gave it: chunks inline, positions in the segment files (read here,
        ``worker_body``), or None (the relay gives it chunk by chunk)."""
        if body is None:
            return PulledBody(self, batch, index)
        if log_dir is not None and body and all(type(p) is int for p in body):
            reader = self.readers.get(log_dir)
            if reader is None:
                reader = self.readers[log_dir] = SegmentReader(log_dir)
            return SegmentBody(reader, str(header[0]), body, int(header[3]),
                               functools.partial(self.pull, batch, index))
        return body

    async def _deliver(self, message: list[Any]) -> None:
        _, batch, dest_item, jobs_items, log_dir, marks = message
        if marks is not None:
            directory, starts, durable = marks
            self.durable = max(self.durable, int(durable))
            self._starts[batch] = [None if s is None else int(s) for s in starts]
            self._unmarked[batch] = sum(s is not None for s in starts)
            if self.marks is None:
                await self._open_marks(str(directory))
        dest = decode_destination(dest_item)
        jobs = [job_from(header, self._body(batch, i, header, body, log_dir))
                for i, (header, body) in enumerate(jobs_items)]
        del message, jobs_items  # the jobs hold what they need; nothing else of the frame stays for the batch

        sent: set[int] = set()

        def on_outcome(i: int, outcomes: list[Any]) -> None:
            sent.add(i)
            self.send(["outcome", batch, i, encode_outcomes(outcomes)])

        before = self.transport.cache.reused
        try:
            results = await self.transport.deliver(dest, jobs, on_outcome,
                                                   before_dot=functools.partial(self.before_dot, batch))
        except Exception as exc:  # the relay defers the batch as a local error and logs it
            self.send(["failed", batch, f"{type(exc).__name__}: {exc}",
                       "".join(traceback.format_exception(exc))])
            return
        finally:
            self._starts.pop(batch, None)
            self._unmarked.pop(batch, None)
            own = self._own.pop(batch, 0)
        syncs = self.marks.syncs - self._told_syncs if isinstance(self.marks, WorkerMarks) else 0
        self._told_syncs += syncs
        # A job's outcomes already sent as they came are not sent again (None in their place).
        self.send(["done", batch, [None if i in sent else encode_outcomes(r) for i, r in enumerate(results)],
                   self.transport.cache.reused - before, own, syncs])


def gone(index: int, fmt: str) -> None:
    """The relay's end of the socket closed: it died (or killed this worker's socket). Say so where we can."""
    line = logging.LogRecord("mta.worker", logging.WARNING, __file__, 0, "%s", None, None)
    line.msg = logline.LogEvent("worker_exit", None, {"worker": index, "worker_pid": os.getpid(),
                                                      "reason": "the relay is gone (EOF on its socket)"})
    formatter = logline.JsonFormatter() if fmt == "json" else logline.TextFormatter()
    sys.stderr.write(formatter.format(line) + "\n")
    sys.stderr.flush()


def serve(sock: socket.socket, index: int) -> int:
    """Worker ``index`` on ``sock`` until the relay's end closes: in a new interpreter or forked (worker_fork).

    SIGTERM and SIGHUP are the relay's: a worker lives as long as the relay's end of its socket, so a SIGTERM
    to the whole process group (systemd's default ``KillMode``) does not cut the deliveries a drain waits for.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    trio.run(Worker(sock, index).run)
    return 0


def main(argv: list[str]) -> int:
    fd, index = int(argv[0]), int(argv[1])
    return serve(socket.socket(fileno=fd), index)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
