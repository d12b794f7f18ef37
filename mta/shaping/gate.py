"""What the scheduler asks before it opens a connection: may this destination have one now, for how many
messages, and is its mail to go at all (a suspended or bouncing provider).

One ``Shaper`` per relay. Each MX destination (a recipient domain) gets a
``DestShape`` once its MX hosts are known (``classify``): its resolution
and two ``Group``s, its provider's (shared by every domain of the provider:
the provider's connection total and rate) and its own. The adaptive state
(``adapt.Adaptive``) changes these limits while its overrides last; the
limits in force are computed from the time when asked, so a ramp needs no
task of its own. Nothing here blocks: a destination that may not start now
is skipped, and ``wake_at`` says when one next may.
"""

from __future__ import annotations

import math
import time as clock
from collections.abc import Awaitable, Callable, Sequence

import attrs
import dns.exception

from mta.config import TlsMode, parse_tls, tls_text
from mta.shaping.adapt import Adaptive, Override
from mta.shaping.bucket import TokenBucket
from mta.shaping.reply import remote_reply
from mta.shaping.resolve import Resolution, provider_of_reply, resolve
from mta.shaping.table import Rate, ShapingTable

__all__ = ["RELOOK", "DestShape", "Group", "Shaper", "Verdict", "require_tls"]

MxLookup = Callable[[str], Awaitable[Sequence[str]]]
RELOOK = 3600.0  # seconds a domain's MX hosts (so its provider) are taken as known before they are looked up again


def require_tls(tls: str) -> str:
    """A destination's TLS made at least ``require`` (a provider's ``tls_required``), its policies kept."""
    mode, policies = parse_tls(tls)
    return tls_text(TlsMode.REQUIRE, policies) if mode in (TlsMode.NONE, TlsMode.OPPORTUNISTIC) else tls


@attrs.define(eq=False)
class Group:
    """Connections open and the rate bucket of one provider, or of one domain."""

    key: str
    active: int = 0
    bucket: TokenBucket | None = None


@attrs.define(eq=False)
class DestShape:
    resolution: Resolution
    provider: Group | None  # None: the domain belongs to no provider
    domain: Group
    settled: float = 0.0  # when its MX hosts were looked up
    own: float = math.inf  # the table's connection limits (domain, provider total), for the usual case's quick test
    total: float = math.inf
    rates: tuple[tuple[Group, float], ...] = ()  # the table's rates (messages per second) and whose tokens


@attrs.frozen
class Verdict:
    """A destination's mail is not to be sent now: ``action`` (suspend or bounce) by ``override``."""

    action: str
    override: Override

    def reply(self) -> str:
        o = self.override
        return (f"shaping: {o.scope.replace(':', ' ')} {'suspended' if self.action == 'suspend' else 'bounced'} "
                f"by rule {o.rule.name} until {o.ends:.3f} (unix time)")


def _burst(per_second: float) -> float:
    return max(1.0, per_second)  # one second's worth, at least one message


