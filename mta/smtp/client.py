"""The SMTP client core, with no I/O in it: intentions in, bytes and outcomes out.

Theory of operation
-------------------
The shell calls intention methods (``ehlo``, ``mail``, ``rcpt``, ``data``,
``send_body``, ``end_data``, ``quit`` ...). Each one queues a command line and
remembers which reply it waits for. ``data_to_send()`` releases what may go on
the wire now: without PIPELINING one command per reply; with it, everything
up to and including the next command RFC 2920 says must end a group (EHLO,
DATA, STARTTLS, QUIT, NOOP, RSET), so MAIL + RCPTs + DATA leave in one write.

Replies are fed to ``receive_data`` and matched, in order, to what was sent;
``next_event`` hands them out as events. One transaction (``mail`` ...
``end_data``) always ends in exactly one ``MessageReply`` that carries the
outcome of every recipient: the MAIL reply if MAIL failed, else its RCPT reply
if that failed, else the reply to the end of data (or to DATA, if DATA failed).

The body is only accepted after ``DataReply(go_ahead=True)``; ``send_body``
turns any line ending into CRLF and dot-stuffs, so a body can never end the
message early, whatever bytes it holds.

With a server that offers CHUNKING and PIPELINING, ``bdat()`` takes DATA's
place (RFC 3030): the body is open at once, with no ``354`` to wait for, and
``send_body`` sends it as it is in ``BDAT n`` chunks (``mta.smtp.chunking``),
``end_data`` as the ``BDAT n LAST``. Every chunk's reply is matched; the
first that refuses is the transaction's final reply.

The transaction is in one ``Phase`` at a time and moves only by a ``Step``
of ``TRANSITIONS`` (``_fire``, the one place that assigns it), as in the
server core. Intentions and replies both take steps: ``mail()`` opens the
envelope, ``data()`` sends DATA, its ``354`` opens the body (or, with no
recipient accepted, an empty message goes at once), ``end_data()`` ends it,
and the reply to the content, a refused DATA or ``rset()`` close the
transaction. Whether the connection is closed (``QUIT`` answered, or EOF) is
a flag beside it, because a body being sent is still finished.

LMTP (RFC 2033) is the same conversation with two differences, taken by
``ClientConnection(lmtp=True)``: ``ehlo`` sends LHLO (there is no HELO), and
the end of data is answered once per recipient whose RCPT was accepted, in
RCPT order. The one ``MessageReply`` then comes after the last of those
replies and carries each recipient's own reply, so one transaction can
deliver some recipients, defer others and bounce the rest.

Raises ``LocalProtocolError`` when the shell asks for something out of order
or something the server did not offer (SMTPUTF8, 8BITMIME, DSN, STARTTLS), and
``RemoteProtocolError`` when the server's replies make no sense.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Final

import attrs

from mta.smtp.addresses import Params, format_params
from mta.smtp.bodybytes import crlf_clean, stuff
from mta.smtp.chunking import ChunkEncoder
from mta.smtp.common import (
    MAX_COMMAND_LINE,
    LocalProtocolError,
    RemoteProtocolError,
    Reply,
    ReplyParser,
    TableKey,
)


class Phase(TableKey):
    """Where the transaction is: the rows of ``TRANSITIONS``."""

    READY = "ready"  # no transaction: mail() may open one
    ENVELOPE = "envelope"  # mail() done: rcpt() and data() may follow
    DATA_SENT = "data sent"  # data() done, waiting for the reply to DATA
    BODY = "body"  # 354 with a recipient accepted: send_body(), then end_data()
    ENDED = "ended"  # the content (maybe empty) is sent, waiting for its reply


class Step(TableKey):
    """What moves the transaction between phases: the columns of ``TRANSITIONS``."""

    MAIL = "mail()"
    RCPT = "rcpt()"
    DATA = "data()"
    BDAT = "bdat(): the body goes in chunks, no 354 to wait for"
    GO_AHEAD = "354 to DATA, a recipient accepted"
    NO_GO = "354 to DATA, no recipient accepted: an empty message is sent"
    DATA_REFUSED = "any other reply to DATA"
    END_DATA = "end_data()"
    FINAL = "the reply to the content"
    RSET = "rset()"


# The transaction's state machine, whole: the only way the phase changes (ClientConnection._fire).
TRANSITIONS: Final[Mapping[Phase, Mapping[Step, Phase]]] = {
    Phase.READY: {
        Step.MAIL: Phase.ENVELOPE,
        Step.RSET: Phase.READY,
    },
    Phase.ENVELOPE: {
        Step.RCPT: Phase.ENVELOPE,
        Step.DATA: Phase.DATA_SENT,  # only with at least one rcpt()
        Step.BDAT: Phase.BODY,  # only with at least one rcpt(), to a server that offers CHUNKING and PIPELINING
        Step.RSET: Phase.READY,
    },
    Phase.DATA_SENT: {
        Step.GO_AHEAD: Phase.BODY,
        Step.NO_GO: Phase.ENDED,
        Step.DATA_REFUSED: Phase.READY,  # the MessageReply carries the refusal; an RSET follows
        Step.RSET: Phase.READY,  # the transaction's outcome is given up
    },
    Phase.BODY: {  # no command can be sent while the body is open
        Step.END_DATA: Phase.ENDED,
    },
    Phase.ENDED: {
        Step.FINAL: Phase.READY,
        Step.RSET: Phase.READY,  # the transaction's outcome is given up
    },
}


class _Phase:
    """``Phase``'s members as plain class attributes, for the methods run on every command and chunk.

    Python 3.11 finds an enum member through ``EnumType.__getattr__``, about
    0.1 us a time: the dozen or so per message cost the client core 4% more
    CPU in tools/bench/smtp_codec_bench.py's client session.
    """

    READY: Final = Phase.READY
    ENVELOPE: Final = Phase.ENVELOPE
    BODY: Final = Phase.BODY


class _Step:
    """``Step``'s members as plain class attributes (see ``_Phase``)."""

    MAIL: Final = Step.MAIL
    RCPT: Final = Step.RCPT
    DATA: Final = Step.DATA
    BDAT: Final = Step.BDAT
    GO_AHEAD: Final = Step.GO_AHEAD
    NO_GO: Final = Step.NO_GO
    DATA_REFUSED: Final = Step.DATA_REFUSED
    END_DATA: Final = Step.END_DATA
    FINAL: Final = Step.FINAL
    RSET: Final = Step.RSET


