"""DANE for SMTP (RFC 7672): TLSA records the resolver validated, matched against the peer's certificates.

A hop's TLSA records are ``_PORT._tcp.HOST`` (``_25._tcp.mx.example.com``).
They count only when the resolver set the AD bit on the answer: the relay
does not validate DNSSEC itself, it trusts the resolver named in
``[delivery] resolver``, which must therefore validate and be reachable
without an attacker in between (on this host). An insecure answer or none
means no DANE: the route's other policy applies. A failed lookup (SERVFAIL:
a bogus signature, a server down) defers the hop, since secure records may
exist that an attacker is hiding.

Usable records (RFC 7672 §3.1): DANE-EE(3), the server's own certificate or
public key, matched with no name or date check; DANE-TA(2), a trust anchor
that must be in the chain the server sent (or be the record itself, for a
full certificate), from which the chain must validate for the MX host's name
or the recipient domain. Selectors: the full certificate (0) or its
SubjectPublicKeyInfo (1); matching: exact (0), SHA-256 (1), SHA-512 (2).
PKIX usages 0 and 1 are unusable for SMTP: records of those alone still
require TLS, without authentication.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence
from typing import Any

import attrs
import dns.asyncresolver
import dns.exception
import dns.flags
import dns.resolver
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.verification import Criticality, ExtensionPolicy, PolicyBuilder, Store, VerificationError

DANE_TA = 2
DANE_EE = 3
# The server's certificate under a DANE-TA anchor: names in a subjectAltName, critical or not, and nothing else
# of the CA/Browser Forum profile (RFC 7672 §3.2.2 asks for the name only).
_EE_POLICY = ExtensionPolicy.permit_all().require_present(x509.SubjectAlternativeName, Criticality.AGNOSTIC, None)


@attrs.frozen
class Tlsa:
    usage: int
    selector: int
    mtype: int
    data: bytes

    @property
    def usable(self) -> bool:
        return self.usage in (DANE_TA, DANE_EE) and self.selector in (0, 1) and self.mtype in (0, 1, 2)

    def __str__(self) -> str:
        return f"{self.usage} {self.selector} {self.mtype} {self.data.hex()}"

    def matches(self, cert: x509.Certificate) -> bool:
        """Whether ``cert`` (its whole DER, or its public key for selector 1) is what this record names."""
        if self.selector == 0:
            chosen = cert.public_bytes(serialization.Encoding.DER)
        else:
            chosen = cert.public_key().public_bytes(serialization.Encoding.DER,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo)
        if self.mtype == 1:
            chosen = hashlib.sha256(chosen).digest()
        elif self.mtype == 2:
            chosen = hashlib.sha512(chosen).digest()
        return chosen == self.data


@attrs.frozen
class TlsaAnswer:
    """The records (if any); ``secure``: the resolver validated them; ``failure``: the lookup failed (why)."""

    records: tuple[Tlsa, ...] = ()
    secure: bool = False
    failure: str = ""


class TlsaLookup:
    def __init__(self, resolver: dns.asyncresolver.Resolver) -> None:
        self.resolver = resolver

    async def lookup(self, host: str, port: int) -> TlsaAnswer:
        name = f"_{port}._tcp.{host.rstrip('.')}"
        try:
            answer = await self.resolver.resolve(name, "TLSA", search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return TlsaAnswer()
        except dns.exception.DNSException as exc:
            return TlsaAnswer(failure=f"TLSA lookup of {name} failed: {exc}")
        secure = answer.response is not None and bool(answer.response.flags & dns.flags.AD)
        records = tuple(Tlsa(r.usage, r.selector, r.mtype, bytes(r.cert)) for r in answer)
        return TlsaAnswer(records, secure)


def peer_chain(stream: Any) -> list[bytes]:
    """The certificates a ``trio.SSLStream`` peer sent, leaf first, as DER.

    Python 3.13 has ``SSLObject.get_unverified_chain``; before it the same
    method exists on the C object under it (since 3.10). Without either, the
    leaf alone (DANE-EE still works, DANE-TA cannot).
    """
    obj = getattr(stream, "_ssl_object", None)
    getter = getattr(obj, "get_unverified_chain", None) or getattr(getattr(obj, "_sslobj", None),
                                                                    "get_unverified_chain", None)
    if getter is not None:
        chain = getter() or []
        return [c if isinstance(c, bytes) else c.public_bytes(2) for c in chain]  # 2: _ssl.ENCODING_DER
    leaf = stream.getpeercert(binary_form=True)
    return [leaf] if leaf else []


def check(chain_der: Sequence[bytes], records: Sequence[Tlsa], names: Sequence[str],
          now: dt.datetime | None = None) -> str | None:
    """None if the chain matches one of ``records``; else why not, in words."""
    try:
        chain = [x509.load_der_x509_certificate(der) for der in chain_der]
    except ValueError as exc:
        return f"unreadable certificate: {exc}"
    if not chain:
        return "the server sent no certificate"
    leaf = chain[0]
    if any(t.usage == DANE_EE and t.matches(leaf) for t in records):
        return None
    anchors = [c for c in chain[1:] for t in records if t.usage == DANE_TA and t.matches(c)]
    for t in records:
        if t.usage == DANE_TA and t.selector == 0 and t.mtype == 0:
            try:
                anchors.append(x509.load_der_x509_certificate(t.data))
            except ValueError:
                pass
    if not anchors:
        return "no certificate the server sent matches its TLSA records"
    when = now or dt.datetime.now(dt.UTC)
    # CA certificates keep the WebPKI rules (a leaf must not act as a CA); the server's own certificate is held
    # to no CA/Browser Forum profile (a critical subjectAltName, say): RFC 7672 asks only for the name.
    builder = PolicyBuilder().store(Store(anchors)).time(when).extension_policies(
        ca_policy=ExtensionPolicy.webpki_defaults_ca(), ee_policy=_EE_POLICY)
    problems: list[str] = []
    for name in names:
        verifier = builder.build_server_verifier(x509.DNSName(name.rstrip(".").lower()))
        try:
            verifier.verify(leaf, chain[1:])
            return None
        except VerificationError as exc:
            problems.append(f"{name}: {exc}")
    return "the chain does not validate from the DANE-TA anchor: " + "; ".join(problems)
