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
    text = _unsigned_field(key, include, canonicalize, bh, now, length)
    digest = hashlib.sha256()
    for f in selected(fields, include):
        digest.update(header_canonical(f, relaxed))
    own = Field(_NAME, text[len(_NAME) + 1:])
    # The field itself comes last and without its CRLF (§3.7); its b= is empty in ``text``.
    digest.update(header_canonical(own, relaxed).removesuffix(b"\r\n"))
    signature = base64.b64encode(key.sign_digest(digest.digest()))
    return text + _fold_value(signature, len(text) - text.rfind(b"\n") - 1) + b"\r\n"


def _unsigned_field(key: Key, include: tuple[bytes, ...], canonicalize: tuple[bytes, bytes], bh: bytes,
                    now: int, length: int | None) -> bytes:
    """The field's text up to and including ``b=``, folded: what the verifier hashes of it."""
    domain = key.domain.encode()
    tags = [b"v=1", b"a=" + key.algorithm, b"c=" + b"/".join(canonicalize), b"d=" + domain, b"i=@" + domain]
    if length is not None:
        tags.append(b"l=%d" % length)
    tags += [b"q=dns/txt", b"s=" + key.selector.encode(), b"t=%d" % now]
    # Words, each with what joins it to the one before when they share a line.
    words: list[tuple[bytes, bytes]] = [(t + b";", b" ") for t in tags]
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
