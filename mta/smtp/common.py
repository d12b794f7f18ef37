"""What the SMTP server and client cores share: replies, errors, limits, parsing.

Nothing here does I/O. ``Reply`` is the one value both directions exchange; the
server formats it, the client parses it back with ``ReplyParser``. Errors
carry the reply to send (``RemoteProtocolError``), so the server state
machine never has to know why an argument was bad. Addresses and ESMTP
parameters are ``mta.smtp.addresses``'.
"""

from __future__ import annotations

import datetime as _dt
import enum
import re
import time
from typing import Final

import attrs

from mta.smtp.bodybytes import crlf_clean, unstuff

# Limits (RFC 5321 §4.5.3.1). The command line limit includes the CRLF.
MAX_COMMAND_LINE: Final = 512
MAX_TEXT_LINE: Final = 1000
MAX_REPLY_LINE: Final = 4096
MAX_REPLY_LINES: Final = 200
MAX_LOCAL_PART: Final = 64
MAX_DOMAIN: Final = 255
MAX_PATH: Final = 256
# The relay's one default message size (the [server] max_message_size setting, mta.config.sections, uses
# it): 10 MiB, what the relay has always announced in SIZE; Postfix's message_size_limit is 10240000.
DEFAULT_MAX_MESSAGE_SIZE: Final = 10 << 20
DEFAULT_MAX_RECIPIENTS: Final = 1000
DEFAULT_MAX_ERRORS: Final = 10
# DataChunk events never carry more than this, so the shell writes in bounded pieces.
DATA_CHUNK_SIZE: Final = 65536

# Timeouts in seconds (RFC 5321 §4.5.3.2). Enforcing them is the shell's job.
TIMEOUT_INITIAL: Final = 300.0
TIMEOUT_MAIL: Final = 300.0
TIMEOUT_RCPT: Final = 300.0
TIMEOUT_DATA_INIT: Final = 120.0
TIMEOUT_DATA_BLOCK: Final = 180.0
TIMEOUT_DATA_TERMINATION: Final = 600.0
TIMEOUT_SERVER: Final = 300.0

_ENHANCED_RE: Final = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})$")
_ENHANCED_PREFIX_RE: Final = re.compile(r"^([245]\.\d{1,3}\.\d{1,3})(?: |$)")


def _check_enhanced(instance: object, attribute: object, value: str | None) -> None:
    if value is None:
        return
    m = _ENHANCED_RE.match(value)
    if m is None:
        raise ValueError(f"bad enhanced status code {value!r}")


def _check_code(instance: object, attribute: object, value: int) -> None:
    if not 200 <= value <= 599:
        raise ValueError(f"reply code {value} out of range")


# C0 controls, DEL and C1 controls: never in a reply we send, never in a command we obey.
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_REPLY_CONTROL_RE: Final = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # LF separates a reply's lines


def has_control(text: str) -> bool:
    """True if ``text`` holds a C0 or C1 control character or DEL (TAB, CR, LF and NUL included)."""
    return _CONTROL_RE.search(text) is not None


def printable(text: str, limit: int = 64) -> str:
    """Peer-supplied text as it may appear in a reply or a log line: printable ASCII, at most ``limit`` long.

    Everything else is shown escaped (``\\x00``, ``\\u202e``) and a longer
    text is cut with ``...``, so an answer can name what a peer sent without
    ever sending its bytes back.
    """
    out: list[str] = []
    n = 0
    for c in text:
        piece = c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii")
        if n + len(piece) > limit:
            out.append("...")
            break
        out.append(piece)
        n += len(piece)
    return "".join(out)


def _check_text(instance: object, attribute: object, value: str) -> None:
    if _REPLY_CONTROL_RE.search(value):
        raise ValueError("reply text may not hold control characters; separate lines with LF")


