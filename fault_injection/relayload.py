"""The relay's real workload, recorded once through one ``RecordingFileIO`` for the crash-state harness.

Theory of operation
-------------------
``record(workdir, seed)`` runs, inside one ``trio.run`` in this process:

- the real relay (``mta.process.relay.Relay``, the object ``mta serve`` runs)
  on a spool with 16 KiB segments, a checkpoint looked at every 100 ms, and
  message data written early (``flush_threshold`` 8 KiB), so that rotations
  fall between write-only batches and commits, checkpoints move and garbage
  segments are deleted while mail flows. Its ``io`` is a ``RecordingFileIO``
  rooted at the work directory, which holds the spool *and* the Maildir root:
  every file operation of the log, the checkpoint, the reserve, quarantine
  and local delivery lands in one sequence, in the order it took effect;
- a next hop (``NextHop``): an SMTP server on 127.0.0.1 on the project's
  sans-IO server core. It logs ``remote(n, rcpt)`` into the recording
  *before* it answers 250 (as a real MTA commits before its 250), and
  defers (451 at RCPT) a seeded quarter of first attempts, so replacement
  envelopes, retries and the deferred runners are part of the run;
- SMTP clients: ``smtplib`` in worker threads, a few sessions at once. A
  ``250`` after DATA is logged as ``ack(n, queue id, recipients)`` after it
  arrived, so every file operation the relay did before that reply precedes
  the event;
- the scheduler's observer logs ``recorded(queue id, rcpt, status)`` once a
  DELIVERY record is durable.

Recipients are ``uK@local.test`` (Maildir, ``<root>/mail/uK/``, made on
first delivery) and ``rK@remote.test`` (the next hop, which refuses
``r9@remote.test`` with 550: the relay bounces it, and its DSN goes to the
sender ``sN@senders.test``, whose Maildir ``<root>/mail/sN/`` is made for
it). Message ``n`` carries ``X-Crash-N: n``; its bytes follow from the seed
alone (``message``).

The run ends once every message is acknowledged, every recipient has a
durable outcome, every DSN was delivered, and the checkpointer has deleted at
least two segments behind its checkpoints (the recorder says when it unlinks
one; ``Run.segments_deleted`` says how many), or a bound passed.

What is seeded: the messages, their recipients and sizes, the next hop's
deferrals. What is not: the order in which threads and sessions interleave,
so a recording is saved to a file (``save``) when a state fails, and
replayed from it.
"""

from __future__ import annotations

import functools
import os
import pickle
import random
import re
import smtplib
import time
from collections.abc import Callable, Iterable

import attrs
import trio

from fault_injection.recording import Recording, RecordingFileIO
from mta.config import Config, parse_config
from mta.process.relay import Relay
from mta.smtp.common import Reply
from mta.smtp.server import (
    ConnectionClosed,
    DataAborted,
    DataChunk,
    EndOfData,
    MailFrom,
    NeedData,
    Quit,
    RcptTo,
    ServerConnection,
)
from spool import Attempt
from spool.format.record import Outcome, Status

SEGMENT_SIZE = 16 * 1024
LOCAL_DOMAIN = "local.test"
REMOTE_DOMAIN = "remote.test"
MAILBOXES = 6
REMOTES = 10
REFUSED = f"r{REMOTES - 1}@{REMOTE_DOMAIN}"  # the next hop answers 550 to it: a bounce, and a DSN to the sender
SENDER_DOMAIN = "senders.test"
N_HEADER = b"X-Crash-N: "
QUEUED_AS = re.compile(r"queued as (\S+)")
RUN_BOUND = 120.0  # seconds: a bound on one recorded run, not a pace
DEFER_FIRST = 0.25
MIN_DELETED = 2  # by default the run goes on until the checkpointer has deleted this many segments

CONFIG = """\
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.crash.test"
[spool]
dir = "spool"
segment_size = "16k"
retry_intervals = ["1s", "2s"]
queue_minfree = "1MB"
checkpoint_interval = "100ms"
checkpoint_bytes = 0
[delivery]
concurrency = 6
per_destination = 4
max_messages_per_connection = 5
[routes]
"{local}" = "maildir:mail"
"{senders}" = "maildir:mail"
"{remote}" = "smtp://127.0.0.1:{port}?tls=none"
"""


