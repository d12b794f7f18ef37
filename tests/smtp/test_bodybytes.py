"""Property tests of the whole-buffer body passes (``mta.smtp.bodybytes``) against per-line models.

Each model is the plain reading of the rule, one line at a time; the fast
functions must give the same bytes on any input, any range, bytes or
bytearray, and on bodies with more line-start dots than the loop takes
before it hands the rest to one ``replace``.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from mta.smtp.bodybytes import _LOOP_DOTS, crlf_clean, stuff, unstuff

_BARE = re.compile(rb"\r(?!\n)|(?<!\r)\n")

# Lines that exercise the rules: dots alone and leading, empty lines, NULs, text.
line_text = st.one_of(
    st.sampled_from([b"", b".", b"..", b"...", b".x", b"x.", b"\x00", b".\x00", b"x" * 80]),
    st.binary(max_size=6).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
)
clean_lines = st.lists(line_text, min_size=0, max_size=3 * _LOOP_DOTS)


def model_clean(data: bytes) -> bool:
    """Every CR is followed by an LF and every LF preceded by a CR, within ``data``."""
    return _BARE.search(data) is None


def model_unstuff(data: bytes) -> tuple[bytes, int]:
    """``data`` starts inside a line and ends with CRLF: drop each later line's leading dot, stop at ``.``."""
    pieces = data.split(b"\r\n")[:-1]
    out, used = bytearray(), 0
    for i, line in enumerate(pieces):
        if i > 0 and line == b".":
            return bytes(out), used
        out += (line[1:] if i > 0 and line.startswith(b".") else line) + b"\r\n"
        used += len(line) + 2
    return bytes(out), used


def model_stuff(data: bytes, line_start: bool) -> bytes:
    pieces = data.split(b"\r\n")
    return b"\r\n".join(b"." + p if (i > 0 or line_start) and p.startswith(b".") else p for i, p in enumerate(pieces))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([b"\r", b"\n", b"\r\n", b"x", b".", b"\x00"]), max_size=30).map(b"".join),
       st.integers(min_value=0, max_value=40), st.integers(min_value=0, max_value=40), st.booleans())
def test_crlf_clean_agrees_with_the_bare_newline_pattern(data: bytes, a: int, b: int, mutable: bool) -> None:
    start, end = min(a, b, len(data)), min(max(a, b), len(data))
    buf = bytearray(data) if mutable else data
    assert crlf_clean(buf, start, end) == model_clean(data[start:end])


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=4).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")), clean_lines,
       st.binary(max_size=8), st.binary(max_size=8), st.booleans())
def test_unstuff_agrees_with_the_per_line_model(first: bytes, lines: list[bytes], before: bytes, after: bytes,
                                                mutable: bool) -> None:
    data = first + b"".join(line + b"\r\n" for line in lines)
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    raw = before + data + after
    buf = bytearray(raw) if mutable else raw
    content, stop = unstuff(buf, len(before), len(before) + len(data))
    want, used = model_unstuff(data)
    assert (content, stop) == (want, len(before) + used)


@settings(max_examples=400, deadline=None)
@given(clean_lines, st.booleans(), st.booleans())
def test_stuff_agrees_with_the_per_line_model(lines: list[bytes], line_start: bool, open_end: bool) -> None:
    data = b"\r\n".join(lines) + (b"" if open_end else b"\r\n")
    assert stuff(data, line_start) == model_stuff(data, line_start)


def test_stuff_returns_the_same_object_when_nothing_is_added() -> None:
    data = b"Subject: x\r\n\r\nno dots at line starts. Here.\r\n" * 100
    assert stuff(data, True) is data


def test_many_dot_lines_take_the_replace_path_and_keep_their_order() -> None:
    data = b"x\r\n" + b"".join(b".%d\r\n" % i for i in range(4 * _LOOP_DOTS)) + b".\r\nQUIT\r\n"
    end = len(data) - len(b".\r\nQUIT\r\n") + 3 + 6
    content, stop = unstuff(data, 0, end)
    assert content == b"x\r\n" + b"".join(b"%d\r\n" % i for i in range(4 * _LOOP_DOTS))
    assert data[stop:] == b".\r\nQUIT\r\n"
    assert stuff(content.replace(b"\r\n", b"\r\n."), False) == content.replace(b"\r\n", b"\r\n..")
