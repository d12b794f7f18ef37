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
    host: str
    address: str
    port: int = 25


def make_resolver(address: str | None = None, port: int = 53, timeout: float = 10.0) -> dns.asyncresolver.Resolver:
    if address is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [address]
        resolver.port = port
    resolver.lifetime = timeout
    resolver.timeout = timeout
    return resolver


async def _addresses(resolver: dns.asyncresolver.Resolver, host: str) -> list[str]:
    out: list[str] = []
    for rtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(host, rtype, search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        out += [r.address for r in answer]
    return out


async def lookup(resolver: dns.asyncresolver.Resolver, domain: str, port: int = 25) -> list[Hop]:
    """The hops to try, in order. Raises NoSuchDomain, NullMx or TemporaryLookupFailure."""
    try:
        try:
            answer = await resolver.resolve(domain, "MX", search=False)
            records = sorted((r.preference, random.random(), str(r.exchange).rstrip(".")) for r in answer)
        except dns.resolver.NoAnswer:
            records = []
        if len(records) == 1 and records[0][2] in ("", "."):
            raise NullMx(f"{domain} accepts no mail (null MX)")
        hops: list[Hop] = []
        if not records:
            hops = [Hop(domain, a, port) for a in await _addresses(resolver, domain)]
        for _pref, _r, host in records:
            hops += [Hop(host, a, port) for a in await _addresses(resolver, host)]
    except dns.resolver.NXDOMAIN:
        raise NoSuchDomain(f"domain {domain} does not exist") from None
    except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.exception.DNSException) as exc:
        if isinstance(exc, LookupError_):
            raise
        raise TemporaryLookupFailure(f"DNS lookup for {domain} failed: {exc}") from None
    if not hops:
        raise TemporaryLookupFailure(f"no address found for the mail hosts of {domain}")
    return hops
