"""Whole-buffer passes over message content: the CRLF check, dot-unstuffing and dot-stuffing.

Why apart: both cores spend most of their CPU on a large message here, and
each pass over 100 KB costs what it costs in C only if it is one call. In
CPython a search for a byte (``find``, ``in``) runs at memory speed, one for
two or more bytes (``count``, ``replace``, ``find`` of ``b"\\r\\n."``) at about
a byte a cycle, and per-line Python at a line a fifth of a microsecond; so
each function here makes as few multi-byte passes as it can and leaves the
rest to single-byte searches (100 KB messages).

Dots at the start of a line are rare in mail, so each is found by a search
and cut out in a loop; a body made of them would make that loop slow, so
after ``_loop_dots`` of them (16, and one more per 512 bytes of the range)
the rest of the range is done by one ``replace``: the cost stays linear in
the size, whatever the content.
"""

from __future__ import annotations

from typing import Final

_LOOP_DOTS: Final = 16  # line-start dots always handled one by one, before the rest may go to one replace
_CR_LF: Final = b"\r\n"


def _loop_dots(size: int) -> int:
    """How many line-start dots the loop takes in a range of ``size`` bytes: a loop step costs about what a
    ``replace`` costs over a few hundred bytes."""
    return _LOOP_DOTS + (size >> 9)


def crlf_clean(buf: bytes | bytearray, start: int, end: int) -> bool:
    """Whether every CR and every LF in ``buf[start:end]`` belongs to a CRLF pair inside the range.

    The range without its CRs, with each LF made CRLF again, is the range
    itself exactly when it is clean: a CR anywhere but before an LF, or an
    LF without one, changes it. Both ``replace`` calls look for one byte,
    which CPython does at memory speed, where counting CRLFs looks for two
    and cost as much as the rest together.
    """
    if start >= end:
        return True
    part = buf if start == 0 and end == len(buf) and isinstance(buf, bytes) else bytes(memoryview(buf)[start:end])
    return part.replace(b"\r", b"").replace(b"\n", _CR_LF) == part


def unstuff(buf: bytes | bytearray, start: int, end: int) -> tuple[bytes, int]:
    """The content of the whole lines in ``buf[start:end]`` with each line's leading dot dropped, and where
    it stopped: ``end``, or the start of a line that is a lone dot (the end of the data), which is left.

    ``start`` is inside a line (its head already dealt with), ``end`` just
    after a CRLF, and the range holds no bare CR or LF, so every ``CRLF.``
    in it is a line that starts with a dot.
    """
    find = buf.find
    j = find(b"\r\n.", start, end)
    if j < 0:
        return bytes(memoryview(buf)[start:end]), end
    view = memoryview(buf)
    parts: list[bytes | memoryview] = []
    for _ in range(_loop_dots(end - start)):
        if j + 5 <= end and buf[j + 3] == 0x0D and buf[j + 4] == 0x0A:  # the line is "." alone: the end
            parts.append(view[start : j + 2])
            return b"".join(parts), j + 2
        parts.append(view[start : j + 2])
        start = j + 3  # past the dot
        j = find(b"\r\n.", start, end)
        if j < 0:
            parts.append(view[start:end])
            return b"".join(parts), end
    term = find(b"\r\n.\r\n", j, end)
    stop = end if term < 0 else term + 2
    parts.append(bytes(view[start:stop]).replace(b"\r\n.", _CR_LF))
    return b"".join(parts), stop


def stuff(data: bytes, line_start: bool) -> bytes:
    """``data`` with a dot added before each line's leading dot (RFC 5321 §4.5.2); ``line_start``: the
    first byte of ``data`` starts a line. ``data`` must have CRLF line ends only.

    Returned as it is, without a copy, when there is nothing to add.
    """
    find = data.find
    lead = line_start and data[:1] == b"."
    j = find(b"\r\n.")
    if j < 0 and not lead:
        return data
    view = memoryview(data)
    parts: list[bytes | memoryview] = [b"."] if lead else []
    start = 0
    for _ in range(_loop_dots(len(data))):
        if j < 0:
            parts.append(view[start:])
            return b"".join(parts)
        parts.append(view[start : j + 3])  # up to and with the dot; the next part starts with it again
        start = j + 2
        j = find(b"\r\n.", j + 3)
    parts.append(view[start : start + 1])
    parts.append(bytes(view[start + 1 :]).replace(b"\r\n.", b"\r\n.."))
    return b"".join(parts)
