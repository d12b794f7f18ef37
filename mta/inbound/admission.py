"""Who gets an SMTP session slot: limits in total, per client address, per client network.

Theory of operation
-------------------
A relay on port 25 has a fixed number of session slots (``max_sessions``).
Slow or hostile clients that hold them lock everyone out, so three rules
decide whether a new connection gets one, checked in ``SessionSlots.admit``
before the greeting:

- ``reserved_sessions`` of the slots are only for clients in ``mynetworks``:
  outsiders together hold at most ``max_sessions - reserved_sessions``, so the
  relay's own users can always submit mail, however many strangers are
  connected.
- An outsider address holds at most ``max_sessions_per_client`` slots, and its
  network (the /24 of an IPv4 address, the /64 of an IPv6 one: what one
  customer or one host typically has) at most ``max_sessions_per_network``.
- Clients in ``mynetworks`` are exempt from the per-address and per-network
  limits (as from Postfix's anvil limits, ``smtpd_client_event_limit_exceptions``
  defaulting to ``$mynetworks``); only the total bounds them.

A refused connection gets ``421 4.7.0`` from the server and is closed. The
counts are in memory, per relay process, and a slot is returned the moment its
session ends, whatever ended it.

No I/O here: the server asks ``admit`` and later calls ``release`` with what it got.
"""

from __future__ import annotations

import enum
import ipaddress

import attrs

from mta.config import Config


class Refusal(enum.Enum):
    """Why a connection got no slot (the label of the ``logspool_smtp_sessions_refused`` metric)."""

    TOTAL = "total"  # every slot is taken
    RESERVED = "reserved"  # only the slots kept for mynetworks are left
    CLIENT = "client"  # this address holds max_sessions_per_client
    NETWORK = "network"  # this /24 or /64 holds max_sessions_per_network


@attrs.frozen
class Slot:
    """A session's claim, handed back to ``release``. ``trusted``: the client is in mynetworks."""

    client: str
    network: str
    trusted: bool


def client_keys(client_ip: str, prefix_v4: int = 24, prefix_v6: int = 64) -> tuple[str, str]:
    """The address and the network that the limits count a client under.

    An IPv4-mapped IPv6 address (``::ffff:192.0.2.1``, how a dual-stack socket
    reports an IPv4 client) counts as the IPv4 address, so one client cannot
    be two. A peer name that is not an IP address counts as itself for both.
    """
    try:
        address = ipaddress.ip_address(client_ip)
    except ValueError:
        return client_ip, client_ip
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    prefix = prefix_v4 if address.version == 4 else prefix_v6
    network = ipaddress.ip_network(f"{address}/{prefix}", strict=False)
    return str(address), str(network)


# Clients whose keys and trust are remembered (``SessionSlots._client``); the memory is dropped when full.
CLIENT_CACHE = 4096


class SessionSlots:
    """The session counts of one relay process."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.total = 0
        self.outsiders = 0
        self.per_client: dict[str, int] = {}
        self.per_network: dict[str, int] = {}
        self._clients: dict[str, tuple[str, str, bool]] = {}

    def _client(self, client_ip: str) -> tuple[str, str, bool]:
        """The client's address and network keys and whether it is in mynetworks, worked out once per address.

        Why: parsing the address, building its network and matching mynetworks
        took ~30 us a connection, as much as a lone client's whole reply to
        MAIL. The config does not change in a process's life; the
        memory is bounded (cleared at ``CLIENT_CACHE`` addresses).
        """
        known = self._clients.get(client_ip)
        if known is None:
            s = self.config.server
            client, network = client_keys(client_ip, s.network_prefix_ipv4, s.network_prefix_ipv6)
            known = (client, network, self.config.in_mynetworks(client_ip))
            if len(self._clients) >= CLIENT_CACHE:
                self._clients.clear()
            self._clients[client_ip] = known
        return known

    def admit(self, client_ip: str) -> Slot | Refusal:
        """A slot for a new session from ``client_ip``, or why there is none."""
        s = self.config.server
        client, network, trusted = self._client(client_ip)
        if self.total >= s.max_sessions:
            return Refusal.TOTAL
        if not trusted:
            if self.outsiders >= s.max_sessions - s.reserved_sessions:
                return Refusal.RESERVED
            if self.per_client.get(client, 0) >= s.max_sessions_per_client:
                return Refusal.CLIENT
            if self.per_network.get(network, 0) >= s.max_sessions_per_network:
                return Refusal.NETWORK
        slot = Slot(client, network, trusted)
        self.total += 1
        if not trusted:
            self.outsiders += 1
            self.per_client[client] = self.per_client.get(client, 0) + 1
            self.per_network[network] = self.per_network.get(network, 0) + 1
        return slot

    def release(self, slot: Slot) -> None:
        self.total -= 1
        if not slot.trusted:
            self.outsiders -= 1
            _count_down(self.per_client, slot.client)
            _count_down(self.per_network, slot.network)


def _count_down(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