# Told of every step taken: (from, step, to). For tests and tracing; it must not call back into the connection.
TransitionHook = Callable[[Phase, Step, Phase], None]


@attrs.frozen
class Capabilities:
    """What the server's EHLO reply offered."""

    pipelining: bool = False
    size: int | None = None  # None: not offered; 0: offered without a limit
    eightbitmime: bool = False
    smtputf8: bool = False
    starttls: bool = False
    enhancedstatuscodes: bool = False
    dsn: bool = False
    chunking: bool = False
    keywords: dict[str, str] = attrs.field(factory=dict)

    @classmethod
    def from_reply(cls, reply: Reply) -> Capabilities:
        """Parse EHLO reply lines after the first (``KEYWORD [params]``)."""
        keywords: dict[str, str] = {}
        for line in reply.lines[1:]:
            key, _, rest = line.strip().partition(" ")
            if key:
                keywords[key.upper()] = rest.strip()
        size: int | None = None
        if "SIZE" in keywords:
            value = keywords["SIZE"]
            size = int(value) if value.isdigit() else 0
        return cls(
            pipelining="PIPELINING" in keywords,
            size=size,
            eightbitmime="8BITMIME" in keywords,
            smtputf8="SMTPUTF8" in keywords,
            starttls="STARTTLS" in keywords,
            enhancedstatuscodes="ENHANCEDSTATUSCODES" in keywords,
            dsn="DSN" in keywords,
            chunking="CHUNKING" in keywords,
            keywords=keywords,
        )


@attrs.frozen
class Greeting:
    reply: Reply


@attrs.frozen
class EhloReply:
    """Reply to EHLO or HELO; ``capabilities`` is empty after HELO or a failure."""

    reply: Reply
    capabilities: Capabilities


@attrs.frozen
class CommandReply:
    """Reply to MAIL, RSET, NOOP, STARTTLS or QUIT (``command`` names which)."""

    command: str
    reply: Reply


@attrs.frozen
class RcptReply:
    address: str
    reply: Reply


@attrs.frozen
class DataReply:
    """Reply to DATA. Send the body only if ``go_ahead``."""

    reply: Reply
    go_ahead: bool


@attrs.frozen
class RecipientOutcome:
    address: str
    reply: Reply

    @property
    def delivered(self) -> bool:
        return self.reply.is_positive


@attrs.frozen
class MessageReply:
    """The end of one transaction: the final reply and every recipient's fate."""

    reply: Reply
    outcomes: tuple[RecipientOutcome, ...]


