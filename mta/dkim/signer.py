"""Which keys sign a message, and the DKIM-Signature header fields they make.

Theory of operation
-------------------
A message is signed for the domain of its ``From:`` (RFC 5322.From), the
identity receivers show and DMARC aligns with, not for its envelope sender:
mail whose ``From:`` is at a domain with keys gets one signature per active
key of that domain (two while a key is rotated, or an RSA and an Ed25519 key
side by side), in the order of the config. Nothing else is signed: a domain without
keys, a message with no ``From:`` or with several (RFC 5322 allows one; a
receiver applying DMARC rejects such mail anyway), or with mailboxes at
several domains in it. Who may have mail signed at all is the caller's
decision (``mta.dkim.accept``: clients the relay trusts to relay).

Canonicalisation is relaxed/relaxed (RFC 6376 §3.4.2, §3.4.4): it survives
the header refolding and trailing-space changes that relays make. The ``h=``
list is the configured fields as often as the message has them, then each
over-signed field once more, so that a copy added in transit makes the
signature fail (RFC 6376 §8.15). No ``l=`` (a body length would let anyone
append to the message).

The message is read by ``mta.dkim.canon`` and the field made by
``mta.dkim.header``; the signature itself is OpenSSL's (``cryptography``),
with the key loaded once at start. dkimpy is the reference the tests hold
the signatures to (and the verifier of the key check at start); its own
signer does RSA in pure Python, several milliseconds a signature.

``sign`` is blocking and CPU-bound (the RSA signature, and hashing that
scales with the body): the relay calls it on the event loop for a small
message and in a worker thread for a large one (``mta.dkim.accept``).
"""

from __future__ import annotations

import email.utils
import re
import time

import attrs

from mta.config.dkim import DkimSection
from mta.dkim.canon import Malformed, split
from mta.dkim.header import body_hash, signature_field
from mta.dkim.keys import SigningKey

__all__ = ["Signature", "Signer", "Unsigned"]

CANONICALIZE = (b"relaxed", b"relaxed")
# ``Name <local@domain>`` or ``local@domain`` with nothing in them that RFC 5322 reads specially (quotes,
# comments, groups, lists): the domain without the email package's parser, which costs more than the signature.
_ADDRESS = rb"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@([A-Za-z0-9.-]+)"
_PLAIN_FROM = re.compile(rb"[ \t]*(?:[A-Za-z0-9 \t._-]*<" + _ADDRESS + rb">|" + _ADDRESS + rb")[ \t]*\r\n")


@attrs.frozen
class Signature:
    """The DKIM-Signature field(s) to put before the message, CRLF-ended, and who signed."""

    header: bytes
    signed_by: tuple[str, ...]  # ``domain/selector`` of each signature, in header order
    seconds: float  # the time spent signing (parsing, hashing, the signatures)


@attrs.frozen
class Unsigned:
    """Why a message was not signed: ``no_key`` (its From: domain has none), ``no_from``, ``several_from``,
    ``mixed_from``, or ``error`` (the message cannot be read or signed: ``detail`` says why)."""

    reason: str
    domain: str = ""
    detail: str = ""


class Signer:
    """The configured keys by domain and the header policy; ``sign`` makes a message's signatures."""

    def __init__(self, keys: tuple[SigningKey, ...], section: DkimSection) -> None:
        self.by_domain: dict[str, list[SigningKey]] = {}
        for key in keys:
            if key.active:
                self.by_domain.setdefault(key.domain, []).append(key)
        self.headers = tuple(dict.fromkeys(h.lower().encode() for h in section.headers))
        self.oversign = tuple(dict.fromkeys(h.lower().encode() for h in section.oversign))

    def __bool__(self) -> bool:
        return bool(self.by_domain)

    def sign(self, message: bytes) -> Signature | Unsigned:
        """The signatures for ``message`` (CRLF line ends, as the spool keeps it), or why there are none.

        Never raises: the message is a client's bytes, and whatever the
        parser makes of them (its refusal, or an exception nobody meant)
        leaves the message unsigned, not refused.
        """
        try:
            return self._sign(message, int(time.time()))
        except Exception as exc:  # a peer's bytes: the mail goes on unsigned
            return Unsigned("error", detail=f"{type(exc).__name__}: {exc}")

    def _sign(self, message: bytes, now: int) -> Signature | Unsigned:
        """``sign``; a malformed message is an Unsigned, anything else is raised."""
        start = time.perf_counter()
        try:
            parsed = split(message)
        except Malformed as exc:
            return Unsigned("error", detail=str(exc))
        names = [f.name.lower() for f in parsed.fields]
        domain = _one_domain([f.value for f, name in zip(parsed.fields, names, strict=True) if name == b"from"])
        if isinstance(domain, Unsigned):
            return domain
        keys = self.by_domain.get(domain)
        if not keys:
            return Unsigned("no_key", domain)
        include = self.include_headers(names)
        bh = body_hash(parsed.body, CANONICALIZE[1] == b"relaxed")[0]  # SHA-256 for both algorithms
        fields = [signature_field(key, parsed.fields, include, CANONICALIZE, bh, now) for key in keys]
        return Signature(b"".join(fields), tuple(f"{k.domain}/{k.selector}" for k in keys),
                         time.perf_counter() - start)

    def include_headers(self, names: list[bytes]) -> tuple[bytes, ...]:
        """``h=`` for the message's field names (lower case): each configured field as many times as present,
        then each over-signed field once more."""
        count: dict[bytes, int] = {}
        for name in names:
            count[name] = count.get(name, 0) + 1
        include = [h for h in self.headers if h in count for _ in range(count[h])]
        return (*include, *self.oversign)


def from_domain(headers: list[tuple[bytes, bytes]]) -> str | Unsigned:
    """The one domain of the message's From: field, in lower case, or why there is none."""
    return _one_domain([value for name, value in headers if name.lower() == b"from"])


def _one_domain(values: list[bytes]) -> str | Unsigned:
    """``from_domain`` of the values of the message's From: fields."""
    if not values:
        return Unsigned("no_from")
    if len(values) > 1:
        return Unsigned("several_from")
    simple = _PLAIN_FROM.fullmatch(values[0])
    if simple is not None:
        return (simple.group(1) or simple.group(2)).rstrip(b".").lower().decode("ascii") or Unsigned("no_from")
    return parsed_domain(values[0])


def parsed_domain(value: bytes) -> str | Unsigned:
    """The one domain of a From: value, read by the email package's address parser."""
    text = value.decode("utf-8", "replace").replace("\r\n", "")
    domains = {addr.rpartition("@")[2].strip().rstrip(".").lower()
               for _, addr in email.utils.getaddresses([text]) if "@" in addr}
    domains.discard("")
    if not domains:
        return Unsigned("no_from")
    if len(domains) > 1:
        return Unsigned("mixed_from")
    return domains.pop()
