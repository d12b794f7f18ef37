"""Server-level SMTP fuzzing: hostile sessions against a running relay, which must keep serving everyone.

``python -m fault_injection smtpfuzz --minutes N [--seed S]`` (the long run;
``tests/relay/test_relay_fuzz.py`` runs a short one, driven by hypothesis, in
``make test``).

The core's fuzz tests (``tests/smtp/test_smtp_fuzz.py``) feed bytes to the sans-IO
server state machine. This harness fuzzes what surrounds it: the trio shell,
the policy, the spool, the scheduler and the delivery, over real TCP on
127.0.0.1, against a relay running in this process (``RelayThread``).

A *session* is a list of commands built from valid ones (``TEMPLATES``) whose
arguments are mutated (bytes inserted, replaced, deleted: every value
0x00-0xFF can land in every argument: addresses, ESMTP parameters, HELO/EHLO
names, VRFY/NOOP arguments) and DATA contents made of pieces that matter to
the end-of-data and smuggling rules plus random bytes. Its bytes go out in
random chunks, and it ends with QUIT, with EOF, or abruptly (close, or reset
with SO_LINGER 0) at a random chunk. A *batch* is a few sessions interleaved
chunk by chunk on their own connections.

What must hold, checked after every batch:

- every reply the relay sent is printable ASCII (no byte of the client's
  comes back raw), parses as SMTP, and a session that was not cut off got a
  220 greeting first and no truncated reply;
- the relay closes a session after the client's EOF (bounded wait);
- a fresh connection gets 220 and a well-formed message is delivered (the
  *probe*: into a Maildir, seen through the scheduler's outcome observer);
- the relay is still running (``crashes``), and it logged no error: a
  contained exception is still a bug, so ``contained`` must stay 0 too.

Choices come from a ``Chooser``: ``RandomChooser`` (seeded, for the long run)
or the test's hypothesis-backed one, so shrinking works on the same generator.
"""

from __future__ import annotations

import logging
import os
import pathlib
import random
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import trio

from mta.config import parse_config
from mta.process.relay import Relay
from mta.smtp.common import ReplyParser, SmtpProtocolError
from spool.format.record import Outcome, Status


class Chooser(Protocol):
    def integer(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        ...

    def binary(self, max_size: int) -> bytes:
        """Any bytes, at most ``max_size`` of them."""
        ...


class RandomChooser:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def binary(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_size))


def pick(ch: Chooser, items: Sequence[bytes]) -> bytes:
    return items[ch.integer(0, len(items) - 1)]


# (command as sent before its argument, a valid argument to mutate)
TEMPLATES: list[tuple[bytes, bytes]] = [
    (b"EHLO ", b"client.example"),
    (b"HELO ", b"client.example"),
    (b"MAIL FROM:", b"<sender@example.org>"),
    (b"MAIL FROM:", b"<sender@example.org> SIZE=1000 BODY=8BITMIME"),
    (b"MAIL FROM:", b"<> SMTPUTF8"),
    (b"MAIL FROM:", b'<"quoted local"@[192.0.2.1]>'),
    (b"RCPT TO:", b"<someone@far.example>"),
    (b"RCPT TO:", b"<postmaster>"),
    (b"RCPT TO:", b"<@hop.example:someone@far.example>"),
    (b"RCPT TO:", b"<someone@far.example> NOTIFY=NEVER"),
    (b"VRFY ", b"root"),
    (b"NOOP ", b"anything"),
    (b"HELP ", b"MAIL"),
    (b"RSET", b""),
    (b"STARTTLS", b""),
    (b"EXPN ", b"list"),
]
DATA_PIECES: list[bytes] = [
    b"Subject: fuzz\r\n", b"\r\n", b"body line\r\n", b".\r\n", b"..\r\n", b"\r\n.\r\n", b"\r\n\x00.\r\n",
    b"\n.\n", b"\r.\r", b"\r\n.\n", b"\n", b"\r", b"\x00", b".", b"x" * 1100, b"\xff\xfe",
    b"MAIL FROM:<smuggled@example.org>\r\nRCPT TO:<victim@far.example>\r\nDATA\r\n",
]


