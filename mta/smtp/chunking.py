"""BDAT (RFC 3030 CHUNKING) both ways: for the server core, the command's syntax and its chunks' content policed
as DATA's is; for the client core, a body cut into chunks (``ChunkEncoder``).

Why a chunk goes through ``ContentDecoder``: BDAT content is sent as it is,
without dot-stuffing and without a terminator, but it must meet every rule
DATA's content meets (the size limit, the line length limit, bare CR or LF
refused or made CRLF per ``normalize_bare_lf``, no NUL). Rather than a second
implementation of those rules, ``ChunkDecoder`` dot-stuffs each chunk
(``bodybytes.stuff``, one pass) and hands it to the same decoder DATA uses,
which unstuffs it again; the LAST chunk ends with the terminator that DATA's
client would have sent. A lone CR at the end of a chunk is held back until
the next one, so a CRLF split between two chunks is one line end, and a
line start is judged exactly as the decoder judges it: what could end DATA
early can never be made from chunk content. A message that does not end
with CRLF gets one, as Postfix adds it.

The client sends a stored body as it is, in chunks of ``CHUNK_SIZE``: no
dot-stuffing, the one pass left being the CRLF check (a body from the spool
is clean already; one from elsewhere has its line ends made CRLF, with a
CR at a chunk's end held for the next, as ``client.BodyEncoder`` does).
"""

from __future__ import annotations

import re
from typing import Final

import attrs

from mta.smtp.bodybytes import crlf_clean, stuff
from mta.smtp.common import ContentDecoder, RemoteProtocolError, Reply

__all__ = ["CHUNK_SIZE", "MAX_CHUNK_DIGITS", "R_BAD_BDAT", "BdatCommand", "ChunkDecoder", "ChunkEncoder", "parse_bdat"]

CHUNK_SIZE: Final = 65536  # the client's BDAT chunks: what the transport gathers for a write anyway
_NEWLINE_RE: Final = re.compile(rb"\r\n|\r|\n")

MAX_CHUNK_DIGITS: Final = 18  # a chunk size below 10**18 octets: any real one, and still an int a reply can name
R_BAD_BDAT: Final = Reply(501, "5.5.4", "Syntax: BDAT chunk-size [LAST]")


@attrs.frozen
class BdatCommand:
    """``BDAT size [LAST]``: ``size`` octets follow the command line at once."""

    size: int
    last: bool


def parse_bdat(arg: str) -> BdatCommand:
    """BDAT's argument. Raises ``RemoteProtocolError`` (501): no size, a size that is not digits, a word other
    than LAST after it."""
    words = arg.split(" ")
    if not 1 <= len(words) <= 2 or not words[0].isascii() or not words[0].isdigit() \
            or len(words[0]) > MAX_CHUNK_DIGITS or (len(words) == 2 and words[1].upper() != "LAST"):
        raise RemoteProtocolError("bad BDAT", R_BAD_BDAT)
    return BdatCommand(int(words[0]), len(words) == 2)


class ChunkDecoder:
    """The content of one BDAT transaction, chunk by chunk; ``decoder`` holds its size and refusal."""

    def __init__(self, max_size: int, max_line: int, normalize: bool) -> None:
        self.decoder = ContentDecoder(max_size, max_line, normalize)
        self._buf = bytearray()
        self._line_start = True  # the next stuffed byte begins a line (after a CRLF, or the first)
        self._cr = False  # the last chunk ended with a CR: held back

    def feed(self, raw: bytes) -> bytes:
        """Raw chunk bytes in; the content ready so far out (CRLF line ends)."""
        data = b"\r" + raw if self._cr else raw
        self._cr = data.endswith(b"\r")
        if self._cr:
            data = data[:-1]
        if not data:
            return b""
        out = stuff(data, self._line_start)
        self._line_start = out.endswith(b"\r\n")
        return self._decode(out)

    def end(self) -> bytes:
        """The LAST chunk is in: the rest of the content. The decoder has then seen the end of the data."""
        tail = b"\r" if self._cr else b""
        self._cr = False
        return self._decode(tail + (b".\r\n" if self._line_start and not tail else b"\r\n.\r\n"))

    def _decode(self, data: bytes) -> bytes:
        buf = self._buf
        buf += data
        pos, parts = 0, []
        while True:
            pos, content, done = self.decoder.decode(buf, pos, 1 << 30)
            if content:
                parts.append(content)
            if done or not content:
                break
        del buf[:pos]
        return b"".join(parts)


class ChunkEncoder:
    """The client's side: content bytes in, whole ``BDAT n`` commands with their chunks out."""

    def __init__(self, chunk_size: int = CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self._held = bytearray()  # content not yet sent in a chunk
        self._cr = False
        self._line_end = True  # what was sent so far ends with CRLF (or nothing was)

    @property
    def held(self) -> int:
        return len(self._held)

    def encode(self, data: bytes) -> bytes:
        """Content in (any line ends); the BDAT commands and chunks ready to go (``b""`` until a chunk is full)."""
        if self._cr:
            data = b"\r" + data
        self._cr = data.endswith(b"\r")
        if self._cr:
            data = data[:-1]
        if not crlf_clean(data, 0, len(data)):
            data = _NEWLINE_RE.sub(b"\r\n", data)
        self._held += data
        if len(self._held) < self.chunk_size:
            return b""
        out = b"BDAT %d\r\n" % len(self._held) + self._held
        self._line_end = self._held.endswith(b"\r\n")
        self._held = bytearray()
        return out

    def end(self) -> bytes:
        """The last chunk, ``BDAT n LAST`` (with a CRLF added if the content did not end with one)."""
        if self._cr:
            self._held += b"\r\n"
            self._cr = False
        elif not (self._held.endswith(b"\r\n") if self._held else self._line_end):
            self._held += b"\r\n"
        out = b"BDAT %d LAST\r\n" % len(self._held) + self._held
        self._held = bytearray()
        return out
