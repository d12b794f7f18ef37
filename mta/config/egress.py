"""``[egress]``: which local address (and EHLO name) outgoing SMTP connections are made from.

Why a section of its own and not keys on ``[routes]``: the same address or
pool serves many routes and senders, and a warm-up schedule belongs to an
address, not to a route. Five tables::

    [egress.sources."192.0.2.10"]           # one local address: its EHLO name, its warm-up
    ehlo = "out1.example.com"
    [egress.sources."192.0.2.11"]
    ehlo = "out2.example.com"
    warmup_start = "2026-12-01"              # day 1 of the schedule (UTC)
    warmup = [[1, 50], [2, 100], [4, 400]]  # day -> most messages that day

    [egress.pools]
    bulk = { "192.0.2.10" = 3, "192.0.2.11" = 1 }  # address -> weight

    [egress.routes]                          # recipient domain (as [routes]) -> a pool or one address
    ".example.net" = "bulk"
    "*" = "192.0.2.10"

    [egress.senders]                         # sender domain (as [routes]) -> a pool or one address
    "news.example.com" = "bulk"

    [egress.providers]                       # shaping provider ([provider.NAME]) -> a pool or one address
    google = "192.0.2.11"

The first that matches decides: the sender's domain, the recipient's domain
(exact or ``.suffix``), the recipient's provider, ``routes``' ``*``, then
``senders``' ``*``. A provider is the shaping table's (``mta.shaping``): it
needs ``[shaping]`` on, and it applies to ``mx`` routes alone, where the
table's domain list or the domain's MX hosts name it (``target_for`` is
given the name; the scheduler finds it). Only ``smtp`` and ``mx`` routes use
these tables (``mta.delivery.egress`` chooses; docs/operations.md, "Egress
addresses"). Rules that span tables (a pool or route naming an address that
is not a source, a route naming no pool, providers with shaping off) are
``problems``; whether each provider is in the shaping table is checked where
the table is loaded (``mta.process.startup.check_shaping``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from typing import Any

import attrs

from mta.config.routes import check_domain, match_domain
from mta.config.values import Hostname, text_of
from spool import ConfigError, Kind, TomlValue, expect, setting, type_name

__all__ = ["EgressSection", "Pool", "Source", "warmup_cap"]

MAX_WEIGHT = 1000
MAX_DAY = 3650


@attrs.frozen
class Source:
    """One local address: the EHLO name sent from it ("" for ``server.hostname``) and its warm-up schedule.

    ``warmup``: (day, most messages that day), by day; day 1 is ``warmup_start``.
    """

    address: str
    ehlo: str = ""
    warmup_start: dt.date | None = None
    warmup: tuple[tuple[int, int], ...] = ()


def warmup_cap(source: Source, today: dt.date) -> int | None:
    """The most messages ``source`` may carry on ``today`` (UTC), None for no cap.

    Before its start date an address under warm-up carries nothing; on day N
    the entry with the greatest day at or below N applies; past the last
    entry the address is warm (no cap).
    """
    if not source.warmup or source.warmup_start is None:
        return None
    day = (today - source.warmup_start).days + 1
    if day < 1:
        return 0
    if day > source.warmup[-1][0]:
        return None
    cap = 0
    for first, count in source.warmup:
        if first <= day:
            cap = count
    return cap


@attrs.frozen
class Pool:
    """A named set of addresses, each with its weight (its share of the mail, among those not at their cap)."""

    name: str
    members: tuple[tuple[str, int], ...]


def _address(raw: object) -> str:
    text = text_of(raw)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ConfigError(f"{text!r} is not an IP address") from None


def _date(raw: object) -> dt.date:
    if isinstance(raw, dt.date) and not isinstance(raw, dt.datetime):
        return raw
    text = text_of(raw)
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a date (YYYY-MM-DD)") from None


def _schedule(raw: object) -> tuple[tuple[int, int], ...]:
    items = expect(raw, list, "a list of [day, messages] pairs")
    steps: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        pair = expect(item, list, "a [day, messages] pair")
        if len(pair) != 2 or any(not isinstance(v, int) or isinstance(v, bool) for v in pair):
            raise ConfigError(f"expected a [day, messages] pair of integers, got {pair!r}", key=f"[{i}]")
        day, count = pair
        if not 1 <= day <= MAX_DAY or count < 0:
            raise ConfigError(f"day must be 1–{MAX_DAY} and messages ≥ 0, got {pair!r}", key=f"[{i}]")
        if steps and day <= steps[-1][0]:
            raise ConfigError(f"days must increase, got day {day} after day {steps[-1][0]}", key=f"[{i}]")
        steps.append((day, count))
    return tuple(steps)


_SOURCE_KEYS = ("ehlo", "warmup_start", "warmup")


@attrs.frozen
class Sources(Kind[tuple[Source, ...]]):
    def what(self) -> str:
        return ("table: IP address -> { `ehlo` (host name), `warmup_start` (date), `warmup` (list of "
                "[day, messages]) }")

    def convert(self, raw: object, base_dir: str | None) -> tuple[Source, ...]:
        table = expect(raw, dict, "a table of addresses")
        sources = []
        for key, entry in table.items():
            address = _address(key)
            body = expect(entry, dict, f"a table for {key}") if entry != {} else {}
            for name in body:
                if name not in _SOURCE_KEYS:
                    raise ConfigError("unknown key", key=f"[{key}].{name}")
            try:
                ehlo = Hostname().read(body["ehlo"]) if "ehlo" in body else ""
                start = _date(body["warmup_start"]) if "warmup_start" in body else None
            except ConfigError as e:
                raise ConfigError(e.problem, key=f"[{key}]") from None
            try:
                warmup = _schedule(body.get("warmup", []))
            except ConfigError as e:
                raise ConfigError(e.problem, key=f"[{key}].warmup{e.key}") from None
            if warmup and start is None:
                raise ConfigError("a warm-up schedule needs warmup_start (its day 1)", key=f"[{key}].warmup_start")
            sources.append(Source(address, ehlo, start, warmup))
        return tuple(sources)

    def write(self, value: tuple[Source, ...]) -> TomlValue:
        out: dict[str, Any] = {}
        for s in value:
            entry: dict[str, Any] = {}
            if s.ehlo:
                entry["ehlo"] = s.ehlo
            if s.warmup_start is not None:
                entry["warmup_start"] = s.warmup_start.isoformat()
            if s.warmup:
                entry["warmup"] = [list(step) for step in s.warmup]
            out[s.address] = entry
        return out


@attrs.frozen
class Pools(Kind[tuple[Pool, ...]]):
    def what(self) -> str:
        return f"table: pool name -> {{ IP address = weight (1–{MAX_WEIGHT}) }}"

    def convert(self, raw: object, base_dir: str | None) -> tuple[Pool, ...]:
        table = expect(raw, dict, "a table of pools")
        pools = []
        for name, members in table.items():
            entries = expect(members, dict, f"a table of address = weight for pool {name}")
            if not entries:
                raise ConfigError("a pool needs at least one address", key=f"[{name}]")
            chosen = []
            for address, weight in entries.items():
                if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= MAX_WEIGHT:
                    raise ConfigError(f"a weight is an integer 1–{MAX_WEIGHT}, got {type_name(weight)} {weight!r}",
                                      key=f"[{name}][{address}]")
                chosen.append((_address(address), weight))
            pools.append(Pool(name, tuple(chosen)))
        return tuple(pools)

    def write(self, value: tuple[Pool, ...]) -> TomlValue:
        return {p.name: dict(p.members) for p in value}


@attrs.frozen
class DomainMap(Kind[tuple[tuple[str, str], ...]]):
    """Domain (``.domain`` for subdomains, ``*`` for the rest) -> a pool's name or one address."""

    def what(self) -> str:
        return "table: domain (`.example.com`: subdomains, `*`: the rest) -> a pool's name or an IP address"

    def convert(self, raw: object, base_dir: str | None) -> tuple[tuple[str, str], ...]:
        table = expect(raw, dict, "a table of domain = pool")
        out = []
        for domain, target in table.items():
            key = domain if domain == "*" else check_domain(domain)
            out.append((key, text_of(target)))
        return tuple(out)

    def write(self, value: tuple[tuple[str, str], ...]) -> TomlValue:
        return dict(value)