def mutate(ch: Chooser, arg: bytes) -> bytes:
    """``arg`` with a few bytes inserted, replaced or deleted (any value 0x00-0xFF), or left as it is."""
    out = bytearray(arg)
    for _ in range(ch.integer(0, 3)):
        op = ch.integer(0, 3)
        at = ch.integer(0, len(out))
        if op == 0:
            out[at:at] = bytes([ch.integer(0, 255)])
        elif op == 1:
            out[at:at] = ch.binary(8)
        elif op == 2 and at < len(out):
            out[at] = ch.integer(0, 255)
        elif op == 3:
            del out[at : at + ch.integer(1, 4)]
    return bytes(out)


def command(ch: Chooser) -> bytes:
    """One command line, or DATA with its content, or BDAT chunks, or raw junk."""
    kind = ch.integer(0, 10)
    if kind == 0:
        return ch.binary(40) + pick(ch, [b"\r\n", b"\n", b""])
    if kind == 1:
        return b"DATA\r\n" + data_content(ch)
    if kind == 2:
        return bdat_content(ch)
    prefix, arg = TEMPLATES[ch.integer(0, len(TEMPLATES) - 1)]
    line = prefix + mutate(ch, arg)
    if ch.integer(0, 15) == 0:
        line = mutate(ch, line)  # the verb and its colon too, now and then
    return line + (b"\r\n" if ch.integer(0, 19) else pick(ch, [b"\n", b"\r", b""]))


def data_content(ch: Chooser) -> bytes:
    parts = [pick(ch, DATA_PIECES) if ch.integer(0, 2) else ch.binary(24) for _ in range(ch.integer(0, 10))]
    if ch.integer(0, 4):
        parts.append(b"\r\n.\r\n")
    return b"".join(parts)


def bdat_content(ch: Chooser) -> bytes:
    """One to four BDAT commands with their chunks (RFC 3030): pieces of DATA's hostile content, a size that is
    now and then wrong (more or fewer octets than said), LAST on the last one mostly."""
    out = bytearray()
    count = ch.integer(1, 4)
    for i in range(count):
        chunk = b"".join(pick(ch, DATA_PIECES) if ch.integer(0, 2) else ch.binary(24) for _ in range(ch.integer(0, 5)))
        said = len(chunk) if ch.integer(0, 5) else max(0, len(chunk) + ch.integer(-8, 8))
        last = b" LAST" if i == count - 1 and ch.integer(0, 4) else b""
        out += b"BDAT %d%s\r\n" % (said, last) + chunk
    return bytes(out)


def bdat_session(ch: Chooser) -> Session:
    """A session that mostly gets as far as BDAT: a usual start, then chunks and commands between them."""
    wire = bytearray(b"EHLO fuzz.example\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<b@far.example>\r\n")
    for _ in range(ch.integer(1, 4)):
        wire += bdat_content(ch) if ch.integer(0, 2) else command(ch)
    chunks = split(ch, bytes(wire))
    end = ["quit", "eof", "close", "reset"][ch.integer(0, 3)]
    if end == "quit":
        chunks.append(b"QUIT\r\n")
    return Session(chunks, end, ch.integer(0, len(chunks)))


@attrs.define
class Session:
    chunks: list[bytes]
    end: str  # "quit", "eof", "close" (after chunk ``cut``) or "reset" (likewise, with RST)
    cut: int = 0


def session(ch: Chooser, max_commands: int = 12) -> Session:
    """A random session: a usual start now and then, mutated commands, random chunking, a way to end."""
    wire = bytearray()
    if ch.integer(0, 2):
        wire += b"EHLO fuzz.example\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<b@far.example>\r\n"[
            : ch.integer(0, 72)]
    for _ in range(ch.integer(1, max_commands)):
        wire += command(ch)
    chunks = split(ch, bytes(wire))
    end = ["quit", "eof", "close", "reset"][ch.integer(0, 3)]
    if end == "quit":
        chunks.append(b"QUIT\r\n")
    return Session(chunks, end, ch.integer(0, len(chunks)))