@attrs.frozen
class Reply:
    """An SMTP reply: code, RFC 3463 enhanced status, text (lines split on LF).

    ``enhanced`` is None only where RFC 2034 forbids it (the greeting, replies to
    HELO/EHLO, 3xx intermediate replies) or when a peer did not send one.
    """

    code: int = attrs.field(validator=_check_code)
    enhanced: str | None = attrs.field(default=None, validator=_check_enhanced)
    text: str = attrs.field(default="", validator=_check_text)

    def __attrs_post_init__(self) -> None:
        if self.enhanced is not None and self.enhanced[0] != str(self.code)[0]:
            raise ValueError(f"enhanced code {self.enhanced} does not match class of {self.code}")

    @property
    def lines(self) -> list[str]:
        return self.text.split("\n")

    @property
    def is_positive(self) -> bool:
        return self.code < 400

    @property
    def is_transient(self) -> bool:
        return 400 <= self.code < 500

    @property
    def is_permanent(self) -> bool:
        return self.code >= 500

    def to_bytes(self) -> bytes:
        """Wire form; every line carries the enhanced code, as RFC 2034 asks."""
        lines = self.lines
        prefix = f"{self.enhanced} " if self.enhanced else ""
        out = []
        for i, line in enumerate(lines):
            sep = " " if i == len(lines) - 1 else "-"
            out.append(f"{self.code}{sep}{prefix}{line}".rstrip(" ") + "\r\n")
        return "".join(out).encode("utf-8")

    def __str__(self) -> str:
        prefix = f"{self.enhanced} " if self.enhanced else ""
        return f"{self.code} {prefix}{self.text}"


class SmtpProtocolError(Exception):
    """Root of the errors the SMTP cores raise on purpose.

    ``reply`` is the hint: what a server should answer because of it.
    """

    def __init__(self, message: str, reply: Reply | None = None) -> None:
        super().__init__(message)
        self.reply = reply if reply is not None else Reply(500, "5.5.2", printable(message, 200))


class LocalProtocolError(SmtpProtocolError, RuntimeError):
    """The code driving the core (our shell) broke the rules of its API."""


class RemoteProtocolError(SmtpProtocolError, ValueError):
    """The peer sent something that breaks the protocol."""


class TableKey(enum.Enum):
    """The states and steps of the cores' transition tables.

    Members are singletons compared by identity, so they hash by identity too:
    Enum's own ``__hash__`` hashes the name in Python, which makes every table
    lookup on the path of each command about four times dearer (Python 3.11).
    """

    __hash__ = object.__hash__


# ---------------------------------------------------------------- reply parsing


