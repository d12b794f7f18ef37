"""The client's names from the DNS, as Postfix's smtpd finds them for policy servers and milters.

``reverse_client_name`` is what the PTR record of the client's address
says, unchecked; ``client_name`` is that name only if it also resolves back
to the client's address (forward-confirmed), else ``unknown``. Either is
``unknown`` when the lookups fail or take longer than ``LOOKUP_TIMEOUT``:
a slow DNS costs the session a few seconds once, never a refusal. The
lookups use the relay's resolver (``[delivery] resolver``) and are made
once per session, the first time something asks (``_Session.client_names``).
"""

from __future__ import annotations

import ipaddress

import attrs
import dns.asyncresolver
import dns.exception
import dns.reversename
import trio

from mta.delivery import mx

__all__ = ["LOOKUP_TIMEOUT", "UNKNOWN", "ClientNames", "look_up"]

LOOKUP_TIMEOUT = 5.0  # both lookups together


@attrs.frozen
class ClientNames:
    name: str = "unknown"  # forward-confirmed
    reverse: str = "unknown"  # the PTR's, unchecked


UNKNOWN = ClientNames()


def _same(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return False
    if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped is not None:
        x = x.ipv4_mapped
    return x == y


async def look_up(resolver: dns.asyncresolver.Resolver, client_ip: str) -> ClientNames:
    """The names of ``client_ip``; never raises for what the DNS does."""
    with trio.move_on_after(LOOKUP_TIMEOUT):
        try:
            ip = ipaddress.ip_address(client_ip)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            answer = await resolver.resolve(dns.reversename.from_address(str(ip)), "PTR", search=False)
            reverse = str(answer[0].target).rstrip(".").lower()
            if not reverse:
                return UNKNOWN
            forward = await mx.addresses(resolver, reverse)
        except (dns.exception.DNSException, ValueError, OSError):
            return UNKNOWN
        return ClientNames(reverse if any(_same(a, str(ip)) for a in forward) else "unknown", reverse)
    return UNKNOWN