def split(ch: Chooser, wire: bytes) -> list[bytes]:
    """``wire`` in random pieces, at most 1, 3, 16, 256 or 64 Ki bytes each (chosen once per session)."""
    most = [1, 3, 16, 256, 65536][ch.integer(0, 4)]
    chunks, i = [], 0
    while i < len(wire):
        n = ch.integer(1, min(most, len(wire) - i))
        chunks.append(wire[i : i + n])
        i += n
    return chunks


def byte_sweep(value: int) -> Session:
    """One session with byte ``value`` near the start, in the middle and near the end of every template's
    argument (so in addresses and in ESMTP parameters), and in DATA content."""
    lines = [prefix + arg[:k] + bytes([value]) + arg[k:] + b"\r\n"
             for prefix, arg in TEMPLATES if arg for k in sorted({1, len(arg) // 2, len(arg) - 1})]
    valid = b"EHLO fuzz.example\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<b@far.example>\r\nDATA\r\n"
    content = b"Subject: sweep\r\n\r\nx" + bytes([value]) + b"y\r\n" + bytes([value]) + b".\r\n.\r\n"
    return Session([b"".join(lines), valid, content, b"QUIT\r\n"], "quit")


# ---------------------------------------------------------------- the relay under test


class RelayThread:
    """A relay in a thread of this process (its own trio run), with a Maildir route for probes.

    ``observe`` collects the outcomes the scheduler reports durable; ``errors``
    the log records of level ERROR and above from ``mta`` (contained failures).

    Resource handling: a context manager; leaving it cancels the relay's run
    and joins the thread.
    """

    def __init__(self, workdir: str, server_extra: str = "") -> None:
        self.workdir = workdir
        self.maildir = os.path.join(workdir, "probes")
        self.config = parse_config(f"""
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
max_errors = 50
{server_extra}
[spool]
dir = "spool"
retry_intervals = ["1h"]
commit_delay = "0s"
[routes]
"probe.test" = "maildir:probes"
"*" = "discard"
""", source=os.path.join(workdir, "fuzz.toml"), base_dir=workdir)
        self.port = 0
        self.proxy_port = 0  # the [proxy] listener's, if ``server_extra`` opened one
        self.crash: BaseException | None = None
        self.errors: list[logging.LogRecord] = []
        self._delivered: set[str] = set()
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._cancel: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=self._run, name="relay-under-fuzz", daemon=True)
        self._handler = _ListHandler(self.errors)

    def __enter__(self) -> RelayThread:
        logging.getLogger("mta").addHandler(self._handler)
        self._thread.start()
        if not self._ready.wait(60) or self.crash is not None or not self.port:
            raise RuntimeError(f"the relay did not start: {self.crash!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None and self._cancel is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(60)
        logging.getLogger("mta").removeHandler(self._handler)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # the relay ended by itself: that is the finding
            self.crash = exc
        finally:
            self._ready.set()
            with self._cond:
                self._cond.notify_all()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            self._token = trio.lowlevel.current_trio_token()
            relay: Relay = await nursery.start(Relay(self.config).run)
            relay.scheduler.observers.append(self._observe)
            self.port = relay.ports[0]
            assert relay.server is not None
            proxied = relay.server.proxy_listeners  # with a [proxy] section in ``server_extra``
            self.proxy_port = int(proxied[0].socket.getsockname()[1]) if proxied else 0
            self._ready.set()

    def _observe(self, qid: str, outcome: Outcome) -> None:
        if outcome.status is Status.DELIVERED:
            with self._cond:
                self._delivered.add(outcome.recipient)
                self._cond.notify_all()

    def alive(self) -> bool:
        return self._thread.is_alive() and self.crash is None

    def wait_delivered(self, recipient: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: recipient in self._delivered or not self.alive(), timeout) \
                and recipient in self._delivered


class _ListHandler(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


# ---------------------------------------------------------------- running sessions


@attrs.define
class Stats:
    batches: int = 0
    sessions: int = 0
    bytes_sent: int = 0
    replies: int = 0
    probes: int = 0
    problems: list[str] = attrs.field(factory=list)

    def line(self, seconds: float, relay: RelayThread) -> str:
        return (f"{self.batches} batches, {self.sessions} sessions, {self.bytes_sent} bytes sent, "
                f"{self.replies} replies, {self.probes} probes delivered, {seconds:.0f} s, "
                f"crashes={0 if relay.alive() else 1}, contained={len(relay.errors)}, "
                f"problems={len(self.problems)}")


@attrs.define(eq=False)
class _Conn:
    plan: Session
    sock: socket.socket
    got: bytearray = attrs.field(factory=bytearray)
    sent: int = 0
    open: bool = True  # we may still send
    cut: bool = False  # ended abruptly by us


def run_batch(port: int, sessions: list[Session], ch: Chooser, stats: Stats, timeout: float = 30) -> None:
    """Run ``sessions`` interleaved, chunk by chunk; check what came back. Problems go to ``stats``."""
    conns: list[_Conn] = []
    try:
        for s in sessions:
            # One at a time (no extend): those opened before a failure are in conns, for the finally to close.
            conns.append(_Conn(s, socket.create_connection(("127.0.0.1", port), timeout=timeout)))  # noqa: PERF401
    except OSError as exc:
        stats.problems.append(f"the relay does not take connections: {type(exc).__name__}: {exc}")
        for c in conns:
            c.sock.close()
        return
    try:
        while any(c.open for c in conns):
            c = [c for c in conns if c.open][ch.integer(0, sum(1 for c in conns if c.open) - 1)]
            _step(c, stats)
            for other in conns:
                _drain(other)
        deadline = time.monotonic() + timeout
        for c in conns:
            if not c.cut:
                _read_to_eof(c, deadline, stats)
            _check(c, stats)
    finally:
        for c in conns:
            c.sock.close()
    stats.batches += 1
    stats.sessions += len(sessions)


def _step(c: _Conn, stats: Stats) -> None:
    plan = c.plan
    if plan.end in ("close", "reset") and c.sent >= plan.cut:
        if plan.end == "reset":
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.sock.close()
        c.open, c.cut = False, True
        return
    if c.sent >= len(plan.chunks):
        if plan.end == "eof":
            _shutdown(c.sock)
        c.open = False
        return
    chunk = plan.chunks[c.sent]
    c.sent += 1
    try:
        c.sock.sendall(chunk)
        stats.bytes_sent += len(chunk)
    except OSError:  # the relay closed it (421 after too many errors): fine, read what it said
        c.open = False


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _drain(c: _Conn) -> None:
    """Take what has arrived, without waiting (a socket with a timeout would wait despite MSG_DONTWAIT)."""
    if c.cut:
        return
    timeout = c.sock.gettimeout()
    c.sock.setblocking(False)
    try:
        while data := c.sock.recv(65536):
            c.got += data
    except OSError:  # nothing more now (BlockingIOError), or reset
        pass
    finally:
        c.sock.settimeout(timeout)


def _read_to_eof(c: _Conn, deadline: float, stats: Stats) -> None:
    _shutdown(c.sock)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            stats.problems.append(f"the relay did not close a session after EOF; it sent {bytes(c.got[-200:])!r}")
            return
        c.sock.settimeout(left)
        try:
            data = c.sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return  # reset by the relay after its last reply: what it sent before is in c.got
        if not data:
            return
        c.got += data


def _check(c: _Conn, stats: Stats) -> None:
    raw = bytes(c.got)
    bad = [b for b in raw.replace(b"\r\n", b"") if not 0x20 <= b <= 0x7E]
    if bad:
        stats.problems.append(f"a reply holds a byte that is not printable ASCII ({bad[0]:#04x}): {raw[-300:]!r}")
        return
    parser = ReplyParser()
    try:
        replies = parser.feed(raw)
    except SmtpProtocolError as exc:
        stats.problems.append(f"the relay sent something that is not an SMTP reply ({exc}): {raw[-300:]!r}")
        return
    stats.replies += len(replies)
    if c.cut:
        return
    if not replies or replies[0].code != 220:
        stats.problems.append(f"no 220 greeting first: {raw[:200]!r}")
    elif parser.pending:
        stats.problems.append(f"a truncated reply at the end: {raw[-200:]!r}")


def probe(relay: RelayThread, n: int, stats: Stats, timeout: float = 30, *, bdat: bool = False) -> None:
    """A fresh client gets 220 and its well-formed message is delivered into the probe Maildir (sent with
    DATA, or with ``bdat`` in one BDAT LAST chunk)."""
    rcpt = f"probe{n}@probe.test"
    token = f"probe {n} {os.urandom(4).hex()}"
    try:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=timeout) as sock:
            f = sock.makefile("rb")
            greeting = f.readline()
            if not greeting.startswith(b"220 "):
                stats.problems.append(f"probe {n}: greeting {greeting!r}")
                return
            sock.sendall(b"EHLO probe.example\r\nMAIL FROM:<probe@example.org>\r\nRCPT TO:<%s>\r\n%s"
                         % (rcpt.encode(), b"" if bdat else b"DATA\r\n"))
            for want in (b"250 ", b"250 ", b"250 ", *(() if bdat else (b"354 ",))):
                line = f.readline()
                while line[3:4] == b"-":
                    line = f.readline()
                if not line.startswith(want):
                    stats.problems.append(f"probe {n}: wanted {want!r}, got {line!r}")
                    return
            message = f"Subject: {token}\r\nFrom: probe@example.org\r\n\r\n{token}\r\n".encode()
            sock.sendall((b"BDAT %d LAST\r\n" % len(message) + message if bdat else message + b".\r\n")
                         + b"QUIT\r\n")
            line = f.readline()
            if not line.startswith(b"250 2.0.0"):
                stats.problems.append(f"probe {n}: end of data answered {line!r}")
                return
    except OSError as exc:
        stats.problems.append(f"probe {n}: {type(exc).__name__}: {exc} (relay alive: {relay.alive()})")
        return
    if not relay.wait_delivered(rcpt, timeout):
        stats.problems.append(f"probe {n}: not delivered within {timeout} s (relay alive: {relay.alive()})")
        return
    box = os.path.join(relay.maildir, f"probe{n}", "new")
    names = os.listdir(box)
    if len(names) != 1 or token.encode() not in pathlib.Path(box, names[0]).read_bytes():
        stats.problems.append(f"probe {n}: the delivered file is not the message sent: {names}")
        return
    stats.probes += 1


def batch(ch: Chooser, max_sessions: int = 4) -> list[Session]:
    return [session(ch) for _ in range(ch.integer(1, max_sessions))]


def run(minutes: float, seed: int, progress: Callable[[str], None] = print) -> tuple[Stats, bool]:
    """The long run: random batches for ``minutes`` (after a full byte sweep), a probe after each."""
    stats = Stats()
    ch = RandomChooser(seed)
    t0 = time.monotonic()
    last = t0
    with tempfile.TemporaryDirectory(prefix="smtpfuzz-") as work, RelayThread(work) as relay:
        for value in range(256):
            if stats.problems:
                break
            run_batch(relay.port, [byte_sweep(value)], ch, stats)
            if value % 32 == 31:
                probe(relay, stats.batches, stats)
        while time.monotonic() - t0 < minutes * 60 and relay.alive() and not stats.problems:
            run_batch(relay.port, batch(ch, 6), ch, stats)
            probe(relay, stats.batches, stats)
            if time.monotonic() - last >= 30:
                last = time.monotonic()
                progress(f"smtpfuzz: {stats.line(last - t0, relay)}")
        ok = relay.alive() and not stats.problems and not relay.errors
        progress(f"smtpfuzz seed={seed}: {stats.line(time.monotonic() - t0, relay)}")
        for p in stats.problems[:10]:
            progress(f"  {p}")
        for r in relay.errors[:5]:
            progress(f"  logged: {r.getMessage()}")
        if relay.crash is not None:
            progress(f"  the relay ended: {relay.crash!r}")
    return stats, ok