@attrs.frozen
class ProviderMap(Kind[tuple[tuple[str, str], ...]]):
    """Shaping provider name -> a pool's name or one address. The names are checked against the shaping table
    when it is loaded: this module does not read it (``mta.shaping`` builds on ``mta.config``)."""

    def what(self) -> str:
        return "table: shaping provider (`[provider.NAME]`) -> a pool's name or an IP address"

    def convert(self, raw: object, base_dir: str | None) -> tuple[tuple[str, str], ...]:
        table = expect(raw, dict, "a table of provider = pool")
        return tuple((name, text_of(target)) for name, target in table.items())

    def write(self, value: tuple[tuple[str, str], ...]) -> TomlValue:
        return dict(value)


@attrs.frozen(kw_only=True)
class EgressSection:
    """``[egress]``: source addresses for outgoing SMTP (see "Egress addresses" in docs/operations.md)."""

    sources: tuple[Source, ...] = setting(
        Sources(), "the local addresses mail may be sent from, each with its EHLO name (else `server.hostname`) "
        "and an optional warm-up schedule: on day N after `warmup_start` (day 1) at most the messages of the "
        "entry with the greatest day ≤ N; warm after the last entry", ())
    pools: tuple[Pool, ...] = setting(
        Pools(), "named sets of sources with weights: each message goes to one of the pool's addresses not at "
        "its warm-up cap, in proportion to the weights", ())
    routes: tuple[tuple[str, str], ...] = setting(
        DomainMap(), "recipient domain -> the pool (or one source address) that `smtp` and `mx` routes to it "
        "send from; no match: the system's choice of address", ())
    senders: tuple[tuple[str, str], ...] = setting(
        DomainMap(), "envelope sender domain -> pool or source address; wins over `routes`", ())
    providers: tuple[tuple[str, str], ...] = setting(
        ProviderMap(), "shaping provider (a `[provider.NAME]` of the shaping table) -> pool or source address for "
        "`mx` routes to its domains (its `domains`, or MX hosts ending in its `mx_suffix`); after the exact and "
        "`.suffix` matches of `routes` and `senders`, before their `*`; needs `[shaping]` on", ())

    def problems(self, *, shaping: bool) -> list[ConfigError]:
        """What no single table can check: every name a pool or route uses must be defined, and providers need
        ``shaping`` (``[shaping] enabled``): without the shaper no recipient has a provider."""
        addresses = {s.address for s in self.sources}
        pools = {p.name for p in self.pools}
        found = [ConfigError(f"{address} is not in [egress.sources]", key=f"pools[{p.name}][{address}]")
                 for p in self.pools for address, _ in p.members if address not in addresses]
        if len(addresses) != len(self.sources):
            found.append(ConfigError("an address is given twice", key="sources"))
        if self.providers and not shaping:
            found.append(ConfigError("providers are the shaping table's: set [shaping] enabled = true, or remove "
                                     "[egress.providers]", key="providers"))
        for table, entries in (("routes", self.routes), ("senders", self.senders), ("providers", self.providers)):
            for domain, target in entries:
                if target not in pools and target not in addresses:
                    found.append(ConfigError(f"{target!r} is neither a pool in [egress.pools] nor an address in "
                                             "[egress.sources]", key=f"{table}[{domain}]"))
        return found

    def _explicit(self, sender_domain: str, recipient_domain: str) -> str | None:
        """The sender's domain's exact or ``.suffix`` match, else the recipient's: what wins over a provider."""
        found: str | None = match_domain(sender_domain, dict(self.senders)) if sender_domain else None
        if found is None:
            found = match_domain(recipient_domain, dict(self.routes))
        return found

    def needs_provider(self, sender: str, recipient_domain: str) -> bool:
        """Would the recipient's provider decide this message's target (no sender or route match wins first)?"""
        return bool(self.providers) and self._explicit(sender.rpartition("@")[2], recipient_domain) is None

    def target_for(self, sender: str, recipient_domain: str, provider: str | None = None) -> str | None:
        """The pool name or address for a message from ``sender`` to ``recipient_domain`` (whose shaping provider
        is ``provider``, None for none), None for no rule."""
        sender_domain = sender.rpartition("@")[2]
        found = self._explicit(sender_domain, recipient_domain)
        if found is None and provider is not None:
            found = dict(self.providers).get(provider)
        if found is None:
            found = dict(self.routes).get("*")
        if found is None and sender_domain:
            found = dict(self.senders).get("*")
        return found