class ReplyParser:
    """Incremental parser of server replies, bounded in memory.

    Accepts a bare LF as line end (we are liberal in what a server sends us);
    an over-long line or reply raises ``RemoteProtocolError``.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._lines: list[tuple[int, str]] = []

    def feed(self, data: bytes | bytearray) -> list[Reply]:
        self._buf += data
        replies: list[Reply] = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                if len(self._buf) > MAX_REPLY_LINE:
                    raise RemoteProtocolError("reply line too long")
                return replies
            raw = bytes(self._buf[:i]).rstrip(b"\r")
            del self._buf[: i + 1]
            reply = self._line(raw)
            if reply is not None:
                replies.append(reply)

    @property
    def pending(self) -> bool:
        """True while a reply has started but not ended (EOF now would truncate it)."""
        return bool(self._buf) or bool(self._lines)

    def _line(self, raw: bytes) -> Reply | None:
        if not self._lines:
            known = _SEEN_REPLIES.get(raw)
            if known is not None:
                return known
        if len(raw) > MAX_REPLY_LINE:
            raise RemoteProtocolError("reply line too long")
        text = raw.decode("utf-8", "replace")
        if len(text) < 3 or not text[:3].isdigit() or (len(text) > 3 and text[3] not in " -"):
            raise RemoteProtocolError(f"malformed reply line {text[:40]!r}")
        code = int(text[:3])
        if not 200 <= code <= 599:
            raise RemoteProtocolError(f"reply code {code} out of range")
        if self._lines and self._lines[0][0] != code:
            raise RemoteProtocolError("reply code changed inside a multiline reply")
        self._lines.append((code, text[4:]))
        if len(self._lines) > MAX_REPLY_LINES:
            raise RemoteProtocolError("reply has too many lines")
        if len(text) > 3 and text[3] == "-":
            return None
        lines, self._lines = self._lines, []
        reply = _build_reply(code, [t for _, t in lines])
        if len(lines) == 1:
            if len(_SEEN_REPLIES) >= SEEN_REPLIES_MAX:
                _SEEN_REPLIES.clear()
            _SEEN_REPLIES[raw] = reply
        return reply


# One-line replies already parsed, by their bytes (a Reply is immutable): a next hop says the same
# ``250 2.1.0 Ok`` and ``354 ...`` for every message, and parsing one (two regexes and the Reply's
# validators) cost more than the rest of the client core's handling of it. Bounded: cleared when full.
SEEN_REPLIES_MAX: Final = 256
_SEEN_REPLIES: dict[bytes, Reply] = {}


def _build_reply(code: int, texts: list[str]) -> Reply:
    enhanced: str | None = None
    out = []
    for i, t in enumerate(texts):
        m = _ENHANCED_PREFIX_RE.match(t)
        if m is not None and m.group(1)[0] == str(code)[0]:
            if i == 0:
                enhanced = m.group(1)
            t = t[m.end() :]
        out.append(_REPLY_CONTROL_RE.sub(lambda m: printable(m.group()), t.replace("\r", "")))
    return Reply(code, enhanced, "\n".join(out))


# ---------------------------------------------------------------- DATA content

R_TOO_BIG: Final = Reply(552, "5.3.4", "Message size exceeds fixed limit")
R_DATA_BARE_NEWLINE: Final = Reply(550, "5.6.11", "Bare CR or LF in message content; use CRLF")
R_DATA_LONG_LINE: Final = Reply(550, "5.5.2", "Message has a line longer than allowed")
R_DATA_NUL: Final = Reply(550, "5.6.0", "NUL character in message content")
_BARE_RE: Final = re.compile(rb"\r(?!\n)|(?<!\r)\n")


def _first_bare(buf: bytearray, pos: int, n: int, quick: bool) -> int:
    """Where the first bare CR or LF at or after ``pos`` is (``n``: none; a CR at the very end counts).

    ``quick`` first checks the range whole (``bodybytes.crlf_clean``), which is
    much cheaper than the regex over clean content; the regex alone is for content known to have
    bare ones, where it stops at the next.
    """
    if quick:
        end = n - 1 if n and buf[n - 1] == 0x0D else n
        if crlf_clean(buf, pos, end):
            return end
    m = _BARE_RE.search(buf, pos)
    return m.start() if m is not None else n


class ContentDecoder:
    """Server side of DATA: finds the end, undoes dot-stuffing, polices the content.

    Only CRLF.CRLF ends the message (SMTP smuggling). A bare CR or LF sets
    ``refusal`` (550 5.6.11), or with ``normalize`` becomes CRLF; either way the
    line after it is never a terminator and is not unstuffed. A NUL anywhere
    sets ``refusal`` (550 5.6.0), whatever ``normalize`` says: RFC 5322 and
    8BITMIME forbid it, and a next hop that drops NULs would read the line
    ``NUL.`` as the end of the data. Over-size and over-long lines also set
    ``refusal``; from then on content is only scanned
    for its end, not returned, so a doomed message costs no disk. ``size`` is
    the content size so far while there is no refusal.

    Two paths, one behaviour. The bulk path takes a run of whole lines that
    holds nothing unusual (no bare CR or LF, no line near the limit, no size
    overflow): ``bodybytes.unstuff`` undoes the dot-stuffing and finds the end
    in one pass.
    Whatever the bulk path will not take — a line with a bare CR or LF, a
    suspect long line, the lines around the size limit, a partial last line —
    goes through the per-line machine (``_piece``), which is the definition;
    the bulk path only ever stops short of where it would have to decide. Why:
    per-line Python was most of the relay's CPU on large messages
    (docs/bench_relay.md).
    """

    def __init__(self, max_size: int, max_line: int, normalize: bool) -> None:
        self.max_size = max_size
        self.max_line = max_line
        self.normalize = normalize
        self.size = 0
        self.refusal: Reply | None = None
        self._line_start = True  # the CRLF of the DATA command counts as a line end
        self._real_line_start = True
        self._line_len = 0
        self._parts: list[bytes | bytearray] = []
        self._produced = 0

    def decode(self, buf: bytearray, pos: int, limit: int) -> tuple[int, bytes, bool]:
        """Consume from ``buf[pos:]``; return (new pos, content of at most ``limit`` bytes, ended)."""
        n = len(buf)
        done = False
        term = -2  # the first CRLF.CRLF at or after pos (-1: none), looked up only once refused
        bare = -1  # first bare CR/LF at or after pos (n: none), looked up again only once passed
        self._produced = 0
        while self._produced < limit:
            if self._line_start:
                head = self._line_head(buf, pos, n)
                if head is None:
                    break
                if head < 0:
                    pos, done = pos + 3, True
                    break
                pos = head
                if pos >= n:
                    break
            if self.refusal is not None:
                if term == -2:  # only CRLF pairs are real line ends, so the first one is the end
                    term = buf.find(b"\r\n.\r\n", pos)
                e = term + 2 if term >= 0 else buf.rfind(b"\n", pos) + 1
                if e > pos:
                    self._real_line_start = e - 2 >= pos and buf[e - 2] == 0x0D
                    self._line_start, self._line_len, pos = True, 0, e
                    continue
            else:
                if bare < pos:
                    bare = _first_bare(buf, pos, n, quick=bare < 0)
                e = self._bulk_end(buf, pos, min(n, pos + limit - self._produced, bare))
                if e > pos:
                    data, e = unstuff(buf, pos, e)  # stops at the terminator's line, if it is in the run
                    self.size += len(data)
                    if b"\x00" in data:
                        self.refusal = R_DATA_NUL
                    else:
                        self._produced += len(data)
                        self._parts.append(data)
                    self._line_start = self._real_line_start = True
                    self._line_len, pos = 0, e
                    continue
            pos, progress = self._piece(buf, pos, limit - self._produced)
            if not progress:
                break
        parts, self._parts = self._parts, []
        return pos, b"".join(parts), done

    def _line_head(self, buf: bytearray, pos: int, n: int) -> int | None:
        """At a line start: -1 at the terminator, None to wait for input, else where the line's content begins."""
        if pos >= n:
            return None
        if self._real_line_start and buf[pos] == 0x2E:  # "."
            if buf.startswith(b".\r\n", pos):
                return -1
            if n - pos < 3 and b".\r\n".startswith(bytes(buf[pos:])):
                return None
            pos += 1  # dot-stuffing: drop the first dot of the line
        self._line_start = False
        return pos

    def _bulk_end(self, buf: bytearray, pos: int, stop: int) -> int:
        """Where a run of plain whole lines from ``pos`` (mid-line) ends, at most ``stop``; ``pos`` for none.

        ``stop`` already excludes the first bare CR/LF. The run also stays
        within the size limit (unstuffing only shrinks it) and ends before the
        first line that could be too long, which the per-line path then judges.
        It may reach past the end of the data: ``unstuff`` stops at the
        terminator's line (one pass finds both, where a search for CRLF.CRLF
        and a ``replace`` made two).
        """
        stop = min(stop, pos + self.max_size - self.size)
        e = buf.rfind(b"\n", pos, stop) + 1
        if e <= pos:
            return pos
        most = self.max_line - 2  # content bytes a line may hold
        lf = buf.find(b"\n", pos, e)
        if self._line_len + lf - 1 - pos > most:
            return pos
        k = lf + 1
        while e - k > most + 2:  # some line in [k, e) may be longer than allowed
            j = buf.rfind(b"\n", k, k + most + 2)
            if j < 0:
                return k  # the line at k is long on the wire: let the per-line path decide
            k = j + 1
        return e

    def _content(self, data: bytes | bytearray) -> None:
        """Count ``data`` and keep it, unless it dooms the message: the first refusal in stream order wins."""
        room = self.max_size - self.size  # bytes of data before the one that is over the limit
        self.size += len(data)
        if self.refusal is None:
            nul = data.find(b"\x00", 0, max(0, room))
            if nul >= 0:
                self.refusal = R_DATA_NUL
            elif self.size > self.max_size:
                self.refusal = R_TOO_BIG
        if self.refusal is None:
            self._parts.append(data)
            self._produced += len(data)

    def _line_end(self, real: bool) -> None:
        if self._line_len + 2 > self.max_line and self.refusal is None:
            self.refusal = R_DATA_LONG_LINE
        self._content(b"\r\n")
        self._line_len = 0
        self._line_start = True
        self._real_line_start = real

    def _piece(self, buf: bytearray, pos: int, room: int) -> tuple[int, bool]:
        """The per-line machine, mid-line: content up to the next CR/LF (or ``room``) and that line end.

        Returns (new pos, whether it made progress); no progress means it needs input.
        """
        n = len(buf)
        end = min(n, pos + max(room, 1))
        cr = buf.find(b"\r", pos, end)
        lf = buf.find(b"\n", pos, end)
        i = min(x for x in (cr, lf, end) if x >= 0)
        if i > pos:
            self._line_len += i - pos
            self._content(buf[pos:i])
        if i == end:
            return i, i > pos
        if buf[i] == 0x0D:
            if i + 1 == n:
                return i, i > pos  # a CR at the end: wait to see what follows it
            if buf[i + 1] == 0x0A:
                self._line_end(real=True)
                return i + 2, True
        if not self.normalize and self.refusal is None:
            self.refusal = R_DATA_BARE_NEWLINE
        self._line_end(real=False)
        return i + 1, True


