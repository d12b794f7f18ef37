"""The relay's signer against the references: dkimpy's canonicalisation and verifier, and Debian's OpenDKIM.

Random messages (folded, repeated and oddly spaced header fields; bodies
with runs of tabs and spaces, trailing white space, empty lines at the end,
no final CRLF, empty bodies) are signed by ``mta.dkim.header`` with an
RSA-2048 and an Ed25519 key, relaxed/relaxed and simple/simple, with and
without ``l=``. Each signature must verify with dkimpy and with ``opendkim``
(its verifier, ``opendkim -t``), and what we hash must be what dkimpy hashes:
the same canonical header fields and the same body hash.
"""

from __future__ import annotations

import base64
import hashlib
import tempfile
from pathlib import Path

import dkim
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from dkim.canonicalization import CanonicalizationPolicy
from dkim_support import opendkim_verdicts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mta.config.dkim import DkimSection
from mta.dkim.canon import body_canonical, header_canonical, split
from mta.dkim.header import body_hash, signature_field
from mta.dkim.keys import SigningKey, signing_key
from mta.dkim.signer import Signature, Signer, from_domain, parsed_domain

_RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
RSA_KEY = signing_key(_RSA, "example.com", "rsa1")
RSA_PEM = _RSA.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())  # the form dkimpy's own signer reads
ED_KEY = signing_key(ed25519.Ed25519PrivateKey.generate(), "example.com", "ed1")
RECORDS = {k.name: k.record_text() for k in (RSA_KEY, ED_KEY)}
INCLUDE = (b"from", b"to", b"subject", b"date", b"x-tag", b"x-tag", b"from")
CANONICALIZATIONS = [(b"relaxed", b"relaxed"), (b"simple", b"simple")]
NOW = 1_796_000_000


def _lookup(name: bytes, timeout: int = 5) -> bytes | None:
    text = RECORDS.get(name.decode().rstrip("."))
    return text.encode() if text else None


_word = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"), min_size=1,
                max_size=12).map(str.encode)
_space = st.sampled_from([b" ", b"  ", b"\t", b" \t ", b""])


@st.composite
def values(draw: st.DrawFn, one_space: bool = False) -> bytes:
    """A header field value: words, runs of WSP, maybe folded, maybe trailing white space.

    ``one_space``: the value begins with one space, as MUAs write it. A milter
    is handed the value without what follows the colon, and OpenDKIM puts one
    space back (so under simple header canonicalisation it cannot verify
    ``To:x`` or ``To:  x``, signed by whoever: a limit of the milter protocol).
    """
    parts = [b" " if one_space else draw(_space)]
    for _ in range(draw(st.integers(1, 6))):
        parts += [draw(_word), draw(st.sampled_from([b" ", b"\t", b"  ", b"\r\n ", b"\r\n\t", b" \r\n  "]))]
    parts[-1] = draw(st.sampled_from([b"", b" ", b"\t"]))
    return b"".join(parts)


@st.composite
def messages(draw: st.DrawFn, smtp: bool = False) -> bytes:
    """A message; ``smtp``: as MUAs write one and SMTP's DATA delivers it (see ``values``), CRLF-ended."""
    names = [b"To", b"Subject", b"Date", b"X-Tag", b"Received", b"x-tag", b"SUBJECT", b"Message-ID"]
    fields = [(draw(st.sampled_from(names)), draw(values(smtp))) for _ in range(draw(st.integers(0, 6)))]
    fields.insert(draw(st.integers(0, len(fields))),
                  (draw(st.sampled_from([b"From", b"from", b"FROM"])), b" Alice <alice@example.com>"))
    head = b"".join(name + b":" + value + b"\r\n" for name, value in fields)
    line = st.lists(st.sampled_from([b"a", b"word", b" ", b"  ", b"\t", b"\xc3\xa9", b"."]), max_size=30)
    lines = [b"".join(parts) for parts in draw(st.lists(line, max_size=20))]
    ends = [b"\r\n", b"\r\n\r\n", b"\r\n \r\n\r\n", b" \t\r\n"] + ([] if smtp else [b"", b" \t"])
    body = b"\r\n".join(lines) + draw(st.sampled_from(ends))
    return head + b"\r\n" + body


