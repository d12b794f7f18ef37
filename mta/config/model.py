"""The whole, validated config, and the decisions that need more than one section: routing and relay control."""

from __future__ import annotations

import ipaddress
import types
from collections.abc import Mapping

import attrs

from mta.config.bounce_classes import BounceClassesSection
from mta.config.client_certs import ClientCertsSection
from mta.config.dkim import DkimKey, DkimSection
from mta.config.egress import EgressSection
from mta.config.events import EventsSection
from mta.config.filters import FiltersSection
from mta.config.http import HttpSection
from mta.config.limits import LimitsSection
from mta.config.policy import PolicySection
from mta.config.proxy import ProxySection
from mta.config.recipients import RecipientsSection
from mta.config.routes import LmtpRoute, MaildirRoute, NoRoute, Route, match_domain, normalize_domain
from mta.config.sections import (
    DeliveryConfig,
    LogConfig,
    RelayConfig,
    ServerConfig,
    SpoolSection,
    SubmissionConfig,
    TlsPolicyConfig,
)
from mta.config.sendmail import SendmailSection
from mta.config.shaping import ShapingSection
from mta.config.smarthost_auth import SmarthostAuthSection
from mta.config.values import IPAddress

__all__ = ["DEFAULTS_SOURCE", "Config"]

DEFAULTS_SOURCE = "<defaults>"


def _frozen_routes(routes: Mapping[str, Route]) -> Mapping[str, Route]:
    return types.MappingProxyType(dict(routes))


@attrs.frozen
class Config:
    """The whole, validated config. ``source`` is the file it came from, or ``<defaults>``."""

    server: ServerConfig
    spool: SpoolSection
    relay: RelayConfig
    delivery: DeliveryConfig
    submission: SubmissionConfig
    tls_policy: TlsPolicyConfig
    log: LogConfig
    dkim: DkimSection
    limits: LimitsSection
    policy: PolicySection
    proxy: ProxySection
    sendmail: SendmailSection
    smarthost_auth: SmarthostAuthSection
    http: HttpSection
    events: EventsSection
    routes: Mapping[str, Route] = attrs.field(converter=_frozen_routes, hash=False)
    recipients: RecipientsSection = attrs.field(factory=RecipientsSection)
    source: str = DEFAULTS_SOURCE
    dkim_keys: tuple[DkimKey, ...] = ()  # ``[[dkim.key]]``, in the file's order
    filters: FiltersSection = attrs.field(factory=FiltersSection)
    egress: EgressSection = attrs.field(factory=EgressSection)
    bounce_classes: BounceClassesSection = attrs.field(factory=BounceClassesSection)
    client_certs: ClientCertsSection = attrs.field(factory=ClientCertsSection)
    shaping: ShapingSection = attrs.field(factory=ShapingSection)

    def route_for(self, domain: str) -> Route | NoRoute:
        """The route for a recipient domain: exact key, then ``.parent`` keys, then ``"*"``."""
        route: Route | None = match_domain(domain, self.routes)
        if route is None:
            route = self.routes.get("*")
        return route if route is not None else NoRoute(normalize_domain(domain))

    def postmaster_alias(self, address: str) -> str | None:
        """The configured postmaster if ``address`` is ``postmaster`` or ``postmaster@HOSTNAME``, else None.

        The local part is matched without regard to case (RFC 5321 §4.5.1), so is the host name.
        """
        local, at, domain = address.rpartition("@")
        if not at:
            local, domain = address, ""
        if local.lower() != "postmaster":
            return None
        if domain and normalize_domain(domain) != normalize_domain(self.server.hostname):
            return None
        return self.relay.postmaster

    def route_for_recipient(self, address: str) -> Route | NoRoute:
        """How one recipient is delivered: the route for its domain (``route_for``), but see ``postmaster``.

        The postmaster address at the relay's own hostname, with no route
        named for that domain, goes into ``postmaster_maildir``.
        """
        domain = address.rpartition("@")[2]
        if address.lower() == self.relay.postmaster.lower() and match_domain(domain, self.routes) is None \
                and normalize_domain(domain) == normalize_domain(self.server.hostname):
            return MaildirRoute(self.relay.postmaster_maildir)
        return self.route_for(domain)

    def is_local(self, domain: str) -> bool:
        """Whether a route *named for this domain* delivers locally (to a Maildir or a mailbox server over LMTP).

        A ``"*"`` maildir route does not count: it would make every domain on
        earth local and so let anyone inject mail (see ``may_relay``).
        """
        return isinstance(match_domain(domain, self.routes), MaildirRoute | LmtpRoute)

    def may_relay(self, client_ip: str | IPAddress, domain: str) -> bool:
        """Accept a recipient at ``domain`` from ``client_ip``? Never an open relay.

        Yes if the client is in mynetworks, or the domain is local, or it is in
        relay_domains. Routes never open the relay: a ``"*"`` route does not.
        An unparsable client address (say, a Unix socket peer) is not in
        mynetworks.
        """
        return self.may_relay_for(self.in_mynetworks(client_ip), domain)

    def may_relay_for(self, trusted: bool, domain: str) -> bool:
        """``may_relay`` for a client whose ``in_mynetworks`` is known (``trusted``): a session asks it per RCPT."""
        return trusted or self.is_local(domain) or self.is_relay_domain(domain)

    def in_mynetworks(self, client_ip: str | IPAddress) -> bool:
        try:
            address = ipaddress.ip_address(client_ip)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket reports v4 clients as ::ffff:a.b.c.d
        return any(address in network for network in self.relay.mynetworks)

    def is_relay_domain(self, domain: str) -> bool:
        return match_domain(domain, dict.fromkeys(self.relay.relay_domains, True)) is not None
