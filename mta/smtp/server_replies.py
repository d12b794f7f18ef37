"""The SMTP server core's replies (``mta.smtp.server``): their codes, enhanced status codes and texts.

Kept in one place so that what a client reads can be reviewed at once:
every 2xx/4xx/5xx reply has an enhanced status code (RFC 2034 §3 excludes
only the greeting and the replies to HELO/EHLO), and none carries a
client's bytes as they came. The AUTH exchange's own replies are
``mta.smtp.sasl``'s; those about message content are ``mta.smtp.common``'s,
beside the decoder that finds what they refuse.
"""

from __future__ import annotations

import functools
from typing import Final

from mta.smtp.common import R_DATA_BARE_NEWLINE, R_DATA_LONG_LINE, R_DATA_NUL, R_TOO_BIG, Reply
from mta.smtp.sasl import R_AUTH_OK
from mta.smtp.server_events import AuthRequest, DataCommand, Decision, EndOfData, MailFrom, RcptTo, StartTls

R_OK: Final = Reply(250, "2.0.0", "Ok")
R_BYE: Final = Reply(221, "2.0.0", "Bye")
R_HELP: Final = Reply(214, "2.0.0", "Commands: EHLO HELO MAIL RCPT DATA BDAT RSET NOOP QUIT VRFY STARTTLS")
R_VRFY: Final = Reply(252, "2.0.0", "Cannot VRFY user, but will accept message and attempt delivery")
R_VRFY_SYNTAX: Final = Reply(501, "5.5.4", "Syntax: VRFY address")
R_TOO_MANY_ERRORS: Final = Reply(421, "4.7.0", "Too many errors, closing connection")
R_LINE_TOO_LONG: Final = Reply(500, "5.5.2", "Line too long")
R_BARE_NEWLINE: Final = Reply(500, "5.5.2", "Bare CR or LF not allowed; use CRLF")
R_BAD_UTF8: Final = Reply(500, "5.5.2", "Invalid UTF-8 in command")
R_UNKNOWN: Final = Reply(500, "5.5.1", "Command unrecognized")
R_NOT_IMPLEMENTED: Final = Reply(502, "5.5.1", "Command not implemented")
R_NO_RCPT: Final = Reply(554, "5.5.1", "No valid recipients")
R_TOO_MANY_RCPTS: Final = Reply(452, "4.5.3", "Too many recipients")
R_NEED_UTF8: Final = Reply(553, "5.6.7", "Non-ASCII address needs SMTPUTF8")
R_PARAMS_NEED_EHLO: Final = Reply(555, "5.5.4", "Parameters need EHLO")
R_DATA_GO: Final = Reply(354, None, "End data with <CR><LF>.<CR><LF>")
R_CONTROL_IN_ARGUMENT: Final = Reply(501, "5.5.4", "Control character in argument")
R_TLS_ACTIVE: Final = Reply(503, "5.5.1", "TLS already active")
R_NO_TLS: Final = Reply(502, "5.5.1", "STARTTLS not available")
R_NO_AUTH: Final = Reply(502, "5.5.1", "AUTH not available on this port")
R_ENCRYPTION_REQUIRED: Final = Reply(538, "5.7.11", "Encryption required for requested authentication mechanism")
R_ALREADY_AUTHENTICATED: Final = Reply(503, "5.5.1", "Already authenticated")
R_EHLO_FIRST: Final = Reply(503, "5.5.1", "Send EHLO first")
R_STARTTLS_FIRST: Final = Reply(530, "5.7.0", "Must issue a STARTTLS command first")
R_AUTH_REQUIRED: Final = Reply(530, "5.7.0", "Authentication required")