def _dkimpy_canonical(message: bytes, c: tuple[bytes, bytes]) -> tuple[bytes, bytes]:
    """What dkimpy hashes of every header field (in order) and the body hash it computes."""
    headers, body = dkim.rfc822_parse(message)
    policy = CanonicalizationPolicy.from_c_value(b"/".join(c))
    fields = b"".join(name + b":" + value for name, value in policy.canonicalize_headers(headers))
    return fields, base64.b64encode(hashlib.sha256(policy.canonicalize_body(body)).digest())


def _sign(message: bytes, c: tuple[bytes, bytes], body_length: bool, *keys: SigningKey) -> bytes:
    parsed = split(message)
    bh, length = body_hash(parsed.body, c[1] == b"relaxed")
    return b"".join(signature_field(k, parsed.fields, INCLUDE, c, bh, NOW, length if body_length else None)
                    for k in keys)


def _dkimpy_verifies(data: bytes, count: int) -> list[bool]:
    d = dkim.DKIM(data)
    return [bool(d.verify(idx=i, dnsfunc=_lookup)) for i in range(count)]


@pytest.mark.parametrize("c", CANONICALIZATIONS, ids=lambda c: b"/".join(c).decode())
@settings(max_examples=150, deadline=None)
@given(message=messages())
def test_what_is_hashed_is_what_dkimpy_hashes(message: bytes, c: tuple[bytes, bytes]) -> None:
    relaxed = c[0] == b"relaxed"
    parsed = split(message)
    fields, bh = _dkimpy_canonical(message, c)
    assert b"".join(header_canonical(f, relaxed) for f in parsed.fields) == fields
    assert body_hash(parsed.body, c[1] == b"relaxed")[0] == bh


# Pieces of a body: words, runs of WSP, every kind of line end (a bare CR is data, a bare LF is read as CRLF).
_body_piece = st.sampled_from([b"a", b"word", b"\xc3\xa9", b".", b" ", b"  ", b"   ", b"\t", b" \t", b"\t\t ",
                               b"\r", b"\n", b"\r\n", b"\r\r\n", b" \r\n", b"\t\n", b"\r\n\r\n"])
_body_end = st.sampled_from([b"", b" ", b"\t", b"\r", b"\n", b"\r\n", b"\n\n", b"\r\n\r\n", b" \r\n",
                             b"\t\r\n\r\n", b"\r\n \t\r\n", b"\r\n\r\n\r\n"])


@pytest.mark.parametrize("relaxed", [True, False], ids=["relaxed", "simple"])
@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(_body_piece, max_size=40), end=_body_end)
def test_the_canonical_body_is_dkimpys(pieces: list[bytes], end: bytes, relaxed: bool) -> None:
    """The body as hashed, byte for byte: bare CR and LF, CRLF, tabs, runs and trailing WSP, empty lines at the end."""
    message = b"From: alice@example.com\r\n\r\n" + b"".join(pieces) + end
    policy = CanonicalizationPolicy.from_c_value(b"relaxed/relaxed" if relaxed else b"simple/simple")
    assert body_canonical(split(message).body, relaxed) == policy.canonicalize_body(dkim.rfc822_parse(message)[1])


@pytest.mark.parametrize("body_length", [False, True], ids=["whole body", "l="])
@pytest.mark.parametrize("c", CANONICALIZATIONS, ids=lambda c: b"/".join(c).decode())
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=messages(smtp=True))
def test_signatures_verify_with_dkimpy_and_opendkim(message: bytes, c: tuple[bytes, bytes],
                                                    body_length: bool) -> None:
    """RSA and Ed25519, each verified by both references; ``l=`` is the canonical body's length.

    The messages end in CRLF, as every message the relay signs does (SMTP's
    DATA ends with CRLF.CRLF): ``opendkim -t`` reads a file whose last line has
    no line end otherwise than RFC 6376 and dkimpy do.
    """
    header = _sign(message, c, body_length, RSA_KEY, ED_KEY)
    signed = header + message
    assert _dkimpy_verifies(signed, 2) == [True, True]
    with tempfile.TemporaryDirectory() as where:
        assert opendkim_verdicts(signed, RECORDS, Path(where)) == ["pass", "pass"]
    sig = dkim.util.parse_tag_value(dkim.rfc822_parse(signed)[0][0][1])
    assert sig[b"c"] == b"/".join(c) and (b"l" in sig) == body_length
    if body_length:
        assert int(sig[b"l"]) == body_hash(split(message).body, c[1] == b"relaxed")[1]


