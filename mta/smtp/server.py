"""The SMTP server state machine, with no I/O in it (in the manner of h11).

Theory of operation
-------------------
The shell (a trio task per connection) owns the socket; this object owns the
protocol. The shell feeds what it reads to ``receive_data`` (``b""`` at EOF),
then calls ``next_event`` until it returns ``NeedData``, sending
``data_to_send()`` before it waits for the peer. Input is consumed one command
line at a time, and only when the shell asks for the next event, so pipelined
commands are answered in order and a line after ``DATA`` is never parsed as a
command: by the time it is looked at, the state already says "content".

What needs no policy is answered here (NOOP, HELP, VRFY, RSET, QUIT, EHLO/HELO,
syntax and sequence errors, limits). Five events need a decision from the
shell — ``MailFrom``, ``RcptTo``, ``EndOfData``, ``StartTls`` and ``AuthRequest``, and
``DataCommand`` when the shell asked to decide DATA (``decide_data``) — and until it
calls ``accept()`` or ``reject(reply)`` the core reads no further input
(``next_event`` raises ``LocalProtocolError``). That is how the ``250`` after
DATA waits for the spool's commit. Every 4xx/5xx reply, the core's own and
the shell's ``reject``, is also handed to ``on_reject`` as a ``Rejection``
(command, argument, reply, a one-word reason), so the shell logs each
refusal once, whoever decided it. The events are small frozen classes in
``mta.smtp.server_events`` (offered here too).

States and steps
----------------
The session is in one ``State`` at a time, and the only way it leaves one is
a ``Step`` looked up in ``TRANSITIONS`` (state -> step -> next state), by
``_fire``, the one place that assigns the state (h11's ``_state.py`` does the
same). A step the table does not list from the current state raises
``LocalProtocolError``: it is a bug here or in the shell, never the peer's
doing, since the peer's commands are first checked against ``ALLOWED`` (the
states a command is heard in; elsewhere it gets ``503 5.5.1``). In short::

    CONNECTED -HELLO-> IDLE -MAIL_ACCEPTED-> MAIL -RCPT_ACCEPTED-> RCPT -DATA_STARTED-> DATA
    DATA -MESSAGE_ACCEPTED | MESSAGE_REJECTED | MESSAGE_REFUSED-> IDLE
    IDLE -STARTTLS_ACCEPTED-> TLS -TLS_STARTED-> CONNECTED
    IDLE -AUTH_STARTED-> AUTH -AUTH_SUCCEEDED | AUTH_FAILED | AUTH_ABORTED-> IDLE
    CONNECTED, IDLE, MAIL, RCPT: -HELLO-> IDLE, -RSET-> IDLE (CONNECTED stays),
                                  -QUIT | TOO_MANY_ERRORS | EOF-> CLOSED
    RCPT -BDAT_STARTED-> CHUNKS -MESSAGE_ACCEPTED | MESSAGE_REJECTED | MESSAGE_REFUSED-> IDLE
    DATA, AUTH -EOF-> CLOSED;  CLOSED is the end: no step leaves it

AUTH (RFC 4954) is offered only once TLS is active; its SASL exchange
(PLAIN, LOGIN) is parsed in ``mta.smtp.sasl``. In state AUTH each line is a
response, never a command; a complete exchange is an ``AuthRequest``
decision. A successful AUTH lasts the session (EHLO and RSET keep it). No
part of an AUTH argument after the mechanism, and no response line, is kept
in a ``Rejection``: they carry credentials.

A step also decides what the session forgets (``FORGETS_SESSION``,
``FORGETS_TRANSACTION``), wherever it fires. Beside this machine runs a
smaller one, kept apart as h11 keeps its keep-alive flag: whether a decision
is pending (``_pending``). While it is, no step can happen except through
``accept()`` or ``reject()``.

Message content arrives as ``DataChunk`` events (dot-unstuffed, CRLF line
ends, at most ``DATA_CHUNK_SIZE`` bytes each); ``mta.smtp.common.ContentDecoder``
finds its end and what dooms it (size, long lines, bare CR/LF: SMTP
smuggling, CVE-2023-51764/5/6), and the shell then sees ``DataAborted``.

CHUNKING (RFC 3030): the first ``BDAT size [LAST]`` of a transaction takes
it to CHUNKS, where each BDAT's ``size`` octets are read as content (the
side machine ``_chunk``: how many are left, whether it is the LAST) and,
between chunks, commands are read again (BDAT, RSET, NOOP, QUIT, EHLO ...;
MAIL, RCPT and DATA get ``503``). The shell sees the same events as for
DATA: ``DataStart``, ``DataChunk``, then ``EndOfData`` after the LAST chunk
or ``DataAborted``. Each chunk is policed by ``mta.smtp.chunking``
exactly as DATA's content is; a chunk that dooms the message is refused at
its end (a size declared past the limit at once), and the transaction is
over. A chunk that is not the LAST is answered ``250`` once it has been read.
BDAT outside a transaction with a recipient is refused, and its octets are
read and dropped (``_discard``), so they are never taken for commands.

Around the machine, each in a module of its own: where a line ends
(``mta.smtp.input_buffer``), what MAIL's and RCPT's arguments may be
(``mta.smtp.server_arguments``, over ``mta.smtp.addresses``), the replies
(``mta.smtp.server_replies``). No reply carries the client's bytes as they
came: a command whose argument holds a control character (C0, DEL, C1; NUL
and TAB included) is refused whole (``501``), bytes that are not UTF-8 get
``500 5.5.2``, and a reply that names bad input shows it escaped and cut
short (``mta.smtp.common.printable``).
"""