def relay_config(root: str, port: int) -> Config:
    """The relay's config with its spool in ``root/spool`` and its Maildirs in ``root/mail``.

    ``flush_threshold`` (not a file setting) is cut to 8 KiB so that data is written
    before the commit that covers it: write-only batches that end at a segment's tail.
    """
    text = CONFIG.format(local=LOCAL_DOMAIN, senders=SENDER_DOMAIN, remote=REMOTE_DOMAIN, port=port)
    cfg = parse_config(text, source=os.path.join(root, "relay.toml"), base_dir=root)
    return attrs.evolve(cfg, spool=attrs.evolve(cfg.spool, flush_threshold=8 * 1024))


@attrs.frozen
class Plan:
    """What the clients send: message ``n`` goes to ``recipients[n]`` with ``sizes[n]`` bytes of body."""

    seed: int
    recipients: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]

    @classmethod
    def make(cls, seed: int, messages: int) -> Plan:
        rng = random.Random(seed)
        rcpts: list[tuple[str, ...]] = []
        sizes: list[int] = []
        pool = [f"u{i}@{LOCAL_DOMAIN}" for i in range(MAILBOXES)] + [f"r{i}@{REMOTE_DOMAIN}" for i in range(REMOTES)]
        for _ in range(messages):
            rcpts.append(tuple(rng.sample(pool, rng.randint(1, 3))))
            x = rng.random()
            sizes.append(rng.randint(100, 2000) if x < 0.7 else rng.randint(2000, 7000) if x < 0.9
                         else rng.randint(9000, 20000))
        return cls(seed, tuple(rcpts), tuple(sizes))

    def message(self, n: int) -> bytes:
        """Message ``n`` as the client sends it (CRLF lines of 78 characters at most)."""
        head = (f"X-Crash-N: {n}\r\nFrom: s{n}@{SENDER_DOMAIN}\r\nSubject: crash state message {n}\r\n"
                f"Message-ID: <crash-{self.seed}-{n}@client.test>\r\n\r\n").encode()
        lines = []
        size = len(head)
        while size < self.sizes[n]:
            line = (f"{n:06d}." * 12)[:76].encode() + b"\r\n"
            lines.append(line)
            size += len(line)
        return head + b"".join(lines)


def message_number(data: bytes) -> int:
    """The ``X-Crash-N`` of a stored or delivered message; -1 if it has none."""
    at = -1 if data.startswith(N_HEADER) else data.find(b"\n" + N_HEADER)
    if at < 0 and not data.startswith(N_HEADER):
        return -1
    end = data.find(b"\r\n", at + 1)
    try:
        return int(data[at + 1 + len(N_HEADER):end])
    except ValueError:
        return -1


def defers(seed: int, n: int, rcpt: str, attempt: int) -> bool:
    """Whether the next hop answers 451 to this recipient on this attempt (seeded, order-independent)."""
    return attempt == 1 and random.Random(f"{seed}:{n}:{rcpt}").random() < DEFER_FIRST


