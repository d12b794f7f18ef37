"""The DKIM-Signature field: its tags, how it is folded, the header hash it signs (RFC 6376 §3.5, §3.7).

Theory of operation
-------------------
A signature is made in three steps, the first shared by every key of a
message: the body hash (``body_hash``: the canonical body through SHA-256),
then for each key the field's text up to ``b=`` (``_unsigned_field``), then
the hash of the signed header fields followed by that text, which the key
signs (``SigningKey.sign_digest``: OpenSSL, through ``cryptography``, with the
key loaded once at start). The field's text is built once and the signature
appended to it, so the bytes hashed are exactly the bytes sent up to ``b=``
whichever canonicalisation is used; the verifier deletes ``b=``'s value and
the folding white space in it (§3.5), and hashes what is left.

Tags are dkimpy's, in its order (``v a c d i [l] q s t h bh b``), so that a
signature can be compared tag by tag with the reference. The field is folded
at tag boundaries and between the names of ``h=`` (where RFC 6376's grammar
allows folding white space), lines of at most 78 characters, the signature
itself in lines of its own.

Header fields are chosen from the bottom up (§5.4.2): the n-th ``h=`` entry
of a name signs that name's n-th field counted from the last; an entry with
no field left (an over-signed name) signs nothing, so a copy added in
transit breaks the signature.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from typing import Protocol

from mta.dkim.canon import Field, body_canonical, header_canonical

__all__ = ["LINE", "Key", "body_hash", "selected", "signature_field"]

LINE = 78  # RFC 5322 §2.1.1: lines SHOULD be at most 78 characters
_NAME = b"DKIM-Signature"


class Key(Protocol):
    """What a signature needs of a key (``mta.dkim.keys.SigningKey``, which checks itself with this module)."""

    @property
    def domain(self) -> str: ...
    @property
    def selector(self) -> str: ...
    @property
    def algorithm(self) -> bytes: ...
    def sign_digest(self, digest: bytes, /) -> bytes: ...


def body_hash(body: bytes, relaxed: bool) -> tuple[bytes, int]:
    """``bh=``'s value (base64 of SHA-256 of the canonical body) and the canonical body's length (``l=``)."""
    canonical = body_canonical(body, relaxed)
    return base64.b64encode(hashlib.sha256(canonical).digest()), len(canonical)


def selected(fields: tuple[Field, ...], include: tuple[bytes, ...]) -> list[Field]:
    """The fields ``h=`` signs, in its order: each name's instances from the last one up."""
    wanted = set(include)
    left: dict[bytes, list[Field]] = {}  # per name: its fields not yet chosen, the last one at the end
    for f in fields:
        name = f.name.lower()
        if name in wanted:
            left.setdefault(name, []).append(f)
    return [left[name].pop() for name in include if left.get(name)]


def signature_field(key: Key, fields: tuple[Field, ...], include: tuple[bytes, ...],
                    canonicalize: tuple[bytes, bytes], bh: bytes, now: int, length: int | None = None) -> bytes:
    """The whole DKIM-Signature field of ``key``, CRLF-ended, ready to go above the message.

    ``include``: ``h=``, lower-case names; ``bh``: from ``body_hash`` with the
    body canonicalisation of ``canonicalize``; ``length``: ``l=``, or None
    (the whole body signed, no ``l=``).
    """
    relaxed = canonicalize[0] == b"relaxed"
    t = b"%d" % now
    text, hashed, column = _layout(key.domain, key.selector, key.algorithm, include, canonicalize, len(t),
                                   len(bh), length)
    # The field itself comes last and without its CRLF (§3.7); its b= is empty in ``text``.
    signed = [header_canonical(f, relaxed) for f in selected(fields, include)]
    signed.append(hashed[0] + t + hashed[1] + bh + hashed[2])
    signature = base64.b64encode(key.sign_digest(hashlib.sha256(b"".join(signed)).digest()))
    return text[0] + t + text[1] + bh + text[2] + _fold_value(signature, column) + b"\r\n"


Pieces = tuple[bytes, bytes, bytes]  # what goes before t='s value, between it and bh='s, and after bh='s


@functools.lru_cache(maxsize=256)
def _layout(domain: str, selector: str, algorithm: bytes, include: tuple[bytes, ...],
            canonicalize: tuple[bytes, bytes], t_width: int, bh_width: int, length: int | None
            ) -> tuple[Pieces, Pieces, int]:
    """The field's text up to ``b=`` and its canonical form (what is hashed of it), around t= and bh=.

    Folding depends on the widths of t= and bh= only, not on their digits, so
    the text is laid out once per key, ``h=`` and widths (with placeholders
    that no tag holds), and a message's values are put in between: the
    layout is most of the Python a signature costs. The third value is the
    column the text ends at, where the ``b=`` value begins.
    """
    t, bh = b"\x00" * t_width, b"\x01" * bh_width
    text = _unsigned_field(domain.encode(), selector.encode(), algorithm, include, canonicalize, bh, t, length)
    hashed = header_canonical(Field(_NAME, text[len(_NAME) + 1:]), canonicalize[0] == b"relaxed")
    return _around(text, t, bh), _around(hashed.removesuffix(b"\r\n"), t, bh), len(text) - text.rfind(b"\n") - 1


def _around(text: bytes, t: bytes, bh: bytes) -> Pieces:
    """``text`` cut at its one ``t`` and its one ``bh`` (placeholders: a domain with a NUL is refused here)."""
    before, t_found, rest = text.partition(t)
    between, bh_found, after = rest.partition(bh)
    others = before + between + after
    if not (t_found and bh_found) or b"\x00" in others or b"\x01" in others:
        raise ValueError("a DKIM-Signature tag holds a NUL or a \\x01 byte")
    return before, between, after


def _unsigned_field(domain: bytes, selector: bytes, algorithm: bytes, include: tuple[bytes, ...],
                    canonicalize: tuple[bytes, bytes], bh: bytes, t: bytes, length: int | None) -> bytes:
    """The field's text up to and including ``b=``, folded: what the verifier hashes of it."""
    tags = [b"v=1", b"a=" + algorithm, b"c=" + b"/".join(canonicalize), b"d=" + domain, b"i=@" + domain]
    if length is not None:
        tags.append(b"l=%d" % length)
    tags += [b"q=dns/txt", b"s=" + selector, b"t=" + t]
    # Words, each with what joins it to the one before when they share a line.
    words: list[tuple[bytes, bytes]] = [(tag + b";", b" ") for tag in tags]
    names = [b"h=" + include[0], *include[1:]] if include else [b"h="]
    words += [(n + (b";" if i == len(names) - 1 else b":"), b" " if i == 0 else b"")
              for i, n in enumerate(names)]
    words += [(b"bh=" + bh + b";", b" "), (b"b=", b" ")]
    out = [_NAME + b":"]
    column = len(out[0])
    for word, joiner in words:
        if column + len(joiner) + len(word) > LINE:
            out.append(b"\r\n\t" + word)
            column = 1 + len(word)
        else:
            out.append(joiner + word)
            column += len(joiner) + len(word)
    return b"".join(out)


def _fold_value(signature: bytes, column: int) -> bytes:
    """``b=``'s base64 in lines of at most ``LINE``, starting where the field's text ends."""
    room = LINE - column
    first = signature[:room] if room > 8 else b""
    rest = signature[len(first):]
    return b"\r\n\t".join([first] + [rest[i:i + LINE - 1] for i in range(0, len(rest), LINE - 1)])