from __future__ import annotations

from mta.smtp import server_replies as replies
from mta.smtp.chunking import BdatCommand, ChunkDecoder, parse_bdat
from mta.smtp.common import (
    DATA_CHUNK_SIZE,
    DEFAULT_MAX_ERRORS,
    DEFAULT_MAX_MESSAGE_SIZE,
    DEFAULT_MAX_RECIPIENTS,
    MAX_COMMAND_LINE,
    MAX_TEXT_LINE,
    R_TOO_BIG,
    ContentDecoder,
    LocalProtocolError,
    RemoteProtocolError,
    Reply,
    has_control,
)
from mta.smtp.input_buffer import Cut, InputBuffer
from mta.smtp.sasl import MAX_SASL_LINE, Challenge, Credentials, Failed, SaslExchange
from mta.smtp.sasl import R_LINE_TOO_LONG as R_SASL_LINE_TOO_LONG
from mta.smtp.sasl import start as start_sasl
from mta.smtp.server_arguments import Refusal, mail_from, rcpt_to
from mta.smtp.server_events import (
    ARGUMENT_SHOWN,
    END_OF_DATA,
    AuthRequest,
    ConnectionClosed,
    DataAborted,
    DataChunk,
    DataCommand,
    DataStart,
    Decision,
    Ehlo,
    EndOfData,
    Event,
    Helo,
    MailFrom,
    NeedData,
    Quit,
    RcptTo,
    RejectHook,
    Rejection,
    Rset,
    StartTls,
)
from mta.smtp.server_states import (
    ALLOWED,
    FORGETS_SESSION,
    FORGETS_TRANSACTION,
    ON_ACCEPT,
    TRANSITIONS,
    State,
    Step,
    TransitionHook,
)

# The connection; its table (mta.smtp.server_states) and its events (mta.smtp.server_events) are offered here too.
__all__ = [
    "END_OF_DATA", "TRANSITIONS", "AuthRequest", "ConnectionClosed", "DataAborted", "DataChunk", "DataCommand",
    "DataStart", "Decision", "Ehlo", "EndOfData", "Event", "Helo", "MailFrom", "NeedData", "Quit", "RcptTo",
    "RejectHook", "Rejection", "Rset", "ServerConnection", "StartTls", "State", "Step", "TransitionHook",
]