# ---------------------------------------------------------------- Received:

_UNSAFE_RE: Final = re.compile(r"[\x00-\x1f\x7f()\\]")


def _clean(s: str, limit: int = 255) -> str:
    """Peer-supplied text goes into a header: no control chars, no comment breakers."""
    if s.isprintable() and not ("(" in s or ")" in s or "\\" in s):  # nothing to replace: no regex pass
        return s[:limit]
    return _UNSAFE_RE.sub("?", s)[:limit]


# The Received: date of the last second one was written in (a header per message).
_received_second: tuple[int, str] = (-1, "")


def _received_date() -> str:
    global _received_second
    now = time.time()
    whole = int(now)
    second = _received_second
    if second[0] != whole:
        text = _dt.datetime.fromtimestamp(whole, _dt.UTC).strftime("%a, %d %b %Y %H:%M:%S %z")
        second = _received_second = (whole, text)
    return second[1]


def received_protocol(*, esmtp: bool, tls: bool, smtputf8: bool, auth: bool = False) -> str:
    """The ``with`` keyword (RFC 3848, RFC 6531 §3.7.3): ``S`` for TLS, ``A`` for an authenticated client."""
    if not esmtp and not smtputf8:
        return "SMTP"
    return ("UTF8SMTP" if smtputf8 else "ESMTP") + ("S" if tls else "") + ("A" if auth else "")


