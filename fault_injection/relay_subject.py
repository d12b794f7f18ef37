"""The kill9 subject for the real relay: ``mta serve`` as a child process, a recording next hop, SMTP clients.

``python -m fault_injection kill9 --relay`` drives this instead of the spool
worker. The pieces, all in the harness process except the relay:

- ``Sink``, the next hop: a threaded SMTP server on 127.0.0.1 built on the
  project's sans-IO server core. It answers each RCPT with 250, or (seeded
  per message, recipient and attempt) 451 to make deferrals happen, or 550
  for a fixed few recipients to make bounces happen; a few whole messages
  get 451 after their data. It records every message it accepts *before* it
  answers 250 (as a real MTA commits before its 250): message number (the
  ``X-Kill9-N`` header the client puts in), each recipient, and the CRC-32
  of the bytes after that header. A message from the null sender is a DSN:
  it is recorded as a bounce of each ``Final-Recipient`` of the message
  named in its returned headers. Senders are ``sN@senders.example`` and
  ``"*"`` routes every domain to the sink, so DSNs land there too.
- The relay: ``mta serve --config FILE`` with its spool in the work
  directory, 16 KiB segments (so garbage segments are deleted all the time),
  1-second retry intervals, and listening on a port the OS picks (read from
  its "listening on" log line, which is also when it is ``ready``).
- Clients: ``concurrency`` threads with ``smtplib``, each sending one
  message at a time; a ``250`` after DATA is an ``ack``.
- The relay's stderr, read line by line: the delivery log line
  (``event=delivery qid=QID to=<R> ... status=sent``) is written after the DELIVERY record
  is durable, so it is the ``rec`` event that closes the duplicate window.

Waits are on the relay's output, the queue's content, or threads ending;
the only timers are bounds.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import random
import re
import signal
import smtplib
import socket
import socketserver
import subprocess
import sys
import threading
import time
import zlib

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
    StartTls,
)

READY_TIMEOUT = 300.0  # a bound: on a 2-core machine at load 20 a relay took over 60 s to start
DRAIN_TIMEOUT = 600.0  # a bound: at load 25 one drain delivered 250 messages in about 3 minutes
DRAIN_POLL = 0.25  # between queue counts while draining: a polling period, bounded by DRAIN_TIMEOUT

SENDER_DOMAIN = "senders.example"
N_HEADER = b"X-Kill9-N: "
SENDER_RE = re.compile(r"^s(\d+)@" + re.escape(SENDER_DOMAIN) + r"$")
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
ACCEPTED = re.compile(r" event=accepted qid=([0-9A-F]+) from=<([^>]*)> size=")
DELIVERED = re.compile(r" event=delivery qid=([0-9A-F]+) to=<([^>]*)> relay=.* status=sent ")
FINAL_RCPT = re.compile(rb"^Final-Recipient:\s*rfc822;\s*(\S+?)\s*$", re.MULTILINE | re.IGNORECASE)
QUEUED_AS = re.compile(rb"queued as ([0-9A-F]+)")


def sender_of(n: int) -> str:
    return f"s{n}@{SENDER_DOMAIN}"


def relay_body(n: int, length: int) -> bytes:
    """What follows the ``X-Kill9-N`` header of message ``n``: headers and a body of about ``length`` bytes.

    Lines of 78 characters: the relay refuses lines over 1000 octets (RFC 5321).
    """
    head = f"Subject: message {n}\r\nMessage-ID: <kill9-{n}@client.example>\r\n\r\n".encode()
    lines = []
    size = len(head)
    while size < length:
        line = (f"{n:08d}" * 10)[:78].encode() + b"\r\n"
        lines.append(line)
        size += len(line)
    return head + b"".join(lines)


def _draw(seed: int, *key: object) -> float:
    """A seeded draw that depends only on its key, whatever the order the threads ask in."""
    return random.Random(f"{seed}:{':'.join(map(str, key))}").random()


def _number(data: bytes) -> tuple[int, int]:
    """The message number in the first ``X-Kill9-N`` header line, and where that line ends; (-1, -1) if none."""
    at = 0 if data.startswith(N_HEADER) else data.find(b"\n" + N_HEADER) + 1
    if at <= 0 and not data.startswith(N_HEADER):
        return -1, -1
    end = data.find(b"\r\n", at)
    try:
        return (int(data[at + len(N_HEADER):end]), end) if end >= 0 else (-1, -1)
    except ValueError:
        return -1, -1


class Sink:
    """The recording next hop. Entries are appended in arrival order; an entry's index is its offset."""

    DEFER_FIRST = 0.2   # 451 at RCPT on a recipient's first attempt
    DEFER_LATER = 0.05  # ... and on later attempts
    REFUSE = 0.03       # 550 at RCPT, always, for this (message, recipient)
    DEFER_DATA = 0.04   # 451 after the data of a transaction (not recorded)

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.lock = threading.Lock()
        # (kind, n, rcpt, crc, arrival): kind "msg" (crc of the bytes after X-Kill9-N) or "dsn" (crc "")
        self.entries: list[tuple[str, int, str, str, int]] = []
        self.arrivals = 0
        self.attempts: collections.Counter[tuple[int, str]] = collections.Counter()
        self.refused: set[tuple[int, str]] = set()
        self.transactions = 0
        self.problems: list[str] = []
        self.draining = False
        sink = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sink.serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128  # the default 5 drops SYNs when the accept thread is slow: connect timeouts

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="kill9-sink", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def size(self) -> int:
        with self.lock:
            return len(self.entries)

    def rcpt_reply(self, sender: str, rcpt: str) -> Reply | None:
        """None to accept; else the refusal. Permanent refusals never hit a DSN (it would be dropped)."""
        if sender:
            m = SENDER_RE.match(sender)
            key = (int(m.group(1)) if m else -1, rcpt)
            if _draw(self.seed, "refuse", *key) < self.REFUSE:
                with self.lock:
                    self.refused.add(key)
                return Reply(550, "5.1.1", "no such user here (kill9 sink)")
        else:
            m = SENDER_RE.match(rcpt)
            key = (int(m.group(1)) if m else -1, rcpt)
        with self.lock:
            tries = self.attempts[key]
            self.attempts[key] += 1
        p = self.DEFER_FIRST if tries == 0 else self.DEFER_LATER
        if not self.draining and _draw(self.seed, "defer", *key, tries) < p:
            return Reply(451, "4.3.0", "try again later (kill9 sink)")
        return None

    def end_of_data(self, sender: str, rcpts: list[str], data: bytes) -> Reply | None:
        """Record an accepted message (before the 250 goes out); or refuse it whole with a 451."""
        with self.lock:
            self.transactions += 1
            t = self.transactions
        if not self.draining and _draw(self.seed, "data", t) < self.DEFER_DATA:
            return Reply(451, "4.3.0", "could not store it, try again (kill9 sink)")
        if sender:
            n, end = _number(data)
            if n < 0:
                with self.lock:
                    self.problems.append(f"the next hop received a message without {N_HEADER!r} from <{sender}>")
                return None
            crc = f"{zlib.crc32(data[end + 2:]):08x}"
            with self.lock:
                self.arrivals += 1
                self.entries += [("msg", n, r, crc, self.arrivals) for r in rcpts]
            return None
        self._record_dsn(rcpts, data)
        return None

    def _record_dsn(self, rcpts: list[str], data: bytes) -> None:
        m = SENDER_RE.match(rcpts[0]) if len(rcpts) == 1 else None
        n, _ = _number(data)
        finals = [f.decode("utf-8", "replace") for f in FINAL_RCPT.findall(data)]
        with self.lock:
            if m is None or n < 0 or int(m.group(1)) != n or not finals:
                self.problems.append(f"the next hop received a DSN it cannot place: to {rcpts}, "
                                     f"message {n}, final recipients {finals}")
                return
            self.arrivals += 1
            self.entries += [("dsn", n, r, "", self.arrivals) for r in finals]

    def serve(self, sock: socket.socket) -> None:
        conn = ServerConnection("sink.kill9.test")
        sender, rcpts, data = "", list[str](), bytearray()
        try:
            while True:
                out = conn.data_to_send()
                if out:
                    sock.sendall(out)
                ev = conn.next_event()
                if isinstance(ev, NeedData):
                    # The core may have queued a reply while returning NeedData (554 to a DATA that
                    # has no recipient): send it before reading, or client and sink wait on each other.
                    out = conn.data_to_send()
                    if out:
                        sock.sendall(out)
                    conn.receive_data(sock.recv(65536))
                elif isinstance(ev, MailFrom):
                    sender, rcpts, data = ev.address, [], bytearray()
                    conn.accept()
                elif isinstance(ev, RcptTo):
                    refusal = self.rcpt_reply(sender, ev.address)
                    if refusal is None:
                        rcpts.append(ev.address)
                        conn.accept()
                    else:
                        conn.reject(refusal)
                elif isinstance(ev, DataChunk):
                    data += ev.data
                elif isinstance(ev, EndOfData):
                    refusal = self.end_of_data(sender, rcpts, bytes(data))
                    if refusal is None:
                        conn.accept()
                    else:
                        conn.reject(refusal)
                elif isinstance(ev, StartTls):
                    conn.reject(Reply(454, "4.7.0", "no TLS here"))
                elif isinstance(ev, DataAborted):
                    data = bytearray()
                elif isinstance(ev, (Quit, ConnectionClosed)):
                    out = conn.data_to_send()
                    if out:
                        sock.sendall(out)
                    return
        except OSError:
            return  # the relay was killed mid-session

    def dsn_rcpt_sets(self, n: int) -> set[frozenset[str]]:
        """The distinct recipient sets of the DSNs for message ``n`` that arrived so far."""
        groups: dict[int, set[str]] = {}
        with self.lock:
            for kind, m, r, _, arrival in self.entries:
                if kind == "dsn" and m == n:
                    groups.setdefault(arrival, set()).add(r)
        return {frozenset(g) for g in groups.values()}