class Shaper:
    def __init__(self, table: ShapingTable, adaptive: Adaptive, per_destination: int, batch: int,
                 mx_lookup: MxLookup) -> None:
        self.table = table
        self.adaptive = adaptive
        self.per_destination = per_destination
        self.batch = batch
        self.mx_lookup = mx_lookup
        self.shapes: dict[str, DestShape] = {}
        self._looking: set[str] = set()
        self._groups: dict[str, Group] = {}
        self.wake_at = math.inf  # the earliest time a destination refused for the time being may start

    # -- classification ----------------------------------------------------

    def known(self, domain: str) -> DestShape | None:
        """The domain's shape if its MX hosts were looked up within ``RELOOK``."""
        shape = self.shapes.get(domain)
        return shape if shape is not None and clock.monotonic() - shape.settled < RELOOK else None

    def looking_up(self, domain: str) -> bool:
        return domain in self._looking

    async def classify(self, domain: str) -> DestShape:
        """The domain's shape, its MX hosts looked up (a failed lookup: matched by the domain alone)."""
        self._looking.add(domain)
        try:
            hosts = list(await self.mx_lookup(domain))
        except (dns.exception.DNSException, OSError):  # the transport meets (and reports) the same failure
            hosts = []  # shaping goes by the domain alone
        finally:
            self._looking.discard(domain)
        return self.settle(resolve(self.table, domain, hosts))

    def settle(self, resolution: Resolution) -> DestShape:
        provider = self._group(resolution.provider_key) if resolution.provider is not None else None
        shape = DestShape(resolution, provider, self._group(resolution.domain_key), clock.monotonic())
        shape.own, shape.total = self.connections(shape, math.inf)  # no override lasts for ever: the table's
        rates = [(shape.domain, resolution.domain_limits.rate)]
        if provider is not None:
            rates.append((provider, resolution.provider_limits.rate))
        shape.rates = tuple((group, rate.per_second) for group, rate in rates if rate is not None)
        self.shapes[resolution.domain] = shape
        return shape

    def _group(self, key: str) -> Group:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(key)
        return group

    # -- limits in force ---------------------------------------------------

    def _limit(self, name: str, normal: float | None, scope: str, now: float) -> float | None:
        if not self.adaptive.overrides:
            return normal  # the usual case: nothing the replies changed
        value = normal
        for o in self.adaptive.active((scope,), now):
            if o.rule.action != "limit":
                continue
            for change in o.rule.changes:
                if change.name != name or (normal is None and change.value is None):
                    continue
                changed = o.apply(change, normal if normal is not None else change.apply(0.0), now)
                value = changed if value is None else min(value, changed)
        return value

    def connections(self, shape: DestShape, now: float) -> tuple[float, float]:
        """(the domain's, the provider's) connection limits now; ``inf``: none."""
        r = shape.resolution
        own = self._limit("connections", r.domain_limits.connections or self.per_destination, r.domain_key, now)
        total = self._limit("connections", r.provider_limits.connections, r.provider_key, now) \
            if shape.provider is not None else None
        return max(1.0, math.floor(own or 1)), (max(1.0, math.floor(total)) if total is not None else math.inf)

    def messages_per_connection(self, shape: DestShape, now: float) -> int:
        r = shape.resolution
        normal = r.domain_limits.messages_per_connection or r.provider_limits.messages_per_connection or self.batch
        value = self._limit("messages_per_connection", normal, r.domain_key, now) or normal
        if shape.provider is not None:
            value = min(value, self._limit("messages_per_connection", normal, r.provider_key, now) or normal)
        return max(1, math.floor(value))

    def _bucket(self, group: Group, rate: Rate | None, now: float) -> TokenBucket | None:
        per_second = self._limit("rate", rate.per_second if rate else None, group.key, now)
        if per_second is None:
            group.bucket = None
            return None
        if group.bucket is None:
            group.bucket = TokenBucket(per_second, _burst(per_second), now)
        elif group.bucket.per_second != per_second:
            group.bucket.retune(per_second, _burst(per_second))
        return group.bucket

    def _buckets(self, shape: DestShape, now: float) -> list[TokenBucket]:
        r = shape.resolution
        found = [self._bucket(shape.domain, r.domain_limits.rate, now)]
        if shape.provider is not None:
            found.append(self._bucket(shape.provider, r.provider_limits.rate, now))
        return [b for b in found if b is not None]

    # -- the scheduler's questions -------------------------------------------

    def verdict(self, shape: DestShape, now: float) -> Verdict | None:
        """A suspension or bounce in force on the destination's provider or domain, else None."""
        if not self.adaptive.overrides:
            return None
        r = shape.resolution
        for o in self.adaptive.active((r.provider_key, r.domain_key), now):
            if o.rule.action in ("suspend", "bounce") and now < o.ends:
                return Verdict(o.rule.action, o)
        return None

    def admits(self, shape: DestShape, active: int, now: float) -> bool:
        """May one more connection start for this destination (``active`` open now)?"""
        if not self.adaptive.overrides:  # the usual case: the table's limits alone
            if active >= shape.own or (shape.provider is not None and shape.provider.active >= shape.total):
                return False
            for group, per_second in shape.rates:
                bucket = group.bucket
                if bucket is None or bucket.per_second != per_second:
                    bucket = self._bucket(group, Rate(per_second, 1.0), now)
                assert bucket is not None
                if bucket.available(now) < 1:
                    self.wake_at = min(self.wake_at, bucket.ready_at(now))
                    return False
            return True
        own, total = self.connections(shape, now)
        if active >= own or (shape.provider is not None and shape.provider.active >= total):
            return False
        if self.verdict(shape, now) is not None:
            return True  # its mail is deferred (or bounced) at once, without a connection
        for bucket in self._buckets(shape, now):
            if bucket.available(now) < 1:
                self.wake_at = min(self.wake_at, bucket.ready_at(now))
                return False
        return True

    def take(self, shape: DestShape, waiting: int, now: float) -> int:
        """How many of ``waiting`` messages one connection takes now; their tokens are spent."""
        count = min(waiting, self.messages_per_connection(shape, now))
        if self.verdict(shape, now) is not None:
            return min(waiting, self.batch)
        buckets = self._buckets(shape, now)
        for bucket in buckets:
            count = min(count, max(1, bucket.available(now)))
        for bucket in buckets:
            bucket.take(count, now)
        return count

    def opened(self, shape: DestShape) -> None:
        if shape.provider is not None:
            shape.provider.active += 1

    def closed(self, shape: DestShape) -> None:
        if shape.provider is not None:
            shape.provider.active -= 1

    def tls_required(self, shape: DestShape) -> bool:
        r = shape.resolution
        return bool(r.domain_limits.tls_required or r.provider_limits.tls_required)

    def next_wake(self, now: float) -> float:
        """When a destination refused or changed for the time being should be looked at again."""
        return min(self.wake_at, self.adaptive.next_change(now))

    # -- outcomes ------------------------------------------------------------

    def record(self, pos: int, time: float, recipient: str, code: int, enhanced: str, text: str,
               next_hop: str) -> list[Override]:
        """Feed one recorded outcome to the rules; returns the overrides it fired or extended."""
        if not self.adaptive.rules:
            return []
        said = remote_reply(code, enhanced, text, next_hop)
        if said is None:
            return []
        domain = recipient.rpartition("@")[2].lower()
        provider = provider_of_reply(self.table, domain, said.next_hop)  # as a rebuild from the log decides it
        return self.adaptive.feed(pos=pos, time=time, recipient=recipient, code=said.code, enhanced=said.enhanced,
                                  text=said.text, next_hop=said.next_hop, provider=provider)
