"""Which provider a domain belongs to, and which limits and rules apply to its mail, with the reason for each.

A provider is matched by the recipient domain (its ``domains``, or a parent
of the domain) first, then by its MX hosts: the first MX host, in
preference order, whose name ends with one of a provider's ``mx_suffix``
decides. The same test on the host that answered (a DELIVERY outcome's next
hop) names the provider of a reply, so the relay and a rebuild from the log
agree without a DNS lookup (``provider_of_reply``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from mta.shaping.table import LIMIT_NAMES, Limits, Provider, Rule, ShapingTable

__all__ = ["Resolution", "host_of", "provider_by_domain", "provider_of_reply", "resolve"]


@attrs.frozen
class Resolution:
    """What applies to ``domain``. ``provider_limits`` are shared by every domain of the provider (its
    connections are a total); ``domain_limits`` are the domain's own."""

    domain: str
    provider: Provider | None
    matched: str  # why this provider, in words
    provider_limits: Limits
    domain_limits: Limits
    rules: tuple[Rule, ...]

    @property
    def provider_key(self) -> str:
        """The scope a provider-wide action applies to: the provider, or the domain when it has none."""
        return f"provider:{self.provider.name}" if self.provider is not None else f"domain:{self.domain}"

    @property
    def domain_key(self) -> str:
        return f"domain:{self.domain}"

    def lines(self) -> list[str]:
        """``mta shape resolve``'s answer: the match, then each limit with the entry and file that set it."""
        out = [f"domain {self.domain}", f"provider {self.provider.name if self.provider else '-'} ({self.matched})"]
        for scope, limits in (("provider", self.provider_limits), ("domain", self.domain_limits)):
            for name in LIMIT_NAMES:
                value = getattr(limits, name)
                if value is not None:
                    what = "total over the provider's domains" if scope == "provider" and name == "connections" \
                        else ""
                    out.append(f"  {scope}.{name} = {value}{f' ({what})' if what else ''} "
                               f"from {limits.sources.get(name, '?')}")
        if len(out) == 2:
            out.append("  no limits of its own: [delivery]'s per_destination and max_messages_per_connection apply")
        out.extend(f"  rule {rule.name} ({rule.applies_to}, action {rule.action} for {rule.duration:g}s after "
                   f"{rule.threshold} in {rule.window:g}s) from {rule.source}" for rule in self.rules)
        return out


def host_of(next_hop: str) -> str:
    """The host name in a next hop as outcomes record it (``mx.example.net[192.0.2.1]:25 tls=...``)."""
    return next_hop.partition(" ")[0].partition("[")[0].lower().rstrip(".")


def _by_domain(table: ShapingTable, domain: str) -> Provider | None:
    """The provider that lists ``domain`` or its nearest parent."""
    labels = domain.split(".")
    for i in range(len(labels)):
        provider = table.provider_of_domain.get(".".join(labels[i:]))
        if provider is not None:
            return provider
    return None


def _by_host(table: ShapingTable, host: str) -> tuple[Provider, str] | None:
    """The provider whose longest MX suffix ``host`` ends with."""
    labels = host.split(".")
    for i in range(1, len(labels)):
        suffix = "." + ".".join(labels[i:])
        provider = table.provider_of_suffix.get(suffix)
        if provider is not None:
            return provider, suffix
    return None


def provider_by_domain(table: ShapingTable, domain: str) -> str | None:
    """The provider ``domain`` belongs to by the table's domain lists alone (its MX hosts unknown), None for none."""
    provider = _by_domain(table, domain.lower().rstrip("."))
    return provider.name if provider else None


def provider_of_reply(table: ShapingTable, domain: str, next_hop: str) -> str | None:
    """The provider whose server gave a reply: by the recipient's domain, else by the host that answered."""
    provider = _by_domain(table, domain)
    if provider is None:
        found = _by_host(table, host_of(next_hop))
        provider = found[0] if found else None
    return provider.name if provider else None


def resolve(table: ShapingTable, domain: str, mx_hosts: Sequence[str]) -> Resolution:
    """The provider, limits and rules of ``domain`` whose MX hosts are ``mx_hosts`` (preference order)."""
    domain = domain.lower().rstrip(".")
    provider = _by_domain(table, domain)
    matched = f"{domain} is among its domains" if provider else ""
    if provider is None:
        for host in mx_hosts:
            found = _by_host(table, host.lower().rstrip("."))
            if found is not None:
                provider, suffix = found
                matched = f"MX host {host} ends with {suffix}"
                break
    if provider is None:
        matched = "no provider's domains or MX suffixes match" + (f" (MX: {', '.join(mx_hosts)})" if mx_hosts else "")
    rules = table.rules_for.get("*", ()) + table.rules_for.get(f"domain:{domain}", ()) + \
        (table.rules_for.get(f"provider:{provider.name}", ()) if provider is not None else ())
    return Resolution(domain, provider, matched, provider.limits if provider else Limits(),
                      table.domains.get(domain, Limits()), rules)
