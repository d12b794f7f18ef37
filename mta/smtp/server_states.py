"""The SMTP server core's table (``mta.smtp.server``): its states, the steps between them and ``TRANSITIONS``.

Beside the table: what a step makes the session forget, the states each command is heard in, and the step an
accepted decision takes. ``ServerConnection._fire`` is the only place the state changes, and only by this table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from mta.smtp.common import TableKey
from mta.smtp.server_events import AuthRequest, DataCommand, Decision, EndOfData, MailFrom, RcptTo, StartTls


class State(TableKey):
    """Where the session is: the rows of ``TRANSITIONS``."""

    CONNECTED = "connected"  # greeted (or TLS just started), no HELO/EHLO yet
    IDLE = "idle"  # HELO/EHLO done, no transaction
    MAIL = "mail"  # sender accepted, no recipient yet
    RCPT = "rcpt"  # at least one recipient accepted
    DATA = "data"  # reading content
    TLS = "tls"  # STARTTLS accepted, waiting for tls_started()
    AUTH = "auth"  # in an AUTH exchange: lines are SASL responses (mta.smtp.sasl), or an AuthRequest is pending
    CHUNKS = "chunks"  # a BDAT transaction: a chunk's octets, or between chunks a command
    CLOSED = "closed"  # nothing more is read or answered


class Step(TableKey):
    """What moves the session between states: the columns of ``TRANSITIONS``."""

    HELLO = "HELO or EHLO answered 250"
    MAIL_ACCEPTED = "accept() of MailFrom"
    RCPT_ACCEPTED = "accept() of RcptTo"
    DATA_STARTED = "DATA answered 354"
    BDAT_STARTED = "the first BDAT of a transaction with a recipient"
    MESSAGE_ACCEPTED = "accept() of EndOfData"
    MESSAGE_REJECTED = "reject() of EndOfData"
    MESSAGE_REFUSED = "the core refused the content at its end (size, long line, bare CR/LF, NUL)"
    RSET = "RSET answered 250"
    STARTTLS_ACCEPTED = "accept() of StartTls"
    TLS_STARTED = "tls_started() after the handshake"
    AUTH_STARTED = "AUTH answered 334, or its initial response completed the credentials"
    AUTH_SUCCEEDED = "accept() of AuthRequest, 235 sent"
    AUTH_FAILED = "reject() of AuthRequest"
    AUTH_ABORTED = "the exchange ended without credentials: cancel, not base64, too long, malformed"
    QUIT = "QUIT answered 221"
    TOO_MANY_ERRORS = "the error limit reached, 421 sent"
    EOF = "the peer closed its side"


# The state machine, whole: the only way the state changes (ServerConnection._fire).
TRANSITIONS: Final[Mapping[State, Mapping[Step, State]]] = {
    State.CONNECTED: {
        Step.HELLO: State.IDLE,
        Step.RSET: State.CONNECTED,  # no HELO yet, and RSET is no substitute for one
        Step.QUIT: State.CLOSED,
        Step.TOO_MANY_ERRORS: State.CLOSED,
        Step.EOF: State.CLOSED,
    },
    State.IDLE: {
        Step.HELLO: State.IDLE,
        Step.MAIL_ACCEPTED: State.MAIL,
        Step.STARTTLS_ACCEPTED: State.TLS,
        Step.AUTH_STARTED: State.AUTH,
        Step.RSET: State.IDLE,
        Step.QUIT: State.CLOSED,
        Step.TOO_MANY_ERRORS: State.CLOSED,
        Step.EOF: State.CLOSED,
    },
    State.MAIL: {
        Step.HELLO: State.IDLE,
        Step.RCPT_ACCEPTED: State.RCPT,
        Step.RSET: State.IDLE,
        Step.QUIT: State.CLOSED,
        Step.TOO_MANY_ERRORS: State.CLOSED,
        Step.EOF: State.CLOSED,
    },
    State.RCPT: {
        Step.HELLO: State.IDLE,
        Step.RCPT_ACCEPTED: State.RCPT,
        Step.DATA_STARTED: State.DATA,
        Step.BDAT_STARTED: State.CHUNKS,
        Step.RSET: State.IDLE,
        Step.QUIT: State.CLOSED,
        Step.TOO_MANY_ERRORS: State.CLOSED,
        Step.EOF: State.CLOSED,
    },
    State.DATA: {  # only the end of the content, or of the connection, leaves it: no command is read here
        Step.MESSAGE_ACCEPTED: State.IDLE,
        Step.MESSAGE_REJECTED: State.IDLE,
        Step.MESSAGE_REFUSED: State.IDLE,
        Step.EOF: State.CLOSED,
    },
    State.CHUNKS: {  # the end of the content, or a command between chunks that ends the transaction
        Step.MESSAGE_ACCEPTED: State.IDLE,
        Step.MESSAGE_REJECTED: State.IDLE,
        Step.MESSAGE_REFUSED: State.IDLE,
        Step.HELLO: State.IDLE,
        Step.RSET: State.IDLE,
        Step.QUIT: State.CLOSED,
        Step.TOO_MANY_ERRORS: State.CLOSED,
        Step.EOF: State.CLOSED,
    },
    State.TLS: {  # input is ignored until the handshake is done
        Step.TLS_STARTED: State.CONNECTED,
    },
    State.AUTH: {  # no command is read here: each line is a response, until the exchange ends
        Step.AUTH_SUCCEEDED: State.IDLE,
        Step.AUTH_FAILED: State.IDLE,
        Step.AUTH_ABORTED: State.IDLE,
        Step.EOF: State.CLOSED,
    },
    State.CLOSED: {},
}
# What a step makes the session forget, from whichever state it fires: the
# transaction (recipient count, SMTPUTF8), or the whole session (also the
# HELO name and ESMTP). RFC 5321 §4.1.4: HELO/EHLO reset like RSET; RFC 3207
# §4.2: after the handshake the client starts again with EHLO.
FORGETS_SESSION: Final = frozenset({Step.HELLO, Step.TLS_STARTED})
FORGETS_TRANSACTION: Final = frozenset(
    {Step.RSET, Step.MESSAGE_ACCEPTED, Step.MESSAGE_REJECTED, Step.MESSAGE_REFUSED}
)

COMMAND_STATES: Final = frozenset({State.CONNECTED, State.IDLE, State.MAIL, State.RCPT, State.CHUNKS})
# Commands and the states they are heard in; elsewhere they get 503 5.5.1.
ALLOWED: Final[dict[str, frozenset[State]]] = {
    "EHLO": COMMAND_STATES,
    "HELO": COMMAND_STATES,
    "MAIL": frozenset({State.IDLE}),
    "RCPT": frozenset({State.MAIL, State.RCPT}),
    "DATA": frozenset({State.MAIL, State.RCPT}),  # in MAIL: 554, no recipient was accepted
    "BDAT": COMMAND_STATES,  # without a recipient: refused, and its octets dropped
    "RSET": COMMAND_STATES,
    "NOOP": COMMAND_STATES,
    "HELP": COMMAND_STATES,
    "VRFY": COMMAND_STATES,
    "QUIT": COMMAND_STATES,
    "STARTTLS": frozenset({State.IDLE}),
    "AUTH": frozenset({State.IDLE}),
}
# Told of every step taken: (from, step, to). For tests and tracing; it must not call back into the connection.
TransitionHook = Callable[[State, Step, State], None]


# The step an accepted decision takes.
ON_ACCEPT: Final[dict[type[Decision], Step]] = {
    MailFrom: Step.MAIL_ACCEPTED,
    RcptTo: Step.RCPT_ACCEPTED,
    DataCommand: Step.DATA_STARTED,
    EndOfData: Step.MESSAGE_ACCEPTED,
    StartTls: Step.STARTTLS_ACCEPTED,
    AuthRequest: Step.AUTH_SUCCEEDED,
}