class NextHop:
    """The recording next hop: logs ``remote(n, rcpt)`` into the recording before its ``250``."""

    def __init__(self, seed: int, log: Callable[..., None]) -> None:
        self.seed = seed
        self.log = log
        self.attempts: dict[tuple[str, str], int] = {}  # (Message-ID-ish key, rcpt) -> attempts seen

    async def handle(self, tcp: trio.SocketStream) -> None:
        conn = ServerConnection("nexthop.crash.test")
        rcpts: list[str] = []
        data = bytearray()
        try:
            while True:
                ev = conn.next_event()
                out = conn.data_to_send()  # replies the core made itself (a refused DATA) included
                if out:
                    await tcp.send_all(out)
                if isinstance(ev, NeedData):
                    conn.receive_data(await tcp.receive_some(65536))
                elif isinstance(ev, MailFrom):
                    rcpts, data = [], bytearray()
                    conn.accept()
                elif isinstance(ev, RcptTo) and ev.address == REFUSED:
                    conn.reject(Reply(550, "5.1.1", "no such user"))
                elif isinstance(ev, RcptTo):
                    rcpts.append(ev.address)
                    conn.accept()
                elif isinstance(ev, DataChunk):
                    data += ev.data
                elif isinstance(ev, EndOfData):
                    self._take(conn, rcpts, bytes(data))
                elif isinstance(ev, DataAborted):
                    data = bytearray()
                elif isinstance(ev, Quit | ConnectionClosed):
                    await tcp.send_all(conn.data_to_send())
                    return
                out = conn.data_to_send()
                if out:
                    await tcp.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    def _take(self, conn: ServerConnection, rcpts: list[str], data: bytes) -> None:
        """Defer the whole transaction if any recipient's seeded draw says so; else log each and accept.

        Deciding at the end of data keeps the server core's RCPT handling plain: a
        transaction is taken or deferred whole, as a next hop that is busy does.
        """
        n = message_number(data)
        for r in rcpts:  # the final dot reached the next hop: the recipients a crash may rightly leave in doubt
            self.log("dot", n, r)
        tries = []
        for r in rcpts:
            key = (str(n), r)
            self.attempts[key] = self.attempts.get(key, 0) + 1
            tries.append(self.attempts[key])
        if n >= 0 and any(defers(self.seed, n, r, t) for r, t in zip(rcpts, tries, strict=True)):
            conn.reject(Reply(451, "4.3.0", "try again later"))
            return
        for r in rcpts:
            self.log("remote", n, r)
        conn.accept()


class WatchedFileIO(RecordingFileIO):
    """The recorder, also telling the run when a segment was deleted (from whichever thread deleted it)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.segments_deleted = 0
        self.on_segment_deleted: Callable[[], None] = lambda: None

    def rename(self, src: str, dst: str) -> None:
        """A Maildir delivery's rename into ``new/`` (what delivers it) is logged as its ``dot``, just before."""
        if f"{os.sep}tmp{os.sep}" in src and f"{os.sep}new{os.sep}" in dst:
            with open(src, "rb") as fh:
                data = fh.read()
            lines = data.split(b"\r\n", 2)
            if len(lines) > 2:
                self.event("dot", message_number(data), lines[1].removeprefix(b"Delivered-To: ").decode())
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        super().unlink(path)
        if path.endswith(".seg"):
            self.segments_deleted += 1
            self.on_segment_deleted()


@attrs.define
class Run:
    """A recorded run: the recording, what was sent, and what the run saw (for its summary line)."""

    seed: int
    messages: int
    recording: Recording
    acked: int = 0
    outcomes: int = 0
    segments_deleted: int = 0
    seconds: float = 0.0

    def save(self, path: str) -> None:
        with open(path, "wb") as fh:
            pickle.dump(self, fh)

    @classmethod
    def load(cls, path: str) -> Run:
        with open(path, "rb") as fh:
            run = pickle.load(fh)
        if not isinstance(run, cls):
            raise ValueError(f"{path} does not hold a recorded relay run")
        return run


def _send(port: int, plan: Plan, n: int) -> tuple[str, tuple[str, ...]] | None:
    """One SMTP session that sends message ``n``; its queue id once the relay said 250, else None."""
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as client:
        client.ehlo("client.crash.test")
        client.mail(f"s{n}@{SENDER_DOMAIN}")
        for r in plan.recipients[n]:
            code, _ = client.rcpt(r)
            if code != 250:
                return None
        code, reply = client.data(plan.message(n))
        found = QUEUED_AS.search(reply.decode("ascii", "replace"))
        return (found.group(1), plan.recipients[n]) if code == 250 and found else None