# What accept() sends when the shell names no reply of its own.
DEFAULT_ACCEPT: Final[dict[type[Decision], Reply]] = {
    MailFrom: Reply(250, "2.1.0", "Ok"),
    RcptTo: Reply(250, "2.1.5", "Ok"),
    DataCommand: R_DATA_GO,
    EndOfData: Reply(250, "2.0.0", "Ok: queued"),
    StartTls: Reply(220, "2.0.0", "Ready to start TLS"),
    AuthRequest: R_AUTH_OK,
}
# Why the content was refused at its end (the Rejection's reason), by the reply the decoder chose.
CONTENT_REASONS: Final = {R_TOO_BIG: "size", R_DATA_BARE_NEWLINE: "bare_newline", R_DATA_LONG_LINE: "line_too_long",
                          R_DATA_NUL: "nul"}
_SEQUENCE_HINT: Final = {
    "MAIL": "Send HELO/EHLO first, and only one MAIL per transaction",
    "RCPT": "Need MAIL before RCPT",
    "DATA": "Need MAIL and RCPT before DATA, and no DATA after BDAT",
    "BDAT": "Need MAIL and RCPT before BDAT",
    "STARTTLS": "STARTTLS only after EHLO and outside a transaction",
    "AUTH": "AUTH only after EHLO and outside a transaction",
}


def out_of_sequence(verb: str) -> Reply:
    """``503 5.5.1`` for a command heard in a state that does not take it, with a hint where there is one."""
    return Reply(503, "5.5.1", _SEQUENCE_HINT.get(verb, "Bad sequence of commands"))


def no_argument(verb: str) -> Reply:
    """``501 5.5.4`` for an argument to a command that takes none (``verb`` is one of ours, never the client's)."""
    return Reply(501, "5.5.4", f"Syntax: {verb}")


@functools.lru_cache(maxsize=64)
def greeting(hostname: str, text: str) -> Reply:
    """The ``220`` greeting (one per configuration: built and encoded once)."""
    return _remember(Reply(220, None, f"{hostname} {text}"))


@functools.lru_cache(maxsize=64)
def helo(hostname: str) -> Reply:
    """The ``250`` to HELO."""
    return _remember(Reply(250, None, hostname))


@functools.lru_cache(maxsize=64)
def ehlo(hostname: str, max_message_size: int, starttls: bool, auth: bool, chunking: bool = True) -> Reply:
    """The ``250`` to EHLO with the extensions offered (STARTTLS before TLS; AUTH over TLS only, RFC 4954 §4).

    One per configuration and port: built and encoded once.
    """
    caps = ["PIPELINING", f"SIZE {max_message_size}", "8BITMIME", "SMTPUTF8", "ENHANCEDSTATUSCODES", "DSN"]
    if chunking:
        caps.append("CHUNKING")
    if starttls:
        caps.append("STARTTLS")
    if auth:
        caps.append("AUTH PLAIN LOGIN")
    return _remember(Reply(250, None, "\n".join([hostname, *caps])))


def chunk_received(size: int) -> Reply:
    """The ``250`` to a BDAT chunk that is not the LAST (RFC 3030 §2)."""
    return Reply(250, "2.0.0", f"{size} octets received")


def hello_syntax(verb: str) -> Reply:
    return Reply(501, "5.5.4", f"Syntax: {verb} hostname")


# -- wire forms ---------------------------------------------------------------------------------------

# The bytes of the replies a session sends again and again (the constants above, the default accepts, the
# greetings and EHLO replies of the configuration): ``Reply.to_bytes`` once each, not at every command
# (a lone client's seven replies a message). Bounded: replies built per message are not kept.
_WIRE: dict[Reply, bytes] = {}
_WIRE_MAX = 512


def _remember(reply: Reply) -> Reply:
    if len(_WIRE) < _WIRE_MAX:
        _WIRE[reply] = reply.to_bytes()
    return reply


def wire(reply: Reply) -> bytes:
    """``reply.to_bytes()``, from memory for the replies kept there."""
    out = _WIRE.get(reply)
    return reply.to_bytes() if out is None else out


for _reply in [*(v for v in list(globals().values()) if isinstance(v, Reply)), *DEFAULT_ACCEPT.values()]:
    _remember(_reply)
