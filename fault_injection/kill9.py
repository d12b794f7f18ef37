"""Real crashes: SIGKILL a process that runs the spool under load, restart it, and check the ledger.

``python -m fault_injection kill9 --cycles N [--messages M] [--concurrency C] [--seed S]``

Each cycle starts the subject, submits up to M new messages keeping C
unacknowledged at a time, and sends SIGKILL at a seeded random moment: after a
random number of events (acknowledgements and recorded deliveries) or at a
random deadline, whichever comes first; one cycle in ten is killed before it
reports ready (a kill during recovery). Deadlines are the fault, never a
synchronisation: the harness only ever waits on the subject's output.

At the end it restarts the subject once more, asks it to drain, and reads the
next hop. It prints one line: cycles, messages acknowledged, delivered (every
recipient reached the next hop), lost (an acknowledged message with a
recipient that never arrived), duplicated (next-hop deliveries beyond the
first for a recipient). Also checked: nothing arrived that was never
submitted, every body arrived intact (CRC-32), and no duplicate arrived after
its DELIVERY record was durable (the only allowed window is the next hop's 250
to our fsync).

``Subject`` is all the harness needs. ``SpoolWorker`` drives
``fault_injection.kill9_worker`` over a Unix socket; with ``--relay``,
``fault_injection.relay_subject.RelaySubject`` runs the real relay
(``mta serve``) with a recording SMTP next hop and submits over SMTP, a 250
after DATA being the ``ack``. The relay's next hop also refuses a few
recipients for good: those are *bounced*, and count as accounted for once
the DSN for them reaches the sender (whose domain routes to the same next
hop). A bounce, like a delivery, may arrive twice only inside the window
between the next hop's 250 and the relay's fsync of its DELIVERY record.
"""

from __future__ import annotations

import collections
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Protocol

import attrs

from fault_injection import scratch_dir
from fault_injection.kill9_worker import body_for

READY_TIMEOUT = 60.0
DRAIN_TIMEOUT = 180.0


class Subject(Protocol):
    """What the kill9 harness drives: the spool worker, or the SMTP relay (``relay_subject.RelaySubject``)."""

    early_window: float
    """Seconds after ``start`` in which an early kill lands (during startup and recovery)."""
    @property
    def load_window(self) -> float:
        """A kill under load comes at most this long after ``ready``."""
    ready_timeout: float
    """How long a start may take before the harness calls it a failure (a bound, never a wait)."""
    drain_timeout: float
    """How long the final drain may take after the start (a bound)."""

    def start(self) -> None: ...

    def submit(self, n: int, rcpts: list[str], body_len: int) -> None:
        """Send message ``n``; an ``ack n ...`` event comes back once it is accepted (250)."""

    def events(self, timeout: float) -> list[str]:
        """Lines the subject reported (``ready``, ``ack N ID``, ``nack N``, ``rec N RCPT``, ``brec N RCPT``,
        ``drained``, ``exited``), waiting at most ``timeout`` seconds for the first.

        ``rec``/``brec``: the delivery (bounce) of N to RCPT is recorded durably; ``nack``: N was not accepted.
        """

    def request_drain(self) -> None: ...

    def kill(self) -> int:
        """SIGKILL and reap; returns the exit status (negative signal number when killed)."""

    def alive(self) -> bool: ...

    def next_hop_size(self) -> int: ...

    def next_hop_lines(self) -> list[tuple[int, int, str, str]]:
        """(offset, message number, recipient, body crc) for every message received by the next hop."""

    def next_hop_bounces(self) -> list[tuple[int, int, str]]:
        """(offset, message number, recipient) for every DSN that reported a recipient of ours failed."""

    def body(self, n: int, length: int) -> bytes:
        """The bytes whose CRC-32 the next hop reports for message ``n``."""

    def sink_problems(self) -> list[str]:
        """What the next hop found wrong on its own (a message it could not place, a bounce it never caused)."""

    def stderr_tail(self) -> str: ...

    def close(self) -> None: ...


