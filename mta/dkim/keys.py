"""DKIM keys: read a key file into a signer of digests (OpenSSL), and write the DNS TXT record that publishes it.

Files an operator may already have are read as they are: an RSA key in PEM
(PKCS#1 ``BEGIN RSA PRIVATE KEY``, as OpenDKIM's ``opendkim-genkey`` and
``openssl genrsa`` wrote it, or PKCS#8 ``BEGIN PRIVATE KEY``, as OpenSSL 3
writes it), an Ed25519 key in PEM (PKCS#8, ``openssl genpkey -algorithm
ed25519``), or an Ed25519 key as the base64 of its 32 bytes (dkimpy's own
format). ``cryptography`` reads them, once, at start: the loaded key signs
every message of the process (RSA PKCS#1 v1.5 or Ed25519, in OpenSSL).
Every key is tried once at load: a message
is signed with it by the relay's own signer and the signature verified by
dkimpy against the record this module would publish, so a key the relay
cannot sign with stops the start, not the first message.

Errors are ``ConfigError`` (exit 2: the config names a file the relay cannot
use) and name the setting, the domain, the selector and the file.
"""

from __future__ import annotations

import base64
import textwrap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from mta.config.dkim import DkimKey
from spool import ConfigError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

__all__ = ["MIN_RSA_BITS", "KeyProblem", "SigningKey", "dns_record", "load_key", "load_keys", "public_record"]

MIN_RSA_BITS = 1024  # RFC 8301 §3.2: signers MUST use at least 1024 bits (2048 is what keygen writes)
RSA = b"rsa-sha256"
ED25519 = b"ed25519-sha256"
_PROBE = (b"From: probe@example.invalid\r\nSubject: key check\r\nDate: Thu, 1 Jan 2026 00:00:00 +0000\r\n\r\n"
          b"This message checks that a key signs.\r\n")


class KeyProblem(ConfigError):
    """A key file the relay cannot sign with: one line naming the key's setting, domain, selector and file."""


@attrs.frozen
class SigningKey:
    """One key, ready to sign: ``sign_digest`` turns a SHA-256 digest into the ``b=`` bytes of ``algorithm``."""

    domain: str
    selector: str
    algorithm: bytes  # b"rsa-sha256" or b"ed25519-sha256"
    sign_digest: Callable[[bytes], bytes] = attrs.field(repr=False, eq=False)
    public: str  # the p= value: base64 of the SubjectPublicKeyInfo (RSA) or of the 32-byte key (Ed25519)
    active: bool = True
    bits: int = 0  # RSA modulus size; 0 for Ed25519

    @property
    def kind(self) -> str:
        """``rsa`` or ``ed25519``: the record's ``k=``."""
        return "rsa" if self.algorithm == RSA else "ed25519"

    @property
    def name(self) -> str:
        """Where the record lives: ``SELECTOR._domainkey.DOMAIN``."""
        return f"{self.selector}._domainkey.{self.domain}"

    def record_text(self) -> str:
        """The TXT record's text (one string; DNS splits it into 255-byte pieces)."""
        return public_record(self.kind, self.public)


def public_record(kind: str, public: str) -> str:
    return f"v=DKIM1; k={kind}; p={public}"


def dns_record(name: str, text: str, ttl: int = 3600) -> str:
    """A zone-file line for a TXT record: ``NAME. TTL IN TXT "..." "..."``, pieces of at most 255 bytes.

    One line that BIND, NSD, Knot and dnspython read as they are (several
    strings of one TXT record are joined by the reader, RFC 6376 §3.6.2.2).
    """
    pieces = textwrap.wrap(text, 255, break_long_words=True, break_on_hyphens=False, drop_whitespace=False)
    return f"{name}. {ttl} IN TXT " + " ".join(f'"{p}"' for p in pieces)


