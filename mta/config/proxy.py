"""``[proxy]``: SMTP listeners behind a TCP balancer that speaks the PROXY protocol (v1 or v2).

A connection to one of these addresses must come from a balancer named in
``balancers`` and begin with a PROXY header (``mta.inbound.proxy_header``);
the client the header names is then the session's peer for everything that
looks at it: session limits, ``mynetworks`` and relay control, the AUTH
failure limit, ``Received:``, the log lines. These listeners serve what
``[server] listen`` serves (relay and inbound mail); the submission
listeners take no PROXY header.
"""

from __future__ import annotations

import ipaddress

import attrs

from mta.config.values import IPNetwork, Listen, ListenAddress, Network
from spool import Duration, ListOf, setting

__all__ = ["ProxySection"]


@attrs.frozen(kw_only=True)
class ProxySection:
    """``[proxy]``: docs/operations.md, "Behind a load balancer"."""

    listen: tuple[ListenAddress, ...] = setting(
        ListOf(Listen()), "SMTP addresses (the role of `[server] listen`) where every connection begins with a "
        "PROXY header, v1 or v2, from a balancer in `balancers`; none: off", ())
    balancers: tuple[IPNetwork, ...] = setting(
        ListOf(Network(), least=1, needed="at least one network is needed"),
        "the networks the balancers connect from; a connection to `listen` from anywhere else is closed before the "
        "banner, unanswered", (ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("::1/128")))
    header_timeout: float = setting(
        Duration(positive=True), "how long a balancer has to send the whole header once it connected; then the "
        "connection is closed", 5.0)

    def from_balancer(self, address: str) -> bool:
        """Whether a connection from ``address`` may carry a PROXY header (an IPv4-mapped address as IPv4)."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self.balancers)