@attrs.frozen
class Closing:
    """An unsolicited 421: the server is going away."""

    reply: Reply


@attrs.frozen
class ConnectionClosed:
    """The server closed the connection (EOF was fed)."""


@attrs.frozen
class NeedData:
    """Send data_to_send(), then read and call receive_data()."""


Event = (
    Greeting
    | EhloReply
    | CommandReply
    | RcptReply
    | DataReply
    | MessageReply
    | Closing
    | ConnectionClosed
    | NeedData
)


class _Kind(TableKey):
    GREETING = "greeting"
    EHLO = "EHLO"
    HELO = "HELO"
    MAIL = "MAIL"
    RCPT = "RCPT"
    DATA = "DATA"
    CHUNK = "BDAT"  # a chunk before the LAST: its 250, or the transaction's refusal
    MESSAGE = "message"
    RSET = "RSET"
    NOOP = "NOOP"
    STARTTLS = "STARTTLS"
    AUTH = "AUTH"  # AUTH and each SASL response line (``mta.smtp.client_sasl``)
    QUIT = "QUIT"


# RFC 2920 §3.1: these end a pipelined group; nothing is sent after them until they are answered.
_SYNC: Final = frozenset(
    {_Kind.GREETING, _Kind.EHLO, _Kind.HELO, _Kind.DATA, _Kind.MESSAGE, _Kind.STARTTLS, _Kind.QUIT, _Kind.NOOP,
     _Kind.AUTH}
)
_NEWLINE_RE: Final = re.compile(rb"\r\n|\r|\n")


@attrs.define
class _Transaction:
    sender: str
    mail_reply: Reply | None = None
    rcpts: list[tuple[str, Reply | None]] = attrs.field(factory=list)
    data_reply: Reply | None = None
    # LMTP: the replies to the end of data so far, one per accepted recipient in RCPT order.
    lmtp_replies: list[Reply] = attrs.field(factory=list)

    chunk_refusal: Reply | None = None  # the first chunk before the LAST that was refused
    chunked: bool = False  # the body went in BDAT chunks


class BodyEncoder:
    """CRLF-normalises and dot-stuffs outgoing content, chunk by chunk (whole-chunk passes: ``bodybytes``)."""

    def __init__(self) -> None:
        self._line_start = True
        self._pending_cr = False

    def encode(self, chunk: bytes) -> bytes:
        data = b"\r" + chunk if self._pending_cr else chunk
        self._pending_cr = data.endswith(b"\r")
        if self._pending_cr:
            data = data[:-1]  # it may be the first half of a CRLF split across chunks
        if not data:
            return b""
        if not crlf_clean(data, 0, len(data)):  # one-byte passes in C, much cheaper than the regex
            data = _NEWLINE_RE.sub(b"\r\n", data)
        out = stuff(data, self._line_start)
        self._line_start = out.endswith(b"\r\n")
        return out

    def end(self) -> bytes:
        """The terminator, after a CRLF if the content did not end with one."""
        if self._pending_cr:
            self._pending_cr = False
            return b"\r\n.\r\n"
        return b".\r\n" if self._line_start else b"\r\n.\r\n"


