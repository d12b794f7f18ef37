"""Pieces for relay tests: a relay's config, a relay in this process, scriptable next hops, delivery events.

The next hops are real SMTP servers on 127.0.0.1 built on the project's own
server core: ``NextHop`` answers as a test's policy chooses per message,
``GatedHop`` holds its ``250`` until the test opens a gate. Tests wait for
what the relay reports (``DeliveryWatch``) or for what the next hop received,
never for a fixed time. The relay as a child process is in ``process_support``.
"""

from __future__ import annotations

import functools
import os
import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio
import trustme

from mta.config import Config, parse_config
from mta.process.relay import Relay
from mta.smtp.common import Reply
from mta.smtp.server import (
    ConnectionClosed,
    DataAborted,
    DataChunk,
    Ehlo,
    EndOfData,
    Helo,
    MailFrom,
    NeedData,
    Quit,
    RcptTo,
    Rset,
    ServerConnection,
    StartTls,
)
from spool.format.record import Outcome, Status

MESSAGE_ID = re.compile(rb"^Message-ID: <([^>]+)>", re.MULTILINE | re.IGNORECASE)


def relay_config_text(routes: dict[str, str], extra: str = "", retry: str | None = '["1s", "2s"]',
                      spool_extra: str = "", spool_dir: str = "spool") -> str:
    """A relay's TOML: listening on a port the OS picks, ``routes``; ``extra`` goes in ``[server]``.

    ``retry``: the ``retry_intervals`` value, None for the default classes.
    """
    lines = [f'"{k}" = "{v}"' for k, v in routes.items()]
    retry_line = f"retry_intervals = {retry}" if retry is not None else ""
    return f"""
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
{extra}
[spool]
dir = "{spool_dir}"
{retry_line}
{spool_extra}
[routes]
""" + "\n".join(lines) + "\n"


def tls_files(directory: Path, ca: trustme.CA) -> tuple[Path, Path]:
    """The relay's certificate for relay.test, issued by ``ca``, and its key (mode 0600): cert.pem, key.pem."""
    cert = ca.issue_cert("relay.test")
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    os.chmod(directory / "key.pem", 0o600)
    return directory / "cert.pem", directory / "key.pem"


def relay_config(tmp: str, routes: dict[str, str], extra: str = "", retry: str | None = '["1s", "2s"]',
                 spool_extra: str = "") -> Config:
    text = relay_config_text(routes, extra, retry, spool_extra)
    return parse_config(text, source=os.path.join(tmp, "test.toml"), base_dir=tmp)


def write_relay_config(directory: Path, routes: dict[str, str], extra: str = "", retry: str | None = '["1s", "2s"]',
                       spool_extra: str = "", spool_dir: str = "spool") -> Path:
    """``directory/relay.toml`` for ``mta serve`` and the admin commands (see ``relay_config_text``)."""
    path = directory / "relay.toml"
    path.write_text(relay_config_text(routes, extra, retry, spool_extra, spool_dir))
    return path


async def start_relay(nursery: trio.Nursery, config: Config) -> Relay:
    relay: Relay = await nursery.start(Relay(config).run)
    return relay


class DeliveryWatch:
    """Collects outcomes as the scheduler reports them durable; tests await counts."""

    def __init__(self, relay: Relay) -> None:
        self.outcomes: list[tuple[str, Outcome]] = []
        self._changed = trio.Event()
        relay.scheduler.observers.append(self._observe)

    def _observe(self, qid: str, outcome: Outcome) -> None:
        self.outcomes.append((qid, outcome))
        self._changed.set()
        self._changed = trio.Event()

    def count(self, status: Status, recipient: str | None = None) -> int:
        return sum(1 for _, o in self.outcomes
                   if o.status is status and (recipient is None or o.recipient == recipient))

    async def wait_for(self, status: Status, n: int = 1, recipient: str | None = None,
                       timeout: float = 60) -> list[Outcome]:
        with trio.fail_after(timeout):
            while self.count(status, recipient) < n:
                await self._changed.wait()
        return [o for _, o in self.outcomes if o.status is status and (recipient is None or o.recipient == recipient)]


@attrs.define
class Received:
    sender: str
    recipients: list[str]
    data: bytes
    tls: bool = False
    mail_params: dict[str, str | None] = attrs.field(factory=dict)  # MAIL's ESMTP parameters
    rcpt_params: dict[str, dict[str, str | None]] = attrs.field(factory=dict)  # each accepted RCPT's
    peer: str = ""  # the client's address, as this hop saw it
    helo: str = ""  # the name the client gave in EHLO (or HELO)


Policy = Callable[[str, Any], Reply | None]