class SpoolWorker:
    """The spool worker, forked by a zygote (see ``fault_injection.kill9_worker``), over a Unix socket."""

    early_window = 0.4
    load_window = 0.8
    ready_timeout = READY_TIMEOUT
    drain_timeout = DRAIN_TIMEOUT

    def __init__(self, workdir: str, seed: int) -> None:
        self.spool_dir = os.path.join(workdir, "spool")
        self.hop = os.path.join(workdir, "next-hop")
        self.seed = seed
        self.sock_path = os.path.join(workdir, "zygote.sock")
        self.stderr_path = os.path.join(workdir, "worker.stderr")
        self.sock: socket.socket | None = None
        self.pid = -1
        self.pidfd = -1
        self.buf = b""
        self.starts = 0
        with open(self.stderr_path, "ab") as err:
            self.zygote = subprocess.Popen([sys.executable, "-m", "fault_injection.kill9_worker", "--zygote",
                                            self.sock_path], stdout=subprocess.PIPE, stderr=err)
        assert self.zygote.stdout is not None
        ready, _, _ = select.select([self.zygote.stdout], [], [], READY_TIMEOUT)
        if not ready or self.zygote.stdout.readline().strip() != b"zygote ready":
            self.close()
            raise RuntimeError(f"the kill9 zygote did not start: {self.stderr_tail()}")

    def close(self) -> None:
        self.zygote.kill()
        self.zygote.wait()
        if self.zygote.stdout is not None:
            self.zygote.stdout.close()

    def start(self) -> None:
        self.starts += 1
        self.buf = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.sock_path)
        self.sock.sendall(f"start {self.spool_dir} {self.hop} {self.seed * 100_003 + self.starts}\n".encode())
        self.sock.setblocking(False)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and b"\n" not in self.buf:
            if not self._fill(deadline - time.monotonic()):
                break
        line, _, self.buf = self.buf.partition(b"\n")
        words = line.split()
        if len(words) != 2 or words[0] != b"pid":
            raise RuntimeError(f"the worker did not report its pid: {line!r} {self.stderr_tail()}")
        self.pid = int(words[1])
        self.pidfd = os.pidfd_open(self.pid)

    def _fill(self, timeout: float) -> bool:
        """Read what the worker sent; False at end of stream."""
        assert self.sock is not None
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not ready:
            return True
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return True
        except ConnectionResetError:
            data = b""
        self.buf += data
        return bool(data)

    def _send(self, line: str) -> None:
        assert self.sock is not None
        try:
            self.sock.setblocking(True)
            self.sock.sendall(line.encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died; the caller finds out from events() and kill()
        finally:
            self.sock.setblocking(False)

    def submit(self, n: int, rcpts: list[str], body_len: int) -> None:
        self._send(f"msg {n} {','.join(rcpts)} {body_len}")

    def request_drain(self) -> None:
        self._send("drain")

    def events(self, timeout: float) -> list[str]:
        open_ = self._fill(timeout) if self.sock is not None else True
        lines = self.buf.split(b"\n")
        self.buf = lines.pop()
        out = [ln.decode() for ln in lines if ln]
        return out if open_ else [*out, "exited"]

    def alive(self) -> bool:
        return self.pidfd >= 0 and not select.select([self.pidfd], [], [], 0)[0]

    def kill(self) -> int:
        """SIGKILL, then wait (on the pidfd) until the process is gone and its lock released."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        ready, _, _ = select.select([self.pidfd], [], [], READY_TIMEOUT)
        os.close(self.pidfd)
        self.pidfd = -1
        if self.sock is not None:
            try:  # what it said before it died is true (an ack is an ack): keep it for events()
                while data := self.sock.recv(65536):
                    self.buf += data
            except OSError:
                pass  # nothing more (BlockingIOError), or reset
            self.sock.close()
            self.sock = None
        if not ready:
            raise RuntimeError(f"worker {self.pid} did not die after SIGKILL")
        return -signal.SIGKILL

    def next_hop_size(self) -> int:
        try:
            return os.path.getsize(self.hop)
        except FileNotFoundError:
            return 0

    def next_hop_lines(self) -> list[tuple[int, int, str, str]]:
        if not os.path.exists(self.hop):
            return []
        out = []
        off = 0
        with open(self.hop, "rb") as fh:
            for raw in fh:
                if raw.endswith(b"\n"):
                    n, rcpt, crc = raw.decode().split()
                    out.append((off, int(n), rcpt, crc))
                off += len(raw)
        return out

    def next_hop_bounces(self) -> list[tuple[int, int, str]]:
        return []  # the worker's next hop accepts everything

    def body(self, n: int, length: int) -> bytes:
        return body_for(n, length)

    def sink_problems(self) -> list[str]:
        return []

    def stderr_tail(self) -> str:
        with open(self.stderr_path, "rb") as fh:
            return fh.read()[-2000:].decode(errors="replace")


@attrs.define
class Summary:
    cycles: int = 0
    acknowledged: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    bounced: int = 0
    relay: bool = False
    problems: list[str] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and not self.problems

    def line(self) -> str:
        """One line; with the relay, also ``bounced`` (messages accounted for by a DSN for some recipient)."""
        return (f"kill9{' --relay' if self.relay else ''}: cycles {self.cycles}, messages acknowledged "
                f"{self.acknowledged}, delivered {self.delivered}, "
                + (f"bounced {self.bounced}, " if self.relay else "")
                + f"lost {self.lost}, duplicated {self.duplicated}")


@attrs.define
class Ledger:
    sent: dict[int, tuple[list[str], int]] = attrs.field(factory=dict)
    acked: set[int] = attrs.field(factory=set)
    recorded_at: dict[tuple[int, str], int] = attrs.field(factory=dict)  # next-hop size when "rec" was seen
    bounce_recorded_at: dict[tuple[int, str], int] = attrs.field(factory=dict)  # ... when "brec" was seen

    def note(self, subject: Subject, words: list[str]) -> None:
        """Remember when a delivery (``rec``) or a bounce's DSN delivery (``brec``) was durably recorded."""
        where = self.recorded_at if words[0] == "rec" else self.bounce_recorded_at
        where.setdefault((int(words[1]), words[2]), subject.next_hop_size())


def _cycle(subject: Subject, rng: random.Random, led: Ledger, next_n: int, messages: int, concurrency: int,
           problems: list[str]) -> int:
    """One start-load-kill cycle; returns the next message number."""
    subject.start()
    t0 = time.monotonic()
    early = rng.random() < 0.1
    deadline = t0 + (rng.uniform(0.0, subject.early_window) if early else subject.ready_timeout)
    kill_after = rng.randint(1, 3 * messages)
    ready = False
    seen = 0
    to_send = messages
    outstanding: set[int] = set()
    while time.monotonic() < deadline:
        for ev in subject.events(deadline - time.monotonic()):
            words = ev.split()
            if words[0] == "ready" and not ready:
                ready = True
                deadline = time.monotonic() + rng.uniform(0.0, subject.load_window)
            elif words[0] == "ack":
                n = int(words[1])
                led.acked.add(n)
                outstanding.discard(n)
                seen += 1
            elif words[0] == "nack":
                outstanding.discard(int(words[1]))
            elif words[0] in ("rec", "brec"):
                led.note(subject, words)
                seen += 1
            elif words[0] == "exited":
                problems.append(f"the subject exited on its own (start {next_n})")
                deadline = 0
        if ready:
            while to_send and len(outstanding) < concurrency:
                rcpts = [f"r{i}@d{rng.randrange(4)}.example" for i in range(rng.randint(1, 3))]
                length = rng.choice((40, 300, 2000, 9000))
                led.sent[next_n] = (rcpts, length)
                subject.submit(next_n, rcpts, length)
                outstanding.add(next_n)
                next_n += 1
                to_send -= 1
        if seen >= kill_after:
            break
    if not ready and not early:
        problems.append("the subject never became ready")
    subject.kill()
    _late_events(subject, led)
    return next_n


def _late_events(subject: Subject, led: Ledger) -> None:
    """Acks and records the subject reported before the kill that the harness had not read yet: facts all the same."""
    for ev in subject.events(0):
        words = ev.split()
        if words[0] == "ack":
            led.acked.add(int(words[1]))
        elif words[0] in ("rec", "brec"):
            led.note(subject, words)


def _drain(subject: Subject, led: Ledger, problems: list[str]) -> None:
    subject.start()
    deadline = time.monotonic() + subject.ready_timeout + subject.drain_timeout
    asked = False
    while time.monotonic() < deadline:
        evs = subject.events(deadline - time.monotonic())
        for ev in evs:
            words = ev.split()
            if words[0] == "ready" and not asked:
                subject.request_drain()
                asked = True
            elif words[0] == "ack":  # late, from the last cycle's relay
                led.acked.add(int(words[1]))
            elif words[0] in ("rec", "brec"):
                led.note(subject, words)
            elif words[0] == "drained":
                subject.kill()
                return
            elif words[0] == "exited":
                problems.append("the subject exited while draining")
                subject.kill()
                return
    problems.append(f"the queue did not drain within {subject.drain_timeout:.0f}s (after the start)")
    subject.kill()


def _score(subject: Subject, led: Ledger, summary: Summary) -> None:
    """Every acknowledged recipient arrived or was bounced; nothing unsent arrived; duplicates only in the window.

    A duplicate is a second (third, ...) arrival of the same (message, recipient)
    at the next hop, or of the same bounce in DSNs. It is allowed only if it
    arrived before the harness saw the durable record of that delivery: the
    next-hop size taken when the ``rec``/``brec`` event was read is at or past
    the size at the fsync, so an arrival at or beyond it surely came after.
    """
    counts: collections.Counter[tuple[int, str]] = collections.Counter()
    for off, n, rcpt, crc in subject.next_hop_lines():
        counts[(n, rcpt)] += 1
        sent = led.sent.get(n)
        if sent is None or rcpt not in sent[0]:
            summary.problems.append(f"next hop received message {n} for {rcpt}, which was never sent")
            continue
        if crc != f"{zlib.crc32(subject.body(n, sent[1])):08x}":
            summary.problems.append(f"message {n} arrived with a damaged body")
        rec = led.recorded_at.get((n, rcpt))
        if rec is not None and off >= rec:
            summary.problems.append(f"message {n} for {rcpt} was delivered again after its delivery was recorded")
    bounces: collections.Counter[tuple[int, str]] = collections.Counter()
    for off, n, rcpt in subject.next_hop_bounces():
        bounces[(n, rcpt)] += 1
        sent = led.sent.get(n)
        if sent is None or rcpt not in sent[0]:
            summary.problems.append(f"a DSN reported message {n} for {rcpt} failed, which was never sent")
            continue
        if counts[(n, rcpt)]:
            summary.problems.append(f"message {n} for {rcpt} was both delivered and bounced")
        rec = led.bounce_recorded_at.get((n, rcpt))
        if rec is not None and off >= rec:
            summary.problems.append(f"the bounce of message {n} for {rcpt} arrived again after its DSN was recorded")
    summary.problems += subject.sink_problems()
    summary.duplicated = sum(c - 1 for c in counts.values() if c > 1) + sum(c - 1 for c in bounces.values() if c > 1)
    summary.acknowledged = len(led.acked)
    for n in sorted(led.acked):
        rcpts = led.sent[n][0]
        if all(counts[(n, r)] for r in rcpts):
            summary.delivered += 1
        elif all(counts[(n, r)] or bounces[(n, r)] for r in rcpts):
            summary.bounced += 1
        else:
            summary.lost += 1
            summary.problems.append(f"acknowledged message {n} was lost "
                                    f"(missing {[r for r in rcpts if not counts[(n, r)] and not bounces[(n, r)]]})")


def run(*, cycles: int, messages: int = 0, concurrency: int = 8, seed: int = 0, relay: bool = False,
        workdir: str | None = None, max_seconds: float | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
        progress: Callable[[str], None] = lambda _line: None) -> Summary:
    """``cycles`` start-load-kill cycles, then drain and score.

    Fewer cycles if ``max_seconds`` runs out or ``stop_requested()`` turns
    true first: a long run on a slow machine can then still end with a
    drained, scored ledger instead of being killed and telling nothing.
    ``progress`` gets a line every 25 cycles.
    """
    messages = messages or 20
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="logspool-kill9-", dir=scratch_dir())
    summary = Summary(relay=relay)
    try:
        subject: Subject
        if relay:
            from fault_injection.relay_subject import RelaySubject

            subject = RelaySubject(workdir, seed, concurrency)
        else:
            subject = SpoolWorker(workdir, seed)
        try:
            rng = random.Random(seed)
            led = Ledger()
            n = 1
            t0 = time.monotonic()
            for _ in range(cycles):
                if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                    break
                if stop_requested():
                    break
                n = _cycle(subject, rng, led, n, messages, concurrency, summary.problems)
                summary.cycles += 1
                if summary.cycles % 25 == 0:
                    progress(f"kill9: {summary.cycles}/{cycles} cycles, {len(led.acked)} acknowledged, "
                             f"{(time.monotonic() - t0) / 60:.1f} min")
            _drain(subject, led, summary.problems)
            _score(subject, led, summary)
            if summary.problems:
                summary.problems.append(f"subject stderr (tail): {subject.stderr_tail()}")
        finally:
            subject.close()
    finally:
        if own and summary.ok:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not summary.ok:
            summary.problems.append(f"work directory kept for inspection: {workdir}")
    return summary