class ServerConnection:
    """One SMTP server session. The greeting is queued by the constructor.

    Options: ``hostname`` (greeting, EHLO), ``max_message_size`` (SIZE, 552),
    ``max_line_length`` (content lines incl. CRLF), ``max_recipients``,
    ``max_errors`` (core-detected 5xx before 421), ``normalize_bare_lf``,
    ``tls_available`` (offer STARTTLS), ``tls_active`` (implicit TLS),
    ``auth`` (offer AUTH PLAIN LOGIN, once TLS is active: RFC 4954 §4 and
    RFC 8314; before it AUTH gets ``538 5.7.11``), ``require_auth`` (MAIL
    needs STARTTLS and AUTH first: a submission port, ``530 5.7.0``),
    ``auth_without_tls`` (AUTH over plaintext: for tests of this table only),
    ``chunking`` (offer CHUNKING and take BDAT; without it BDAT is ``502``),
    ``decide_data`` (DATA is a ``DataCommand`` decision: the 354 waits for accept()),
    ``on_transition`` (told of every step; see ``TransitionHook``),
    ``on_reject`` (told of every 4xx/5xx reply; see ``Rejection``).

    Raises: ``LocalProtocolError`` when the shell calls a method at the wrong
    time. Malformed input from the client never raises; it is answered.
    """

    def __init__(
        self,
        hostname: str,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_line_length: int = MAX_TEXT_LINE,
        max_recipients: int = DEFAULT_MAX_RECIPIENTS,
        max_errors: int = DEFAULT_MAX_ERRORS,
        normalize_bare_lf: bool = False,
        tls_available: bool = False,
        tls_active: bool = False,
        auth: bool = False,
        require_auth: bool = False,
        auth_without_tls: bool = False,
        chunking: bool = True,
        decide_data: bool = False,
        greeting: str = "ESMTP logspool",
        on_transition: TransitionHook | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        self.hostname = hostname
        self.max_message_size = max_message_size
        self.max_line_length = max_line_length
        self.max_recipients = max_recipients
        self.max_errors = max_errors
        self.normalize_bare_lf = normalize_bare_lf
        self.tls_available = tls_available
        self.tls_active = tls_active
        self.auth = auth
        self.require_auth = require_auth
        self.auth_without_tls = auth_without_tls
        self.chunking = chunking
        self.decide_data = decide_data
        self._exchange: SaslExchange | None = None
        self._authenticated: str | None = None
        self._state = State.CONNECTED
        self._on_transition = on_transition
        self._on_reject = on_reject
        self._command = "-"  # the command being answered, for Rejection
        self._argument = ""
        self.errors = 0
        self._input = InputBuffer()
        self._out = bytearray()
        self._pending: Decision | None = None
        self._queued: list[Event] = []
        self._decoder = ContentDecoder(max_message_size, max_line_length, normalize_bare_lf)
        self._chunks: ChunkDecoder | None = None  # the BDAT transaction's content
        self._chunk: BdatCommand | None = None  # the chunk being read
        self._chunk_left = 0  # its octets still to come
        self._discard = 0  # octets of a refused BDAT still to drop before the next command
        self._helo: str | None = None
        self._esmtp = False
        self._rcpt_count = 0
        self._smtputf8 = False
        self._reset_session()
        self._send(replies.greeting(hostname, greeting))

    # -------------------------------------------------------------- I/O side

    def receive_data(self, data: bytes | bytearray) -> None:
        """Bytes from the peer; ``b""`` means EOF. Ignored once closed or in STARTTLS."""
        if self._state not in (State.CLOSED, State.TLS):
            self._input.feed(data)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    @property
    def state(self) -> State:
        """Where the session is; it changes only by a step of ``TRANSITIONS``."""
        return self._state

    @property
    def command_lines(self) -> int:
        """Command lines consumed so far: the shell starts a command's deadline when it grows."""
        return self._input.lines

    @property
    def esmtp(self) -> bool:
        return self._esmtp

    @property
    def helo_name(self) -> str | None:
        return self._helo

    @property
    def authenticated(self) -> str | None:
        """The user name an accepted AUTH proved, kept until TLS starts afresh (never, in practice)."""
        return self._authenticated

    @property
    def pending(self) -> Decision | None:
        """The event waiting for accept()/reject(), if any."""
        return self._pending

    # -------------------------------------------------------------- decisions

    def accept(self, reply: Reply | None = None) -> None:
        """Say yes to the pending event; ``reply`` overrides the default 2xx."""
        ev = self._take_pending()
        reply = reply or replies.DEFAULT_ACCEPT[type(ev)]
        if not reply.is_positive:
            raise LocalProtocolError(f"accept() with a negative reply {reply}")
        self._send(reply)
        self._fire(ON_ACCEPT[type(ev)])
        if isinstance(ev, RcptTo):
            self._rcpt_count += 1
        elif isinstance(ev, AuthRequest):
            self._authenticated = ev.username
        elif isinstance(ev, StartTls):
            self._input.clear()  # CVE-2011-0411: nothing sent in plaintext after STARTTLS may be obeyed
        elif isinstance(ev, DataCommand):
            self._start_content()
            self._emit(DataStart())

    def reject(self, reply: Reply, reason: str = "policy") -> None:
        """Say no to the pending event with a 4xx/5xx ``reply``; ``reason`` is the ``Rejection``'s."""
        if reply.is_positive:
            raise LocalProtocolError(f"reject() with a positive reply {reply}")
        ev = self._take_pending()
        self._refuse(reply, reason)
        if isinstance(ev, EndOfData):  # the content is gone either way: the transaction ends
            self._fire(Step.MESSAGE_REJECTED)
        elif isinstance(ev, AuthRequest):
            self._fire(Step.AUTH_FAILED)

    def tls_started(self) -> None:
        """The TLS handshake is done: a fresh session, the client must EHLO again.

        Raises ``LocalProtocolError`` unless a STARTTLS was accepted.
        """
        self._fire(Step.TLS_STARTED)
        self.tls_active = True
        self._authenticated = None
        self._input.clear()

    def _fire(self, step: Step) -> None:
        """Take ``step`` from the current state: the one place the state changes.

        Raises ``LocalProtocolError`` if ``TRANSITIONS`` has no such step from
        here (a bug in this module or a shell calling at the wrong time).
        """
        old = self._state
        new = TRANSITIONS[old].get(step)
        if new is None:
            raise LocalProtocolError(f"no step {step.name} ({step.value}) from state {old.name}")
        self._state = new
        if step in FORGETS_SESSION:
            self._reset_session()
        elif step in FORGETS_TRANSACTION:
            self._reset_transaction()
        if self._on_transition is not None:
            self._on_transition(old, step, new)

    def _take_pending(self) -> Decision:
        ev = self._pending
        if ev is None:
            raise LocalProtocolError("no event is waiting for a decision")
        self._pending = None
        return ev

    # -------------------------------------------------------------- events

    def next_event(self) -> Event:
        """The next thing that happened; ``NeedData`` when input is exhausted.

        Raises ``LocalProtocolError`` while a decision is pending or STARTTLS
        waits for ``tls_started()``.
        """
        if self._pending is not None:
            raise LocalProtocolError(f"{type(self._pending).__name__} is waiting for accept() or reject()")
        if self._state is State.TLS:
            raise LocalProtocolError("STARTTLS accepted: do the handshake, then call tls_started()")
        ev: Event | None = None
        while ev is None:
            if self._queued:
                ev = self._queued.pop(0)
            elif self._state is State.CLOSED:
                ev = ConnectionClosed()
            elif self._state is State.DATA:
                ev = self._data_event()
            elif self._state is State.AUTH:
                ev = self._auth_event()
            elif self._chunk is not None:
                ev = self._chunk_event()
            else:
                ev = self._command_event()
        if isinstance(ev, Decision):  # the union built once (server_events), not at every call
            self._pending = ev
        return ev

    def _emit(self, *events: Event) -> None:
        self._queued.extend(events)

    # -------------------------------------------------------------- commands

    def _command_event(self) -> Event | None:
        """Consume one command line; return its event, None if only answered."""
        self._command, self._argument = "-", ""
        if self._discard and not self._drop():
            return self._at_eof()
        line = self._input.line(MAX_COMMAND_LINE)
        if line is Cut.MORE:
            return self._at_eof()
        if line is Cut.TOO_LONG:
            self._error(replies.R_LINE_TOO_LONG, "line_too_long")
            return None
        if line is Cut.BARE_NEWLINE:
            self._error(replies.R_BARE_NEWLINE, "bare_newline")
            return None
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            self._error(replies.R_BAD_UTF8, "encoding")
            return None
        verb, _, arg = text.partition(" ")
        verb = verb.upper()
        # AUTH's argument after the mechanism is a credential: never kept for the log.
        self._command, self._argument = verb[:16], (arg.split(" ")[0] if verb == "AUTH" else arg)[:ARGUMENT_SHOWN]
        allowed = ALLOWED.get(verb)
        if allowed is None:
            if verb == "EXPN":
                self._error(replies.R_NOT_IMPLEMENTED, "not_implemented")
            else:
                self._error(replies.R_UNKNOWN, "unknown_command")
            return None
        if self._state not in allowed:
            self._error(replies.out_of_sequence(verb), "sequence")
            return None
        try:
            return self._dispatch(verb, arg)
        except RemoteProtocolError as e:
            self._error(e.reply, "control_character" if "control character" in str(e) else "syntax")
            return None

    def _at_eof(self) -> Event:
        if self._input.eof:
            in_chunks = self._state is State.CHUNKS
            self._fire(Step.EOF)
            if in_chunks:  # between chunks: the content so far is dropped, as in the middle of one
                self._emit(ConnectionClosed())
                return DataAborted(None)
            return ConnectionClosed()
        return NeedData()

    def _dispatch(self, verb: str, arg: str) -> Event | None:
        if verb not in ("MAIL", "RCPT") and has_control(arg):  # MAIL and RCPT say where (address or parameter)
            raise RemoteProtocolError("control character", replies.R_CONTROL_IN_ARGUMENT)
        if verb in ("EHLO", "HELO"):
            return self._hello(verb, arg)
        if verb in ("RSET", "QUIT", "DATA", "STARTTLS") and arg.strip(" "):
            raise RemoteProtocolError("no argument allowed", replies.no_argument(verb))
        if verb == "NOOP":
            self._send(replies.R_OK)
        elif verb == "HELP":
            self._send(replies.R_HELP)
        elif verb == "VRFY":
            if not arg.strip(" "):
                raise RemoteProtocolError("VRFY needs an argument", replies.R_VRFY_SYNTAX)
            self._send(replies.R_VRFY)
        elif verb == "RSET":
            self._send(replies.R_OK)
            self._fire(Step.RSET)
            return Rset()
        elif verb == "QUIT":
            self._send(replies.R_BYE)
            self._fire(Step.QUIT)
            return Quit()
        elif verb == "MAIL":
            return self._mail(arg)
        elif verb == "RCPT":
            return self._rcpt(arg)
        elif verb == "DATA":
            return self._data()
        elif verb == "BDAT" and not self.chunking:
            self._error(replies.R_NOT_IMPLEMENTED, "not_implemented")
        elif verb == "BDAT":
            return self._bdat(arg)
        elif verb == "STARTTLS":
            return self._starttls()
        elif verb == "AUTH":
            return self._auth(arg)
        return None

    def _hello(self, verb: str, arg: str) -> Event:
        words = arg.split()
        if not words:
            raise RemoteProtocolError("bad hello", replies.hello_syntax(verb))
        name = words[0]
        self._fire(Step.HELLO)
        self._helo = name
        if verb == "HELO":
            self._send(replies.helo(self.hostname))
            return Helo(name)
        self._esmtp = True
        auth = self.auth and (self.tls_active or self.auth_without_tls)
        self._send(replies.ehlo(self.hostname, self.max_message_size, self.tls_available and not self.tls_active, auth,
                                self.chunking))
        return Ehlo(name)

    def _mail(self, arg: str) -> Event | None:
        if self.require_auth and self._authenticated is None:
            self._error(replies.R_AUTH_REQUIRED if self.tls_active else replies.R_STARTTLS_FIRST, "auth_required")
            return None
        ev = mail_from(arg, esmtp=self._esmtp, max_message_size=self.max_message_size)
        if isinstance(ev, Refusal):
            self._refuse(ev.reply, ev.reason)
            return None
        self._smtputf8 = "SMTPUTF8" in ev.params
        return ev

    def _rcpt(self, arg: str) -> Event | None:
        ev = rcpt_to(arg, smtputf8=self._smtputf8)
        if self._rcpt_count >= self.max_recipients:
            self._refuse(replies.R_TOO_MANY_RCPTS, "too_many_recipients")  # not an error: the client retries later
            return None
        return ev

    def _data(self) -> Event | None:
        if self._state is State.MAIL:
            self._refuse(replies.R_NO_RCPT, "no_recipients")
            return None
        if self.decide_data:
            return DataCommand()
        self._send(replies.R_DATA_GO)
        self._fire(Step.DATA_STARTED)
        self._start_content()
        return DataStart()

    def _start_content(self) -> None:
        self._decoder = ContentDecoder(self.max_message_size, self.max_line_length, self.normalize_bare_lf)

    def _bdat(self, arg: str) -> Event | None:
        """``BDAT size [LAST]``: a chunk to read, or (no transaction with a recipient, a size past the limit)
        a refusal and its octets dropped. A BDAT without a usable size is a syntax error: nothing to drop."""
        cmd = parse_bdat(arg)
        started = self._state is State.RCPT
        if started:
            self._fire(Step.BDAT_STARTED)
            self._chunks = ChunkDecoder(self.max_message_size, self.max_line_length, self.normalize_bare_lf)
            self._decoder = self._chunks.decoder
        elif self._state is not State.CHUNKS:
            self._discard = cmd.size
            if self._state is State.MAIL:
                self._refuse(replies.R_NO_RCPT, "no_recipients")
            else:
                self._error(replies.out_of_sequence("BDAT"), "sequence")
            return None
        if self._decoder.size + cmd.size > self.max_message_size:  # refused now, not after reading it all
            self._discard = cmd.size
            aborted = self._refuse_content(R_TOO_BIG)
            if not started:
                return aborted
            self._emit(aborted)
        else:
            self._chunk, self._chunk_left = cmd, cmd.size
        return DataStart() if started else None

    def _chunk_event(self) -> Event | None:
        """Consume a chunk's octets as they come (at most ``DATA_CHUNK_SIZE`` at a time); at its end, answer it
        (a chunk before the LAST) or end the content (the LAST)."""
        chunk, chunks, inp = self._chunk, self._chunks, self._input
        assert chunk is not None and chunks is not None
        take = min(len(inp.buf) - inp.pos, self._chunk_left, DATA_CHUNK_SIZE)
        content = b""
        if take:
            content = chunks.feed(bytes(memoryview(inp.buf)[inp.pos : inp.pos + take]))
            inp.pos += take
            self._chunk_left -= take
        elif self._chunk_left:
            if inp.eof:
                self._fire(Step.EOF)
                self._emit(ConnectionClosed())
                return DataAborted(None)
            return NeedData()
        if not self._chunk_left:
            self._chunk = None
            if chunk.last:
                content += chunks.end()
                self._emit(self._finish_data())
            elif self._decoder.refusal is not None:
                self._command = END_OF_DATA
                self._emit(self._refuse_content(self._decoder.refusal))
            else:
                self._send(replies.chunk_received(chunk.size))
        return DataChunk(content) if content else None

    def _refuse_content(self, reply: Reply) -> Event:
        """The content is doomed before its end: the refusal now, and the transaction is over."""
        self._refuse(reply, replies.CONTENT_REASONS.get(reply, "content"))
        self._fire(Step.MESSAGE_REFUSED)
        return DataAborted(reply)

    def _drop(self) -> bool:
        """Drop what is here of a refused chunk's octets; True once they are all gone."""
        inp = self._input
        take = min(len(inp.buf) - inp.pos, self._discard)
        inp.pos += take
        self._discard -= take
        return not self._discard

    def _starttls(self) -> Event | None:
        if self.tls_active:
            self._error(replies.R_TLS_ACTIVE, "sequence")
            return None
        if not self.tls_available:
            self._error(replies.R_NO_TLS, "tls_unavailable")
            return None
        return StartTls()

    # -------------------------------------------------------------- AUTH (RFC 4954)

    def _auth(self, arg: str) -> Event | None:
        """``AUTH mechanism [initial-response]``: refused here, or an exchange begins (``mta.smtp.sasl``)."""
        refusal = (replies.R_NO_AUTH if not self.auth else
                   replies.R_ENCRYPTION_REQUIRED if not (self.tls_active or self.auth_without_tls) else
                   replies.R_ALREADY_AUTHENTICATED if self._authenticated is not None else
                   replies.R_EHLO_FIRST if not self._esmtp else None)
        if refusal is not None:
            self._error(refusal, "auth_refused")
            return None
        exchange, outcome = start_sasl(arg)
        if isinstance(outcome, Failed):  # no exchange began: the state stays
            self._error(outcome.reply, outcome.reason)
            return None
        self._exchange = exchange
        self._fire(Step.AUTH_STARTED)
        return self._sasl(outcome)

    def _auth_event(self) -> Event | None:
        """Consume one response line of the exchange (at most ``MAX_SASL_LINE`` bytes before its CRLF)."""
        self._command, self._argument = "AUTH", ""  # a response is a credential: never kept for the log
        line = self._input.line(MAX_SASL_LINE + 2)
        if line is Cut.MORE:
            return self._at_eof()
        if line is Cut.TOO_LONG:  # the rest is discarded as the next command line would be
            return self._sasl(Failed(R_SASL_LINE_TOO_LONG, "auth_line_too_long"))
        if line is Cut.BARE_NEWLINE:
            return self._sasl(Failed(replies.R_BARE_NEWLINE, "bare_newline"))
        assert self._exchange is not None
        return self._sasl(self._exchange.respond(line))

    def _sasl(self, outcome: Challenge | Credentials | Failed) -> Event | None:
        """Act on an exchange's outcome, in state AUTH: ask again, hand the credentials over, or end it."""
        if isinstance(outcome, Challenge):
            self._send(outcome.reply)
            return None
        self._exchange = None
        if isinstance(outcome, Credentials):
            return AuthRequest(outcome.mechanism, outcome.username, outcome.password)
        self._fire(Step.AUTH_ABORTED)
        self._error(outcome.reply, outcome.reason)
        return None

    # -------------------------------------------------------------- content

    def _data_event(self) -> Event | None:
        """Consume content until a chunk is full, input runs out, or it ends."""
        dec, inp = self._decoder, self._input
        inp.pos, chunk, done = dec.decode(inp.buf, inp.pos, DATA_CHUNK_SIZE)
        if chunk:
            if done:
                self._emit(self._finish_data())
            return DataChunk(chunk)
        if done:
            return self._finish_data()
        if self._input.eof:
            self._fire(Step.EOF)
            self._emit(ConnectionClosed())
            return DataAborted(None)
        return NeedData()

    def _finish_data(self) -> Event:
        self._command, self._argument = END_OF_DATA, ""
        doom = self._decoder.refusal
        if doom is not None:
            self._refuse(doom, replies.CONTENT_REASONS.get(doom, "content"))
            self._fire(Step.MESSAGE_REFUSED)
            return DataAborted(doom)
        return EndOfData(self._decoder.size)

    # -------------------------------------------------------------- helpers

    def _send(self, reply: Reply) -> None:
        self._out += replies.wire(reply)

    def _refuse(self, reply: Reply, reason: str) -> None:
        """Send a 4xx/5xx ``reply`` and tell ``on_reject`` why."""
        self._send(reply)
        if self._on_reject is not None:
            self._on_reject(Rejection(self._command, self._argument, reply, reason))

    def _error(self, reply: Reply, reason: str) -> None:
        """A client mistake the core caught; too many of them end the session."""
        self._refuse(reply, reason)
        self.errors += 1
        if self.errors >= self.max_errors:
            self._refuse(replies.R_TOO_MANY_ERRORS, "too_many_errors")
            self._fire(Step.TOO_MANY_ERRORS)

    def _reset_transaction(self) -> None:
        self._rcpt_count = 0
        self._smtputf8 = False
        self._chunks = None
        self._chunk = None
        self._chunk_left = 0

    def _reset_session(self) -> None:
        self._helo = None
        self._esmtp = False
        self._reset_transaction()