class NextHop:
    """A next-hop SMTP server whose replies the test scripts.

    ``policy(stage, value)`` is asked at "rcpt" (the address) and "data" (a
    Received with the message); it returns a Reply to refuse, or None to accept.
    With ``ssl_context`` it offers STARTTLS and records on each message whether
    it came over TLS.
    """

    def __init__(self, policy: Policy | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.policy = policy or (lambda stage, value: None)
        self.ssl_context = ssl_context
        self.messages: list[Received] = []
        self.connections = 0
        self.closed = 0  # connections ended, whoever ended them
        self.hang_up_after_message = False  # close the connection after each message's reply, without QUIT
        # What a connection that already carried a message does with its next MAIL: "eof" (close, no reply),
        # "421" (421, then close), or None (take it). A server that closed it while the client's MAIL was on
        # its way.
        self.drop_reused: str | None = None
        self.stall_at: str | None = None  # "rcpt" or "end of data": never reply there (a hung next hop)
        self.rsets = 0
        self.port = 0
        self._changed = trio.Event()

    async def start(self, nursery: trio.Nursery, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host``:``port`` (by default a free port of 127.0.0.1); returns the port."""
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._handle, port, host=host))
        self.port = int(listeners[0].socket.getsockname()[1])
        return self.port

    async def wait_messages(self, n: int, timeout: float = 60) -> list[Received]:
        with trio.fail_after(timeout):
            while len(self.messages) < n:
                await self._changed.wait()
        return self.messages

    async def wait_closed(self, n: int, timeout: float = 60) -> None:
        with trio.fail_after(timeout):
            while self.closed < n:
                await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def take(self, conn: ServerConnection, msg: Received) -> None:
        """The end of a message's data: accept it (and keep it) or refuse it, as the policy says."""
        refuse = self.policy("data", msg)
        if refuse is None:
            self.messages.append(msg)
            self._wake()
            conn.accept()
        else:
            conn.reject(refuse)

    async def _handle(self, tcp: trio.SocketStream) -> None:
        self.connections += 1
        try:
            await self._converse(tcp)
        finally:
            self.closed += 1
            self._wake()

    async def _converse(self, tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp
        conn = ServerConnection("nexthop.test", tls_available=self.ssl_context is not None)
        sender, rcpts, data = "", list[str](), bytearray()
        params: dict[str, str | None] = {}
        rcpt_params: dict[str, dict[str, str | None]] = {}
        carried = 0
        peer, helo = str(tcp.socket.getpeername()[0]), ""
        try:
            while True:
                out = conn.data_to_send()
                if out:
                    await stream.send_all(out)
                ev = conn.next_event()
                if isinstance(ev, NeedData):
                    out = conn.data_to_send()
                    if out:
                        await stream.send_all(out)
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(ev, MailFrom) and carried and self.drop_reused is not None:
                    if self.drop_reused == "421":
                        await stream.send_all(b"421 4.4.2 nexthop.test closing: idle too long\r\n")
                    await stream.aclose()
                    return
                elif isinstance(ev, MailFrom):
                    sender, rcpts, data = ev.address, [], bytearray()
                    params, rcpt_params = dict(ev.params), {}
                    conn.accept()
                elif isinstance(ev, Ehlo | Helo):
                    helo = ev.name
                elif isinstance(ev, Rset):
                    self.rsets += 1
                elif isinstance(ev, RcptTo) and self.stall_at == "rcpt":
                    await trio.sleep_forever()
                elif isinstance(ev, RcptTo):
                    refuse = self.policy("rcpt", ev.address)
                    if refuse is None:
                        rcpts.append(ev.address)
                        rcpt_params[ev.address] = dict(ev.params)
                        conn.accept()
                    else:
                        conn.reject(refuse)
                elif isinstance(ev, DataChunk):
                    data += ev.data
                elif isinstance(ev, EndOfData) and self.stall_at == "end of data":
                    await trio.sleep_forever()
                elif isinstance(ev, EndOfData):
                    carried += 1
                    await self.take(conn, Received(sender, rcpts, bytes(data), tls=conn.tls_active, mail_params=params,
                                                   rcpt_params=rcpt_params, peer=peer, helo=helo))
                    if self.hang_up_after_message:
                        await stream.send_all(conn.data_to_send())
                        await stream.aclose()
                        return
                elif isinstance(ev, StartTls) and self.ssl_context is not None:
                    conn.accept()
                    await stream.send_all(conn.data_to_send())
                    stream = trio.SSLStream(stream, self.ssl_context, server_side=True)
                    await stream.do_handshake()
                    conn.tls_started()
                elif isinstance(ev, StartTls):
                    conn.reject(Reply(454, "4.7.0", "no TLS here"))
                elif isinstance(ev, DataAborted):
                    data = bytearray()
                elif isinstance(ev, (Quit, ConnectionClosed)):
                    out = conn.data_to_send()
                    if out:
                        await stream.send_all(out)
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError):
            return


class GatedHop(NextHop):
    """A next hop that takes ``accept_first`` messages at once, then holds each ``250`` until ``gate`` opens.

    A held message has been taken by the next hop (``received``, by Message-ID)
    while the relay has no outcome for it: exactly the window that makes a
    duplicate after a crash. ``new_life`` starts counting again after the
    relay was killed and restarted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[int, str, str]] = []  # (life, Message-ID, recipient)
        self.held: list[str] = []
        self.life = 1
        self.accept_first = 0
        self.gate = trio.Event()
        self._in_life = 0
        # Called when a message is held: a test may kill the relay right there, with no task switch.
        self.on_hold: Callable[[], object] | None = None
        self.reply_text = ""  # the 250's text, if not "taken <Message-ID>" (LF between lines)

    def new_life(self, accept_first: int) -> None:
        self.gate.set()  # the old life's held connections are dead; let their handlers end
        self.gate = trio.Event()
        self.life += 1
        self.accept_first = accept_first
        self.held = []
        self._in_life = 0

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 90) -> None:
        with trio.fail_after(timeout):
            while not condition():
                await self._changed.wait()

    def ids(self, life: int | None = None) -> list[str]:
        return [mid for lf, mid, _ in self.received if life is None or lf == life]

    async def take(self, conn: ServerConnection, msg: Received) -> None:
        match = MESSAGE_ID.search(msg.data)
        mid = match.group(1).decode() if match else "?"
        for r in msg.recipients:
            self.received.append((self.life, mid, r))
        self.messages.append(msg)
        self._in_life += 1
        if self._in_life > self.accept_first:
            gate = self.gate
            self.held.append(mid)
            if self.on_hold is not None:
                self.on_hold()
            self._wake()
            await gate.wait()
        self._wake()
        conn.accept(Reply(250, "2.0.0", self.reply_text or f"taken {mid}"))


class CountingStream(trio.abc.Stream):
    """Passes everything through and remembers each send_all (one write on a socket), so a test sees how
    replies or commands were batched."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.writes: list[bytes] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class RawClient:
    """An SMTP client on a bare socket that sends exactly the bytes a test gives it.

    For what polite clients (smtplib, swaks) will not do: pipelining across
    STARTTLS, bare LF, over-long lines. ``reply()`` reads one whole (possibly
    multi-line) reply; ``closed()`` waits for the server to hang up.
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def connect(cls, port: int, source: str = "127.0.0.1", timeout: float = 30) -> RawClient:
        sock = trio.socket.socket()
        await sock.bind((source, 0))
        with trio.fail_after(timeout):
            await sock.connect(("127.0.0.1", port))
        return cls(trio.SocketStream(sock))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _line(self, timeout: float) -> bytes:
        with trio.fail_after(timeout):
            while b"\r\n" not in self.buf:
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError(f"connection closed; unread: {bytes(self.buf)!r}")
                self.buf += data
        line, _, rest = bytes(self.buf).partition(b"\r\n")
        self.buf = bytearray(rest)
        return line

    async def reply(self, timeout: float = 30) -> list[bytes]:
        lines = [await self._line(timeout)]
        while lines[-1][3:4] == b"-":
            lines.append(await self._line(timeout))
        return lines

    async def code(self, timeout: float = 30) -> int:
        return int((await self.reply(timeout))[0][:3])

    async def command(self, line: bytes, timeout: float = 30) -> list[bytes]:
        await self.send(line + b"\r\n")
        return await self.reply(timeout)

    async def closed(self, timeout: float = 30) -> bytes:
        """Wait for EOF; returns whatever arrived before it."""
        with trio.fail_after(timeout):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    return bytes(self.buf)
                self.buf += data

    async def starttls(self, ctx: ssl.SSLContext, server_hostname: str = "relay.test") -> None:
        """Wrap the stream after a 220 to STARTTLS; unread plaintext is an error (it would be injected)."""
        if self.buf:
            raise AssertionError(f"plaintext after the 220 to STARTTLS: {bytes(self.buf)!r}")
        tls = trio.SSLStream(self.stream, ctx, server_hostname=server_hostname)
        with trio.fail_after(30):
            await tls.do_handshake()
        self.stream = tls

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class SilentHop:
    """Accepts connections and says nothing until released: a next hop that never greets (a timeout)."""

    def __init__(self) -> None:
        self.port = 0
        self.connected = trio.Event()
        self._release = trio.Event()

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1"))
        self.port = int(listeners[0].socket.getsockname()[1])
        return self.port

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connected.set()
        await self._release.wait()
        await stream.aclose()

    def release(self) -> None:
        self._release.set()


def server_context(cert: trustme.LeafCert) -> ssl.SSLContext:
    """A server-side TLS context presenting ``cert`` (a next hop's, or an HTTPS server's)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    return ctx
