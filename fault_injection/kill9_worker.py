"""The process that ``kill9`` kills: the trio spool under load, with a file as its next hop.

``python -m fault_injection.kill9_worker --zygote SOCKET`` starts a *zygote*: it
imports everything once, listens on a Unix socket, and forks one worker per
connection (the first line names the spool, the next hop and a seed). Why: on
a busy machine starting Python and importing trio takes seconds, and kill9
restarts the worker hundreds of times; a forked worker is a real process all
the same, killed with a real SIGKILL. The worker's first line is ``pid N``.

Protocol on the connection, one line each way (the harness is the only client):

- in ``msg N RCPT[,RCPT...] BODYLEN``: enqueue message number N; out ``ack N QUEUEID``
  once ``AsyncSpool.enqueue`` returned (the moment a relay says 250);
- in ``drain``: stop deferring; out ``drained`` once nothing is queued or in flight;
- out ``ready`` when recovery is done and the runners are running;
- out ``rec N RCPT`` after a DELIVERY record for it is durable.

Delivery models a remote SMTP server that answers 250 when the line
``N RCPT CRC32`` is appended *and fsynced* to NEXT_HOP: that happens before
``record_delivery``, so a kill between the two is the allowed duplicate window.
Some first attempts are deferred (4xx) to exercise the deferred runners and
replacement envelopes. There is no shutdown: the harness ends it with SIGKILL.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import sys
import zlib

import trio

from spool.aio.async_spool import AsyncSpool
from spool.config.engine import SpoolConfig
from spool.engine.spool import Attempt
from spool.format.record import Outcome, Status
from spool.read import listing as admin

DELIVERY_TASKS = 8


def body_for(n: int, length: int) -> bytes:
    """The body of message ``n``: the harness computes the same bytes to check what arrived."""
    head = f"Subject: message {n}\r\n\r\n".encode()
    filler = (f"{n:08d}" * (length // 8 + 1)).encode()
    return (head + filler)[: max(length, len(head))]


def worker_config() -> SpoolConfig:
    # checkpoint_bytes=0: a checkpoint every interval even under load (the relay's
    # default waits for a quiet moment or 16 MiB), so kills land in checkpoints often. in_doubt "redeliver":
    # the harness counts the duplicates of automatic redelivery, with no operator to release held mail.
    return SpoolConfig(segment_size=16384, retry_intervals=(0.05, 0.1), body_chunk=4096,
                       checkpoint_interval=0.02, checkpoint_bytes=0, in_doubt="redeliver")


class Worker:
    def __init__(self, conn: socket.socket, spool_dir: str, next_hop: str, seed: int) -> None:
        self.conn = conn
        self.stream: trio.SocketStream
        self.send_lock = trio.Lock()
        self.spool_dir = spool_dir
        self.hop_fd = os.open(next_hop, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.rng = random.Random(seed)
        self.draining = False
        self.aspool: AsyncSpool
        self.limit = trio.Semaphore(DELIVERY_TASKS)

    async def say(self, line: str) -> None:
        async with self.send_lock:
            await self.stream.send_all(line.encode() + b"\n")

    async def main(self) -> None:
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(self.conn))
        await self.say(f"pid {os.getpid()}")
        self.aspool = await AsyncSpool.open(self.spool_dir, worker_config())
        async with trio.open_nursery() as nursery:
            await nursery.start(self.aspool.run)
            nursery.start_soon(self.deliverer, nursery)
            nursery.start_soon(self.reader, nursery)
            await self.say("ready")

    async def reader(self, nursery: trio.Nursery) -> None:
        buf = b""
        while True:
            data = await self.stream.receive_some(65536)
            if not data:
                await trio.sleep_forever()  # the harness hung up; it will kill us
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                words = line.decode().split()
                if words and words[0] == "msg":
                    nursery.start_soon(self.accept, int(words[1]), words[2].split(","), int(words[3]))
                elif words == ["drain"]:
                    self.draining = True
                    nursery.start_soon(self.watch_drain)

    async def accept(self, n: int, rcpts: list[str], length: int) -> None:
        mid = await self.aspool.enqueue(f"s{n}@client.example", rcpts, body_for(n, length), extra={"n": n})
        await self.say(f"ack {n} {mid:X}")

    async def deliverer(self, nursery: trio.Nursery) -> None:
        while True:
            for attempt in await self.aspool.next_due(limit=DELIVERY_TASKS):
                await self.limit.acquire()
                nursery.start_soon(self.deliver, attempt)

    async def deliver(self, attempt: Attempt) -> None:
        try:
            body = b"".join(await self.aspool.read_body(attempt))
            n = int(attempt.envelope.extra["n"])
            outs: list[Outcome] = []
            for r in attempt.remaining:
                if not self.draining and attempt.envelope.attempts == 0 and self.rng.random() < 0.2:
                    outs.append(Outcome(r, Status.DEFERRED, 451, "4.3.0", "try again later", "hop"))
                    continue
                line = f"{n} {r} {zlib.crc32(body):08x}\n".encode()
                await trio.to_thread.run_sync(self._append_hop, line)
                outs.append(Outcome(r, Status.DELIVERED, 250, "2.0.0", "ok", "hop"))
            await self.aspool.record_delivery(attempt, outs)
            for o in outs:
                if o.status is Status.DELIVERED:
                    await self.say(f"rec {n} {o.recipient}")
            self.aspool.finish(attempt)
        finally:
            self.limit.release()

    def _append_hop(self, line: bytes) -> None:
        os.write(self.hop_fd, line)
        os.fsync(self.hop_fd)

    async def watch_drain(self) -> None:
        while True:
            core = self.aspool.core
            if not core.attempts and admin.count(core) == 0:
                await self.say("drained")
                return
            changed = self.aspool._changed
            with trio.move_on_after(0.2):
                await changed.wait()


def _read_line(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        buf += chunk
    return buf.decode().strip()


def zygote(sock_path: str) -> None:
    """Accept connections and fork a worker for each; children are reaped by the kernel."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)
    sys.stdout.write("zygote ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = srv.accept()
        words = _read_line(conn).split()
        if len(words) != 4 or words[0] != "start":
            conn.close()
            continue
        if os.fork() == 0:
            code = 1
            try:
                srv.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                trio.run(Worker(conn, words[1], words[2], int(words[3])).main)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        conn.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fault_injection.kill9_worker")
    p.add_argument("--zygote", metavar="SOCKET", required=True)
    args = p.parse_args(argv)
    zygote(args.zygote)


if __name__ == "__main__":
    main()
