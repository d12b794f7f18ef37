"""What the SMTP server core (``mta.smtp.server``) hands its shell: one small frozen class per event.

Five of them are decisions (``Decision``), six when the shell asked to decide
DATA (``DataCommand``): the core reads no further input until the shell
answers them with ``accept()`` or ``reject()``. The rest are
news, already answered by the core, or requests to send and read
(``NeedData``) or to close (``Quit``, ``ConnectionClosed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import attrs

from mta.smtp.addresses import Params
from mta.smtp.common import Reply

ARGUMENT_SHOWN: Final = 200  # characters of a refused command's argument kept in its Rejection
END_OF_DATA: Final = "END-OF-DATA"  # the Rejection's command for the answer to the content


@attrs.frozen
class Ehlo:
    """The client said EHLO; any open transaction is gone. Already answered."""

    name: str


@attrs.frozen
class Helo:
    """The client said HELO (no ESMTP); any open transaction is gone. Already answered."""

    name: str


@attrs.frozen
class MailFrom:
    """Needs accept()/reject(). ``address`` is ``""`` for the null sender."""

    address: str
    params: Params = attrs.field(factory=dict)


@attrs.frozen
class RcptTo:
    """Needs accept()/reject()."""

    address: str
    params: Params = attrs.field(factory=dict)


@attrs.frozen
class DataCommand:
    """DATA, before its 354 (only with ``decide_data``): needs accept()/reject().

    Why: a filter may refuse the message at DATA (a milter's DATA stage, as
    Postfix asks it), and that refusal must come instead of the 354, before
    the client sends the content. accept() sends the 354 and ``DataStart``
    follows; reject() leaves the transaction as it was, with its recipients.
    """


@attrs.frozen
class DataStart:
    """354 was sent; content follows as DataChunk events."""


@attrs.frozen
class DataChunk:
    """Dot-unstuffed content with CRLF line ends, at most DATA_CHUNK_SIZE bytes."""

    data: bytes


@attrs.frozen
class EndOfData:
    """The message is complete and acceptable so far; needs accept()/reject().

    accept() only after the message is durable: that sends the 250.
    """

    size: int


@attrs.frozen
class DataAborted:
    """Discard what was written of this message.

    ``reply`` is what the core answered (size, bare LF, long line), or None
    when the connection ended in the middle of the content.
    """

    reply: Reply | None


@attrs.frozen
class Rset:
    """The transaction was reset; already answered."""


@attrs.frozen
class StartTls:
    """Needs accept() (sends 220, then do the handshake and call tls_started()) or reject()."""


@attrs.frozen
class AuthRequest:
    """A complete AUTH exchange (mta.smtp.sasl): needs accept() (235, the session is authenticated) or reject().

    The core has checked the form only; whether the password is right is the shell's to find out.
    """

    mechanism: str
    username: str
    password: str = attrs.field(repr=False)


@attrs.frozen
class Quit:
    """221 was queued; send data_to_send() and close."""


@attrs.frozen
class ConnectionClosed:
    """The session is over (QUIT, too many errors, or EOF); close the socket."""


@attrs.frozen
class NeedData:
    """Send data_to_send(), then read and call receive_data()."""


Event = (
    Ehlo
    | Helo
    | MailFrom
    | RcptTo
    | DataCommand
    | DataStart
    | DataChunk
    | EndOfData
    | DataAborted
    | Rset
    | StartTls
    | AuthRequest
    | Quit
    | ConnectionClosed
    | NeedData
)
Decision = MailFrom | RcptTo | DataCommand | EndOfData | StartTls | AuthRequest


@attrs.frozen
class Rejection:
    """A 4xx/5xx reply the session sent, whoever decided it (the core, or the shell's ``reject``).

    ``command``: the verb as the client wrote it, upper-cased (``RCPT``);
    ``END-OF-DATA`` for the answer to the content; ``-`` for a line that
    could not be read as a command. ``argument``: the rest of the line as
    the client sent it, at most ``ARGUMENT_SHOWN`` characters, raw: whoever
    writes it out escapes it. ``reason``: a short fixed word for what was
    wrong (``syntax``, ``relay``, ``size`` ...), the metric's label.
    """

    command: str
    argument: str
    reply: Reply
    reason: str


# Told of every refusal, for the log and the metrics; it must not call back into the connection.
RejectHook = Callable[[Rejection], None]