def received_header(
    *,
    helo: str,
    client_ip: str,
    by: str,
    protocol: str,
    queue_id: str | None = None,
    recipient: str | None = None,
    client_host: str | None = None,
    when: _dt.datetime | None = None,
    tls: str | None = None,
    authenticated: str | None = None,
) -> bytes:
    """A folded ``Received:`` trace header (RFC 5321 §4.4), CRLF-terminated.

    ``tls``: how the session was encrypted, written as Postfix does in a
    comment line after ``from`` (``using TLSv1.3 with cipher ...``, see
    ``mta.observe.tlsinfo``), followed by ``(No client certificate requested)``;
    ``authenticated``: the AUTH user, ``(Authenticated sender: NAME)`` as Postfix writes it.
    Peer-supplied text is sanitised, so a hostile HELO cannot inject headers.
    """
    host = _clean(client_host) if client_host else "unknown"
    parts = [f"Received: from {_clean(helo)} ({host} [{_clean(client_ip, 64)}])"]
    if tls:
        # Our TLS library's words, not the peer's: only control characters could harm, and they are replaced.
        parts += [f"\t({_CONTROL_RE.sub('?', tls)})", "\t(No client certificate requested)"]
    if authenticated:
        parts.append(f"\t(Authenticated sender: {_clean(authenticated)})")
    parts.append(f"\tby {_clean(by)} with {protocol}")
    if queue_id:
        parts[-1] += f" id {_clean(queue_id, 64)}"
    if recipient:
        parts.append(f"\tfor <{_clean(recipient)}>")
    parts[-1] += ";"
    parts.append("\t" + (when.strftime("%a, %d %b %Y %H:%M:%S %z") if when is not None else _received_date()))
    return ("\r\n".join(parts) + "\r\n").encode("utf-8")