CONFIG = """\
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.kill9.test"
[spool]
dir = "spool"
segment_size = "16k"
retry_intervals = ["1s", "1s"]
queue_minfree = "1MB"
checkpoint_interval = "200ms"
checkpoint_bytes = 0
in_doubt = "redeliver"  # the harness counts the duplicates of redelivery; no operator releases held mail
[delivery]
concurrency = 8
per_destination = 8
max_messages_per_connection = 10
connect_timeout = "60s"
[routes]
"*" = "smtp://127.0.0.1:{port}?tls=none"
"""


class RelaySubject:
    """The real relay under kill -9 (see the module docstring); implements ``kill9.Subject``."""

    def __init__(self, workdir: str, seed: int, concurrency: int) -> None:
        self.workdir = workdir
        self.seed = seed
        self.sink = Sink(seed)
        self.config = os.path.join(workdir, "relay.toml")
        with open(self.config, "w") as fh:
            fh.write(CONFIG.format(port=self.sink.port))
        self.control = os.path.join(workdir, "spool", "control.sock")
        self.log_path = os.path.join(workdir, "relay.log")
        self.mta = os.path.join(os.path.dirname(sys.executable), "mta")
        self.events_q: queue.Queue[tuple[int, str]] = queue.Queue()
        self.jobs: queue.Queue[tuple[int, int, list[str], int] | None] = queue.Queue()
        self.life = 0
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None
        self.qid_n: dict[str, int] = {}
        self.started_at = 0.0
        self.early_window = 3.0   # updated to the last start-to-ready time: a kill in it hits startup/recovery
        self.ready_timeout = READY_TIMEOUT
        self.drain_timeout = DRAIN_TIMEOUT
        self.refusals: list[str] = []  # what the relay refused, when it was alive to answer
        self.clients = [threading.Thread(target=self._client, name=f"kill9-client-{i}", daemon=True)
                        for i in range(concurrency)]
        for t in self.clients:
            t.start()

    # -- kill9.Subject ---------------------------------------------------------

    @property
    def load_window(self) -> float:
        """2 s, or a quarter of the last start time if longer: on a slow machine deliveries take longer too,
        and a life must last long enough for some to complete (and be recorded) before the kill."""
        return max(2.0, self.early_window / 4)

    def start(self) -> None:
        self.life += 1
        self.port = 0
        while True:  # jobs of the last life that no client took: never sent
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                break
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"=== life {self.life} {time.strftime('%H:%M:%S')}\n".encode())
        self.proc = subprocess.Popen([self.mta, "serve", "--config", self.config], cwd=self.workdir,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.reader = threading.Thread(target=self._read_stderr, args=(self.proc, self.life), daemon=True)
        self.reader.start()

    def submit(self, n: int, rcpts: list[str], body_len: int) -> None:
        self.jobs.put((self.life, n, rcpts, body_len))

    def events(self, timeout: float) -> list[str]:
        out: list[tuple[int, str]] = []
        try:
            out.append(self.events_q.get(timeout=max(0.0, timeout)))
            while True:
                out.append(self.events_q.get_nowait())
        except queue.Empty:
            pass
        # acks and delivery records of an earlier life are facts; its ready/exited/drained are not news
        return [ev for life, ev in out if life == self.life or ev.split()[0] in ("ack", "rec", "brec", "nack")]

    def request_drain(self) -> None:
        self.sink.draining = True
        threading.Thread(target=self._watch_drain, args=(self.life,), daemon=True).start()

    def kill(self) -> int:
        assert self.proc is not None
        try:
            self.proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            status = self.proc.wait(timeout=READY_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"relay {self.proc.pid} did not die after SIGKILL") from None
        if self.reader is not None:
            self.reader.join(READY_TIMEOUT)  # its pipe is at EOF once the relay is gone
        return status

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def next_hop_size(self) -> int:
        return self.sink.size()

    def next_hop_lines(self) -> list[tuple[int, int, str, str]]:
        with self.sink.lock:
            return [(i, n, r, crc) for i, (kind, n, r, crc, _) in enumerate(self.sink.entries) if kind == "msg"]

    def next_hop_bounces(self) -> list[tuple[int, int, str]]:
        with self.sink.lock:
            return [(i, n, r) for i, (kind, n, r, _, _) in enumerate(self.sink.entries) if kind == "dsn"]

    def body(self, n: int, length: int) -> bytes:
        return relay_body(n, length)

    def sink_problems(self) -> list[str]:
        with self.sink.lock:
            out = list(self.sink.problems)
            refused = set(self.sink.refused)
            bounced = {(n, r) for kind, n, r, _, _ in self.sink.entries if kind == "dsn"}
        out += [f"message {n} was bounced for {r}, which the next hop never refused"
                for n, r in sorted(bounced - refused)]
        out += [f"the relay refused {r}" for r in self.refusals]
        return out

    def close(self) -> None:
        if self.alive():
            self.kill()
        for _ in self.clients:
            self.jobs.put(None)
        for t in self.clients:
            t.join(READY_TIMEOUT)
        self.sink.close()

    def stderr_tail(self) -> str:
        with open(self.log_path, "rb") as fh:
            return fh.read()[-3000:].decode(errors="replace")

    # -- threads -----------------------------------------------------------------

    def _read_stderr(self, proc: subprocess.Popen[bytes], life: int) -> None:
        assert proc.stderr is not None
        with open(self.log_path, "ab") as log:
            for raw in proc.stderr:
                log.write(raw)
                line = raw.decode("utf-8", "replace")
                if m := DELIVERED.search(line):
                    self._delivered(life, m.group(1), m.group(2))
                elif m := ACCEPTED.search(line):
                    s = SENDER_RE.match(m.group(2))
                    if s:
                        self.qid_n[m.group(1)] = int(s.group(1))
                elif (m := LISTENING.search(line)) and life == self.life:
                    self.port = int(m.group(1))
                    self.early_window = time.monotonic() - self.started_at
                    self.events_q.put((life, "ready"))
        proc.stderr.close()
        self.events_q.put((life, "exited"))

    def _delivered(self, life: int, qid: str, rcpt: str) -> None:
        """A delivery record is durable: name what it covers, if that can be told for certain."""
        n = self.qid_n.get(qid)
        if n is not None:
            self.events_q.put((life, f"rec {n} {rcpt}"))
            return
        s = SENDER_RE.match(rcpt)
        if s is None:
            return  # accepted in a life whose log line we missed: no window check for it, only counts
        # A DSN to sN: its recipients are those of the one DSN for N at the sink, if there is only one so far.
        sets = self.sink.dsn_rcpt_sets(int(s.group(1)))
        if len(sets) == 1:
            for r in sorted(next(iter(sets))):
                self.events_q.put((life, f"brec {s.group(1)} {r}"))

    def _client(self) -> None:
        smtp: smtplib.SMTP | None = None
        conn_life = 0
        while True:
            job = self.jobs.get()
            if job is None:
                break
            life, n, rcpts, length = job
            if life != self.life or self.port == 0:
                self.events_q.put((life, f"nack {n}"))
                continue
            try:
                if smtp is None or conn_life != life:
                    if smtp is not None:
                        smtp.close()
                    smtp = None
                    smtp = smtplib.SMTP("127.0.0.1", self.port, local_hostname="client.kill9.test", timeout=60)
                    smtp.ehlo()
                    conn_life = life
                self._send(smtp, life, n, rcpts, length)
            except (smtplib.SMTPException, OSError):
                if smtp is not None:
                    smtp.close()
                smtp = None
                self.events_q.put((life, f"nack {n}"))
        if smtp is not None:
            smtp.close()

    def _send(self, smtp: smtplib.SMTP, life: int, n: int, rcpts: list[str], length: int) -> None:
        code, reply = smtp.mail(sender_of(n))
        ok = code == 250
        for r in rcpts:
            if ok:
                code, reply = smtp.rcpt(r)
                ok = code == 250
        if not ok:
            self.refusals.append(f"message {n}: {code} {reply!r}")
            smtp.rset()
            self.events_q.put((life, f"nack {n}"))
            return
        code, resp = smtp.data(N_HEADER + str(n).encode() + b"\r\n" + relay_body(n, length))
        m = QUEUED_AS.search(resp)
        if code == 250 and m:
            self.events_q.put((life, f"ack {n} {m.group(1).decode()}"))
        else:
            self.refusals.append(f"message {n}: {code} {resp!r}")
            self.events_q.put((life, f"nack {n}"))

    def _count(self) -> int | None:
        """The relay's queue count over its control socket (what ``mta queue count`` asks); None if it cannot."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(30)
                s.connect(self.control)
                s.sendall(json.dumps({"op": "count"}).encode() + b"\n")
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        return None
                    buf += chunk
            answer = json.loads(buf)
            return int(answer["count"]) if answer.get("ok") else None
        except (OSError, ValueError, KeyError):
            return None

    def _watch_drain(self, life: int) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT
        stop = threading.Event()
        while time.monotonic() < deadline and life == self.life and self.alive():
            if self._count() == 0:
                self.events_q.put((life, "drained"))
                return
            stop.wait(DRAIN_POLL)