def _parse(data: bytes) -> rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey:
    """The private key in ``data``; ValueError says what is wrong with it."""
    # cryptography and dkimpy are imported where a key is read: a relay with no [[dkim.key]] never loads them.
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    text = data.strip()
    if b"-----BEGIN" not in text:
        try:
            raw = base64.b64decode(text, validate=True)
        except ValueError:
            raise ValueError("neither PEM nor the base64 of an Ed25519 key") from None
        if len(raw) != 32:
            raise ValueError(f"base64 of {len(raw)} bytes; an Ed25519 key is 32")
        return ed25519.Ed25519PrivateKey.from_private_bytes(raw)
    try:
        key = serialization.load_pem_private_key(text, password=None)
    except TypeError:
        raise ValueError("it is encrypted; the relay needs a key without a passphrase") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"not a PEM private key it can read ({str(exc).splitlines()[0]})") from None
    if not isinstance(key, (rsa.RSAPrivateKey, ed25519.Ed25519PrivateKey)):
        raise ValueError(f"a {type(key).__name__.removesuffix('PrivateKey').lstrip('_')} key; DKIM signs with "
                         "RSA or Ed25519")
    return key


def signing_key(key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey, domain: str, selector: str,
                active: bool = True) -> SigningKey:
    """A parsed key as a signer of digests, with the ``p=`` of its DNS record.

    RSA signs the digest as it is (PKCS#1 v1.5 over a SHA-256 that is already
    computed: ``Prehashed``); Ed25519 signs the 32 bytes of the digest, as
    RFC 8463 §3 has it.
    """
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils

    if isinstance(key, rsa.RSAPrivateKey):
        pad, prehashed = padding.PKCS1v15(), utils.Prehashed(hashes.SHA256())
        rsa_key = key

        def sign_rsa(digest: bytes) -> bytes:
            return rsa_key.sign(digest, pad, prehashed)

        spki = key.public_key().public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)
        return SigningKey(domain, selector, RSA, sign_rsa, base64.b64encode(spki).decode(), active, key.key_size)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return SigningKey(domain, selector, ED25519, key.sign, base64.b64encode(raw).decode(), active)


def load_key(entry: DkimKey, where: str = "dkim.key", source: str = "") -> SigningKey:
    """Read, convert and try one configured key.

    Raises:
        KeyProblem: the file cannot be read, is no usable key, or does not sign.
    """
    def problem(what: str) -> KeyProblem:
        return KeyProblem(f"the key of {entry.domain} (selector {entry.selector}) in {entry.key_file}: {what}",
                          source, where)

    try:
        with open(entry.key_file, "rb") as f:
            data = f.read(1 << 16)
    except OSError as exc:
        raise problem(f"cannot read it: {exc.strerror or exc}") from None
    try:
        key = signing_key(_parse(data), entry.domain, entry.selector, entry.active)
    except ValueError as exc:
        raise problem(str(exc)) from None
    if key.algorithm == RSA and key.bits < MIN_RSA_BITS:
        raise problem(f"an RSA key of {key.bits} bits; DKIM needs at least {MIN_RSA_BITS} (RFC 8301), "
                      "2048 is usual")
    _try(key, problem)
    return key


def _try(key: SigningKey, problem: Callable[[str], KeyProblem]) -> None:
    """Sign a probe message as the relay does and have dkimpy verify it against the key's own record.

    A key that cannot sign stops the start; so does a signer whose output
    the reference verifier does not accept.
    """
    import dkim

    from mta.dkim.canon import split
    from mta.dkim.header import body_hash, signature_field

    def own_record(name: bytes, timeout: int = 5) -> bytes:
        return key.record_text().encode()

    parsed = split(_PROBE)
    relaxed = (b"relaxed", b"relaxed")
    try:
        header = signature_field(key, parsed.fields, (b"from", b"subject", b"date"), relaxed,
                                 body_hash(parsed.body, True)[0], int(time.time()))
        ok = dkim.verify(header + _PROBE, dnsfunc=own_record)
    except (ValueError, dkim.DKIMException) as exc:  # cryptography's refusals are ValueErrors
        ok, why = False, str(exc)
    else:
        why = "its signature does not verify"
    if not ok:
        raise problem(f"it does not sign ({why})")


def load_keys(entries: tuple[DkimKey, ...], source: str = "") -> tuple[SigningKey, ...]:
    """Every configured key, in order. Raises KeyProblem for the first that cannot be used."""
    return tuple(load_key(e, f"dkim.key[{i}]", source) for i, e in enumerate(entries))