@pytest.mark.parametrize("size", [4096, 100 * 1024], ids=["4 KB", "100 KB"])
def test_the_relays_policy_signature_verifies_and_matches_dkimpys_tags(size: int, tmp_path: Path) -> None:
    """``Signer`` (relaxed/relaxed, the default h=) at both benchmark sizes: both references pass it, and its tags
    but ``b=`` and ``t=`` are what dkimpy's own signer writes for the same message and key."""
    line = b"The quick brown fox  jumps over the lazy dog,\tand again \r\n"
    message = (b"From: Alice <alice@example.com>\r\nTo: bob@dest.test\r\nSubject: figures\r\n"
               b"Date: Thu, 26 Nov 2026 10:00:00 +0000\r\nMessage-ID: <a@example.com>\r\n\r\n"
               + line * (size // len(line)) + b"\r\n\r\n")
    result = Signer((RSA_KEY, ED_KEY), DkimSection()).sign(message)
    assert isinstance(result, Signature)
    signed = result.header + message
    assert _dkimpy_verifies(signed, 2) == [True, True]
    assert opendkim_verdicts(signed, RECORDS, tmp_path) == ["pass", "pass"]
    ours = dkim.util.parse_tag_value(dkim.rfc822_parse(signed)[0][0][1])
    reference = dkim.util.parse_tag_value(dkim.sign(
        message, b"rsa1", b"example.com", RSA_PEM, canonicalize=(b"relaxed", b"relaxed"),
        include_headers=[b"from", b"subject", b"date", b"to", b"message-id", b"from"]).split(b":", 1)[1])
    for tag in (b"t", b"b"):
        del ours[tag], reference[tag]
    ours[b"h"] = ours[b"h"].replace(b"\r\n\t", b"")
    reference[b"h"] = reference[b"h"].replace(b" ", b"").replace(b"\r\n", b"")
    assert ours == reference


def test_a_changed_body_fails_both_references(tmp_path: Path) -> None:
    message = b"From: alice@example.com\r\nSubject: x\r\n\r\nthe body\r\n"
    signed = _sign(message, (b"relaxed", b"relaxed"), False, RSA_KEY, ED_KEY) + message.replace(b"the", b"a")
    assert opendkim_verdicts(signed, RECORDS, tmp_path) == ["fail", "fail"]
    d = dkim.DKIM(signed)
    with pytest.raises(dkim.ValidationError):  # a body hash mismatch is raised, not returned
        d.verify(idx=0, dnsfunc=_lookup)


_atom = st.text(st.sampled_from("abcXYZ09._-+="), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(name=st.one_of(st.none(), st.text(st.sampled_from("Al ice.\t_-\"(),;:<@"), max_size=10)), local=_atom,
       domain=st.text(st.sampled_from("abc.-EXAMPLE0"), min_size=1, max_size=12),
       space=st.sampled_from(["", " ", "  ", "\t"]))
def test_the_from_fast_path_names_the_domain_the_address_parser_does(name: str | None, local: str, domain: str,
                                                                     space: str) -> None:
    """``from_domain`` reads plain ``Name <a@b>`` values without the email package: it must agree with it."""
    address = f"{local}@{domain}"
    value = (f"{space}{address}{space}\r\n" if name is None else f"{space}{name}<{address}>{space}\r\n").encode()
    assert from_domain([(b"From", value)]) == parsed_domain(value)