class ClientConnection:
    """One SMTP client session. Start by waiting for the ``Greeting`` event."""

    def __init__(self, *, on_transition: TransitionHook | None = None, lmtp: bool = False) -> None:
        self.lmtp = lmtp  # RFC 2033: LHLO, and one reply per accepted recipient after the end of data
        self.capabilities: Capabilities | None = None
        self.tls_active = False
        self._parser = ReplyParser()
        self._out = bytearray()
        self._unsent: collections.deque[tuple[bytes, _Kind, str]] = collections.deque()
        self._waiting: collections.deque[tuple[_Kind, str]] = collections.deque([(_Kind.GREETING, "")])
        self._events: collections.deque[Event] = collections.deque()
        self._phase = Phase.READY
        self._on_transition = on_transition
        self._txn: _Transaction | None = None  # set exactly while the phase is not READY
        self._body = BodyEncoder()  # a fresh one for each body
        self._chunks: ChunkEncoder | None = None  # the body of a BDAT transaction
        self._smtputf8 = False
        self._closed = False
        self._eof = False

    # -------------------------------------------------------------- I/O side

    def receive_data(self, data: bytes | bytearray) -> None:
        """Bytes from the server; ``b""`` means EOF."""
        if not data:
            self._eof = True
            return
        if self._closed:
            return
        for reply in self._parser.feed(data):
            self._handle(reply)

    def data_to_send(self) -> bytes:
        self._flush()
        out = bytes(self._out)
        self._out.clear()
        return out

    def next_event(self) -> Event:
        if self._events:
            return self._events.popleft()
        if self._eof:
            self._closed = True
            return ConnectionClosed()
        return NeedData()

    @property
    def waiting(self) -> int:
        """How many replies are still expected (sent or queued commands)."""
        return len(self._waiting) + len(self._unsent)

    @property
    def idle(self) -> bool:
        """Between transactions with nothing in flight: the connection may carry another message."""
        return (self._phase is _Phase.READY and not self._waiting and not self._unsent
                and not self._events and not self._closed and not self._eof)

    @property
    def buffered(self) -> int:
        """Bytes of body already encoded and waiting for ``data_to_send()``: the shell writes when it is enough."""
        return len(self._out)

    @property
    def in_data(self) -> bool:
        """True between ``DataReply(go_ahead=True)`` and ``end_data()``."""
        return self._phase is _Phase.BODY

    @property
    def answered(self) -> tuple[RecipientOutcome, ...]:
        """LMTP: the recipients whose fate is known while other replies to the end of data are still awaited:
        those refused at RCPT, and those whose reply to the end of data came.

        So that a shell whose connection is lost between those replies records these as they were answered
        (delivered, say) and retries only the rest. Empty outside LMTP's end of data.
        """
        txn = self._txn
        if txn is None or not self.lmtp or self._phase is not Phase.ENDED:
            return ()
        accepted = [a for a, r in txn.rcpts if r is not None and r.is_positive]
        refused = [RecipientOutcome(a, r) for a, r in txn.rcpts if r is not None and not r.is_positive]
        return (*refused, *(RecipientOutcome(a, r) for a, r in zip(accepted, txn.lmtp_replies)))

    @property
    def phase(self) -> Phase:
        """Where the transaction is; it changes only by a step of ``TRANSITIONS``."""
        return self._phase

    # -------------------------------------------------------------- intentions

    def ehlo(self, name: str) -> None:
        """EHLO, or LHLO in LMTP mode (its reply is the same ``EhloReply``)."""
        self._command(f"{'LHLO' if self.lmtp else 'EHLO'} {name}", _Kind.EHLO)

    def helo(self, name: str) -> None:
        if self.lmtp:
            raise LocalProtocolError("LMTP has no HELO (RFC 2033 §4.1): LHLO only")
        self._command(f"HELO {name}", _Kind.HELO)

    def starttls(self) -> None:
        if self.capabilities is None or not self.capabilities.starttls:
            raise LocalProtocolError("the server did not offer STARTTLS")
        self._command("STARTTLS", _Kind.STARTTLS)

    def auth(self, line: str) -> None:
        """One line of an AUTH exchange (``AUTH PLAIN ...`` or a response to a 334), answered by a
        ``CommandReply("AUTH", ...)``. The line is never shown in an error: it may hold a password."""
        if self._phase is not _Phase.READY:
            raise LocalProtocolError("AUTH only between transactions")
        self._command(line, _Kind.AUTH)

    def tls_started(self) -> None:
        """Handshake done: forget everything learned in plaintext; EHLO again."""
        self.tls_active = True
        self.capabilities = None
        self._parser = ReplyParser()  # drop replies injected before the handshake

    def mail(self, sender: str, params: Params | None = None) -> None:
        """Begin a transaction. ``sender`` without brackets, ``""`` for the null sender."""
        if self._phase is not _Phase.READY:
            raise LocalProtocolError("a transaction is already open; end_data() or rset() first")
        params = dict(params or {})
        caps = self.capabilities or Capabilities()
        if not sender.isascii() and "SMTPUTF8" not in params:
            raise LocalProtocolError("non-ASCII sender needs the SMTPUTF8 parameter")
        if "SMTPUTF8" in params and not caps.smtputf8:
            raise LocalProtocolError("the server did not offer SMTPUTF8")
        if (params.get("BODY") or "").upper() == "8BITMIME" and not caps.eightbitmime:
            raise LocalProtocolError("the server did not offer 8BITMIME")
        if ("RET" in params or "ENVID" in params) and not caps.dsn:
            raise LocalProtocolError("the server did not offer DSN")
        self._command(f"MAIL FROM:<{sender}>{format_params(params)}", _Kind.MAIL)
        self._fire(_Step.MAIL)
        self._txn = _Transaction(sender)
        self._smtputf8 = "SMTPUTF8" in params

    def rcpt(self, address: str, params: Params | None = None) -> None:
        txn = self._txn
        if self._phase is not _Phase.ENVELOPE or txn is None:
            raise LocalProtocolError("rcpt() needs mail() first and must come before data()")
        if not address.isascii() and not self._smtputf8:
            raise LocalProtocolError("non-ASCII recipient needs SMTPUTF8 on MAIL")
        if params and ("NOTIFY" in params or "ORCPT" in params) and not (self.capabilities or Capabilities()).dsn:
            raise LocalProtocolError("the server did not offer DSN")
        self._command(f"RCPT TO:<{address}>{format_params(params)}", _Kind.RCPT, address)
        self._fire(_Step.RCPT)
        txn.rcpts.append((address, None))

    def data(self) -> None:
        if self._phase is not _Phase.ENVELOPE or self._txn is None or not self._txn.rcpts:
            raise LocalProtocolError("data() needs mail() and at least one rcpt(), once")
        self._fire(_Step.DATA)
        self._command("DATA", _Kind.DATA)

    def bdat(self) -> None:
        """Open the body at once, to be sent in BDAT chunks (the server must offer CHUNKING and PIPELINING)."""
        caps = self.capabilities or Capabilities()
        if not (caps.chunking and caps.pipelining):
            raise LocalProtocolError("the server did not offer CHUNKING with PIPELINING")
        if self._phase is not _Phase.ENVELOPE or self._txn is None or not self._txn.rcpts:
            raise LocalProtocolError("bdat() needs mail() and at least one rcpt(), once")
        self._flush()  # MAIL and RCPT go before the first chunk
        self._fire(_Step.BDAT)
        self._txn.chunked = True
        self._chunks = ChunkEncoder()

    def send_body(self, chunk: bytes) -> None:
        """Content bytes, any line endings; they are normalised and dot-stuffed (with BDAT: chunked)."""
        if self._phase is not _Phase.BODY:
            raise LocalProtocolError("send_body() only after DataReply(go_ahead=True) or bdat()")
        if self._chunks is None:
            self._out += self._body.encode(chunk)
            return
        out = self._chunks.encode(chunk)
        if out:
            self._out += out
            self._waiting.append((_Kind.CHUNK, ""))

    def end_data(self) -> None:
        if self._phase is not _Phase.BODY:
            raise LocalProtocolError("end_data() only after DataReply(go_ahead=True) or bdat()")
        if self._chunks is None:
            self._out += self._body.end()
        else:
            self._out += self._chunks.end()
            self._chunks = None
        self._fire(_Step.END_DATA)
        txn = self._txn
        replies = 1
        if self.lmtp and txn is not None:  # RFC 2033 §4.2: one reply per RCPT that was accepted
            replies = sum(1 for _, r in txn.rcpts if r is not None and r.is_positive)
        for _ in range(replies):
            self._waiting.append((_Kind.MESSAGE, ""))

    def rset(self) -> None:
        self._command("RSET", _Kind.RSET)
        self._fire(_Step.RSET)

    def noop(self) -> None:
        self._command("NOOP", _Kind.NOOP)

    def quit(self) -> None:
        self._command("QUIT", _Kind.QUIT)

    # -------------------------------------------------------------- internals

    def _fire(self, step: Step) -> None:
        """Take ``step`` from the current phase: the one place the phase changes.

        Raises ``LocalProtocolError`` if ``TRANSITIONS`` has no such step from here.
        """
        old = self._phase
        new = TRANSITIONS[old].get(step)
        if new is None:
            raise LocalProtocolError(f"no step {step.name} ({step.value}) from phase {old.name}")
        self._phase = new
        if new is _Phase.READY:
            self._txn = None
        if self._on_transition is not None:
            self._on_transition(old, step, new)

    def _command(self, line: str, kind: _Kind, arg: str = "") -> None:
        if self._phase is _Phase.BODY:
            raise LocalProtocolError("finish the body with end_data() first")
        if self._closed:
            raise LocalProtocolError("the connection is closed")
        if "\r" in line or "\n" in line or "\x00" in line:
            raise LocalProtocolError("CR, LF or NUL in a command argument")
        raw = line.encode("utf-8") + b"\r\n"
        if len(raw) > MAX_COMMAND_LINE:
            raise LocalProtocolError("command line longer than 512 octets")
        self._unsent.append((raw, kind, arg))

    def _flush(self) -> None:
        pipelining = self.capabilities is not None and self.capabilities.pipelining
        while self._unsent and self._phase is not _Phase.BODY:
            if self._waiting and not (pipelining and self._waiting[-1][0] not in _SYNC):
                return
            raw, kind, arg = self._unsent.popleft()
            self._out += raw
            self._waiting.append((kind, arg))

    def _handle(self, reply: Reply) -> None:
        if not self._waiting:
            if reply.code == 421:
                self._events.append(Closing(reply))
                return
            raise RemoteProtocolError(f"unexpected reply {reply}")
        kind, arg = self._waiting.popleft()
        txn = self._txn
        if kind is _Kind.GREETING:
            self._events.append(Greeting(reply))
        elif kind in (_Kind.EHLO, _Kind.HELO):
            ok = reply.code == 250
            caps = Capabilities.from_reply(reply) if ok and kind is _Kind.EHLO else Capabilities()
            self.capabilities = caps if ok else self.capabilities
            self._events.append(EhloReply(reply, caps))
        elif kind is _Kind.MAIL and txn is not None:
            txn.mail_reply = reply
            self._events.append(CommandReply("MAIL", reply))
        elif kind is _Kind.RCPT and txn is not None:
            i = next(i for i, (a, r) in enumerate(txn.rcpts) if a == arg and r is None)
            txn.rcpts[i] = (arg, reply)
            self._events.append(RcptReply(arg, reply))
        elif kind is _Kind.DATA and txn is not None:
            self._data_reply(txn, reply)
        elif kind is _Kind.MESSAGE and txn is not None and self.lmtp:
            self._lmtp_reply(txn, reply)

        elif kind is _Kind.CHUNK and txn is not None:
            if not reply.is_positive and txn.chunk_refusal is None:
                txn.chunk_refusal = reply
        elif kind is _Kind.MESSAGE and txn is not None:
            final = txn.chunk_refusal or reply
            self._finish(txn, final, _Step.FINAL)
            if txn.chunked and not final.is_positive and final.code != 421 and not self._closed:
                # A refused BDAT (no recipient took it, say) may leave the server's MAIL transaction open, as a
                # refused DATA does: without an RSET the next MAIL on this connection gets 503.
                self._command("RSET", _Kind.RSET)
        else:
            self._events.append(CommandReply(kind.value, reply))
            if kind is _Kind.QUIT:
                self._closed = True

    def _data_reply(self, txn: _Transaction, reply: Reply) -> None:
        accepted = any(r is not None and r.is_positive for _, r in txn.rcpts)
        if reply.code == 354 and accepted:
            self._fire(_Step.GO_AHEAD)
            self._body = BodyEncoder()
            self._events.append(DataReply(reply, go_ahead=True))
        elif reply.code == 354:
            # RFC 2920 §3.1: no recipient took it, yet the server wants content: send none.
            self._fire(_Step.NO_GO)
            self._out += b".\r\n"
            self._waiting.appendleft((_Kind.MESSAGE, ""))
            self._events.append(DataReply(reply, go_ahead=False))
        else:
            self._events.append(DataReply(reply, go_ahead=False))
            self._finish(txn, reply, _Step.DATA_REFUSED)
            if reply.code != 421 and not self._closed:
                # A refused DATA leaves the server's MAIL transaction open (RFC 5321 §3.3): without
                # an RSET the next MAIL on this connection gets 503, a permanent failure.
                self._command("RSET", _Kind.RSET)

    def _lmtp_reply(self, txn: _Transaction, reply: Reply) -> None:
        """One accepted recipient's reply to the end of data; the last of them ends the transaction."""
        txn.lmtp_replies.append(reply)
        if any(kind is _Kind.MESSAGE for kind, _ in self._waiting):
            return
        self._finish(txn, reply, _Step.FINAL, iter(txn.lmtp_replies))

    def _finish(self, txn: _Transaction, final: Reply, step: Step, each: Iterator[Reply] | None = None) -> None:
        """``each``: LMTP's replies to the end of data, one per accepted recipient in order (else ``final``)."""
        outcomes = []
        for address, r in txn.rcpts:
            if txn.mail_reply is not None and not txn.mail_reply.is_positive:
                r = txn.mail_reply
            elif r is None or r.is_positive:
                r = final if each is None or r is None else next(each, final)
            outcomes.append(RecipientOutcome(address, r))
        self._events.append(MessageReply(final, tuple(outcomes)))
        self._fire(step)
