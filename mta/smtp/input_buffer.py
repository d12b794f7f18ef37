"""The server core's input: what the peer sent and the core has not consumed, cut into lines on demand.

Why apart from the state machine: the machine decides what a line means,
this decides where one ends. Command lines (512 octets with their CRLF, RFC
5321 §4.5.3.1.4) and AUTH response lines are cut here; message content is
read from ``buf`` at ``pos`` by ``ContentDecoder``. Input is consumed only
when a line is asked for, so a pipelined line after ``DATA`` or ``STARTTLS``
is still here, unread, when the state says what it is.

A line longer than its limit is reported once (``Cut.TOO_LONG``), and the
rest of it, up to its LF, is skipped when the next line is looked for. A
line ended by a bare LF, or holding a CR, is consumed and reported
(``Cut.BARE_NEWLINE``): SMTP lines end in CRLF and nothing else.
"""

from __future__ import annotations

import enum

from mta.smtp.common import LocalProtocolError


class Cut(enum.Enum):
    """Why ``InputBuffer.line`` has no line to give."""

    MORE = "no whole line yet: read more, unless the peer is gone (eof)"
    TOO_LONG = "the line passed its limit; the rest of it will be skipped"
    BARE_NEWLINE = "the line ended with a bare LF or held a CR"


class InputBuffer:
    """Bytes received and not consumed (``buf`` from ``pos``), whether the peer closed (``eof``), and how many
    lines were consumed (``lines``: whole, skipped or bad; the shell's command deadline follows it)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0
        self.eof = False
        self.lines = 0
        self._skip = False  # discarding the rest of an over-long line

    def feed(self, data: bytes | bytearray) -> None:
        """Bytes from the peer; ``b""`` means EOF. Raises ``LocalProtocolError`` for bytes after EOF."""
        if not data:
            self.eof = True
            return
        if self.eof:
            raise LocalProtocolError("receive_data after EOF")
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += data

    def clear(self) -> None:
        """Forget what was received and not consumed (after STARTTLS: CVE-2011-0411)."""
        self.buf.clear()
        self.pos = 0

    def line(self, limit: int) -> bytes | Cut:
        """The next line without its CRLF, at most ``limit`` bytes with it; or why there is none."""
        buf = self.buf
        if self._skip:
            i = buf.find(b"\n", self.pos)
            if i < 0:
                self.pos = len(buf)
                return Cut.MORE
            self.pos = i + 1
            self._skip = False
            self.lines += 1
        end = min(len(buf), self.pos + limit)
        i = buf.find(b"\n", self.pos, end)
        if i < 0:
            if end - self.pos >= limit:
                self._skip = True
                return Cut.TOO_LONG
            return Cut.MORE
        line = bytes(buf[self.pos : i + 1])
        self.pos = i + 1
        self.lines += 1
        if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
            return Cut.BARE_NEWLINE
        return line[:-2]
