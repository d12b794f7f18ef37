"""Where mail for a domain goes: MX records in preference order, else the domain itself.

RFC 5321 §5.1: MX hosts sorted by preference (ties shuffled), each resolved to
its addresses; no MX record means the implicit MX, the domain's own A/AAAA.
A "null MX" (RFC 7505: a single MX of ".") means the domain takes no mail.
The resolver's address is configurable so tests point it at a local server.
"""

from __future__ import annotations

import random

import attrs
import dns.asyncresolver
import dns.exception
import dns.flags
import dns.rdatatype
import dns.resolver


class LookupError_(Exception):
    """Base of lookup failures; ``permanent`` says whether retrying can help."""

    permanent = False


class NoSuchDomain(LookupError_):
    permanent = True


class NullMx(LookupError_):
    permanent = True


class TemporaryLookupFailure(LookupError_):
    pass


@attrs.frozen
class Hop:
    """One address to try. ``secure``: the resolver validated (DNSSEC, the AD bit) how it was found.

    That is the MX RRset and the host's address records (for the implicit MX,
    the address records): DANE applies to a host only then (RFC 7672 §2.2).
    """

    host: str
    address: str
    port: int = 25
    secure: bool = False


def make_resolver(address: str | None = None, port: int = 53, timeout: float = 10.0) -> dns.asyncresolver.Resolver:
    if address is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [address]
        resolver.port = port
    # AD in a query asks a validating resolver to say whether it validated the answer (RFC 6840 §5.7).
    resolver.flags = dns.flags.RD | dns.flags.AD
    resolver.lifetime = timeout
    resolver.timeout = timeout
    return resolver


async def addresses(resolver: dns.asyncresolver.Resolver, host: str) -> list[str]:
    return (await _addresses(resolver, host))[0]


def _validated(answer: dns.resolver.Answer) -> bool:
    return answer.response is not None and bool(answer.response.flags & dns.flags.AD)


async def _addresses(resolver: dns.asyncresolver.Resolver, host: str) -> tuple[list[str], bool]:
    """The host's addresses, and whether every answer that gave one was validated."""
    out: list[str] = []
    secure = True
    for rtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(host, rtype, search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        out += [r.address for r in answer]
        secure = secure and _validated(answer)
    return out, secure and bool(out)


async def lookup(resolver: dns.asyncresolver.Resolver, domain: str, port: int = 25) -> list[Hop]:
    """The hops to try, in order. Raises NoSuchDomain, NullMx or TemporaryLookupFailure."""
    try:
        try:
            answer = await resolver.resolve(domain, "MX", search=False)
            records = sorted((r.preference, random.random(), str(r.exchange).rstrip(".")) for r in answer)
            mx_secure = _validated(answer)
        except dns.resolver.NoAnswer:
            records, mx_secure = [], True  # the implicit MX: only its addresses' validation counts
        if len(records) == 1 and records[0][2] in ("", "."):
            raise NullMx(f"{domain} accepts no mail (null MX)")
        hops: list[Hop] = []
        for host in [domain] if not records else [host for _pref, _r, host in records]:
            found, secure = await _addresses(resolver, host)
            hops += [Hop(host, a, port, mx_secure and secure) for a in found]
    except dns.resolver.NXDOMAIN:
        raise NoSuchDomain(f"domain {domain} does not exist") from None
    except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.exception.DNSException) as exc:
        if isinstance(exc, LookupError_):
            raise
        raise TemporaryLookupFailure(f"DNS lookup for {domain} failed: {exc}") from None
    if not hops:
        raise TemporaryLookupFailure(f"no address found for the mail hosts of {domain}")
    return hops