def _watch_points(relay: Relay, rio: WatchedFileIO) -> None:
    """Log each point of no return's steps into the recording: ``mark`` (its record appended), ``point`` (the
    record durable: the transport may write the dot from now on) for each recipient.

    With the next hop's ``dot`` they place a crash point in the point's window (docs/reliability.md): a
    recipient held after a crash whose ``mark`` had no ``point`` yet was in the commit of its record; one whose
    ``point`` had no ``dot`` was on its way to the next hop. A held recipient before its ``mark`` would be a
    bug. The spool's method is wrapped on this one instance; the relay's code is unchanged.
    """
    aspool = relay.aspool
    passing = aspool.pass_point_of_no_return

    async def watched(attempt: Attempt, recipients: Iterable[str]) -> None:
        rcpts = tuple(recipients)
        qid = aspool.core.queue_id(attempt.envelope.message_id)
        for r in rcpts:
            rio.event("mark", qid, r)
        await passing(attempt, rcpts)
        for r in rcpts:
            rio.event("point", qid, r)

    aspool.pass_point_of_no_return = watched  # type: ignore[method-assign]


async def _drive(root: str, plan: Plan, run: Run, rio: WatchedFileIO, concurrency: int, min_deleted: int) -> None:
    hop = NextHop(plan.seed, rio.event)
    final: set[tuple[str, str]] = set()
    bounced: set[str] = set()  # queue ids with a bounced recipient: each owes its sender one DSN
    dsns: set[str] = set()  # DSNs delivered (their queue ids)
    changed = trio.Event()

    def observe(qid: str, o: Outcome) -> None:
        nonlocal changed
        rio.event("recorded", qid, o.recipient, int(o.status))
        if o.status.final:
            final.add((qid, o.recipient))
        if o.status is Status.BOUNCED:
            bounced.add(qid)
        if o.recipient.endswith("@" + SENDER_DOMAIN) and o.status.final:
            dsns.add(qid)
        changed.set()
        changed = trio.Event()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, hop.handle, 0, host="127.0.0.1"))
        port = int(listeners[0].socket.getsockname()[1])
        relay: Relay = await nursery.start(Relay(relay_config(root, port), io=rio).run)
        relay.scheduler.observers.append(observe)
        _watch_points(relay, rio)
        acked: list[tuple[str, tuple[str, ...]]] = []
        todo = iter(range(run.messages))
        limit = trio.CapacityLimiter(concurrency)

        async def client() -> None:
            for n in todo:
                async with limit:
                    got = await trio.to_thread.run_sync(_send, relay.ports[0], plan, n)
                if got is not None:
                    rio.event("ack", n, got[0], got[1])
                    acked.append(got)

        with trio.fail_after(RUN_BOUND):
            async with trio.open_nursery() as clients:
                for _ in range(concurrency):
                    clients.start_soon(client)
            want = {(qid, r) for qid, rcpts in acked for r in rcpts}
            while not want <= final or len(dsns) < len(bounced):
                await changed.wait()
            # Then the checkpointer deletes segments once the runners (trailing by their intervals) passed them.
            token = trio.lowlevel.current_trio_token()
            while rio.segments_deleted < min_deleted:
                deleted = trio.Event()
                rio.on_segment_deleted = functools.partial(token.run_sync_soon, deleted.set)
                if rio.segments_deleted < min_deleted:  # none came between the test above and the hook
                    await deleted.wait()
            rio.on_segment_deleted = lambda: None
        run.acked = len(acked)
        run.outcomes = len(final)
        run.segments_deleted = rio.segments_deleted
        nursery.cancel_scope.cancel()


def record(workdir: str, seed: int, messages: int = 40, concurrency: int = 4, min_deleted: int = MIN_DELETED) -> Run:
    """Run the relay's workload in ``workdir`` (which must be empty or missing) under the recorder.

    ``min_deleted``: segments the checkpointer must have deleted before the run ends (a run of a
    dozen messages fills too few segments for any to be deleted: 0 for those).
    """
    os.makedirs(os.path.join(workdir, "spool"), mode=0o700, exist_ok=True)
    rio = WatchedFileIO(workdir)
    run = Run(seed, messages, rio.rec)
    t0 = time.monotonic()
    trio.run(_drive, workdir, Plan.make(seed, messages), run, rio, concurrency, min_deleted)
    run.seconds = time.monotonic() - t0
    if run.acked != messages:
        raise RuntimeError(f"only {run.acked} of {messages} messages were accepted in the recorded run")
    return run
