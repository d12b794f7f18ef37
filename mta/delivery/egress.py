"""Choosing the local address a message is sent from (``[egress]``), and counting each address's day.

Theory of operation. The scheduler asks ``Egress.choose`` once per message
and destination, when it groups a message's recipients: the sender's domain,
else the recipient's, else the recipient's shaping provider, names a pool
(or one address; ``EgressSection.target_for``); among the pool's
addresses not at their warm-up cap for the day, the smooth weighted
round-robin (nginx's: every candidate gains its weight, the richest is
chosen and pays the candidates' total) gives each its share, in a fixed
order that tests can predict. A pool whose every address is at its cap gives
``AllCapped``: the message is deferred and waits for its next retry (the
next day brings room), it is never sent from an address outside its pool.

Providers. ``[egress.providers]`` names a pool by the recipient's shaping
provider, for ``mx`` routes: the table's domain lists name it at once, else
the domain's MX hosts as the shaper last looked them up
(``provider_of``). A message that a provider could decide (no sender or
route match wins first) to a domain with neither waits for the lookup
before it is dispatched (``lookups_wanted``); a failed lookup leaves the
domain with no provider, and the message goes on to the ``*`` rules.

Counting. A message counts against its address the moment it is chosen
(so a burst cannot overshoot the cap while its deliveries are in flight),
and is given back if no next hop answered at all (a connection that failed:
nothing reached a receiver, so nothing of the address's reputation was
spent). The count of the day is the number of DELIVERY records of the day
that name the address and hold a reply from a next hop; ``rebuild`` reads
them from the log at start, from the first segment written to today on (a
segment last modified before midnight UTC holds nothing of today), so a
restart keeps the day's counts with no second store. Segments reclaimed
(deleted) before the restart take their records with them: the count
rebuilt is then lower, never higher.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable, Iterable

import attrs

from mta.config import NoRoute
from mta.config.egress import EgressSection, Source, warmup_cap
from mta.delivery.transport import Destination
from mta.shaping.gate import Shaper
from mta.shaping.resolve import provider_by_domain
from spool import LOG_DIR, EventStream, NotARecord, Outcome, Status, make_pos, parse_segment_name

__all__ = ["AllCapped", "Egress"]

# The first record of a segment lies right after its 32-byte header (docs/format.md, "Segments").
_FIRST_RECORD = 32
_COUNTED_KINDS = frozenset(s.name.lower() for s in (Status.DELIVERED, Status.DEFERRED, Status.BOUNCED))


@attrs.frozen
class AllCapped:
    """Every address of ``target`` (a pool's name or one address) is at its warm-up cap for today."""

    target: str

    @property
    def text(self) -> str:
        return f"every egress address of {self.target} is at its warm-up cap for today; the message waits"


def _utc_day(now: float) -> dt.date:
    return dt.datetime.fromtimestamp(now, dt.UTC).date()


class Egress:
    """The choice of source address, and each address's messages today (``counts``).

    ``clock``: seconds since the epoch (tests move the day). ``shaper``: whose table and MX lookups name the
    recipients' providers (None: shaping off, no providers).
    """

    def __init__(self, section: EgressSection, clock: Callable[[], float] = time.time,
                 shaper: Shaper | None = None) -> None:
        self.section = section
        self.shaper = shaper
        self.clock = clock
        self.sources = {s.address: s for s in section.sources}
        self.pools = {p.name: p.members for p in section.pools}
        self.counts: dict[str, int] = {}
        self._day = _utc_day(clock())
        self._current: dict[str, dict[str, int]] = {}  # pool -> address -> its round-robin credit

    @property
    def active(self) -> bool:
        return bool(self.section.routes or self.section.senders or self.section.providers)

    def _today(self) -> dt.date:
        day = _utc_day(self.clock())
        if day != self._day:
            self._day, self.counts = day, {}
        return day

    def provider_of(self, domain: str) -> str | None:
        """The shaping provider of an ``mx`` recipient's ``domain``: by the table's domain lists, else by its MX
        hosts as last looked up; None for none (or no ``[egress.providers]`` to use it)."""
        if self.shaper is None or not self.section.providers:
            return None
        found = provider_by_domain(self.shaper.table, domain)
        shape = self.shaper.shapes.get(domain) if found is None else None
        if shape is not None and shape.resolution.provider is not None:
            found = shape.resolution.provider.name
        return found

    def lookups_wanted(self, sender: str, mx_domains: Iterable[str]) -> list[str]:
        """Those of a message's ``mx`` recipient domains whose MX hosts must be looked up before its egress is
        chosen: a provider could decide it, and neither the table's domain lists nor a lookup within
        ``RELOOK`` names the domain's provider yet."""
        shaper = self.shaper
        if shaper is None or not self.section.providers:
            return []
        wanted: list[str] = []
        for domain in mx_domains:
            if domain not in wanted and self.section.needs_provider(sender, domain) and shaper.known(domain) is None \
                    and provider_by_domain(shaper.table, domain) is None:
                wanted.append(domain)
        return wanted

    def mark(self, sender: str, rcpt: str, dest: Destination | NoRoute) -> Destination | NoRoute | AllCapped:
        """``dest`` marked with the pool (or address) ``[egress]`` names for it, or ``AllCapped`` before any
        choice when that pool has no room today; the address itself is chosen per message
        (``choose_sources``)."""
        if isinstance(dest, NoRoute) or dest.kind not in ("smtp", "mx") or not self.active:
            return dest
        domain = rcpt.rpartition("@")[2].lower()
        provider = self.provider_of(domain) if dest.kind == "mx" else None
        target = self.section.target_for(sender, domain, provider)
        if target is None:
            return dest
        members = self.pools.get(target, ((target, 1),))
        if not any(self.room(address) for address, _ in members):
            return AllCapped(target)
        return attrs.evolve(dest, source=f"pool:{target}")

    def choose_sources(self, groups: dict[Destination, list[str]],
                       failed: list[Outcome]) -> dict[Destination, list[str]]:
        """One address per message and destination: each group ``mark`` gave a pool gets its address now (one
        message counted against it, ``pick``). A group whose pool filled up meanwhile (an earlier group of
        this message took the last room) is deferred into ``failed``."""
        chosen: dict[Destination, list[str]] = {}
        for dest, rcpts in groups.items():
            if dest.source.startswith("pool:"):
                picked = self.pick(dest.source.removeprefix("pool:"))
                if not isinstance(picked, Source):
                    failed.extend(Outcome(r, Status.DEFERRED, 0, "4.4.5", picked.text, "") for r in rcpts)
                    continue
                dest = attrs.evolve(dest, source=picked.address, helo=picked.ehlo)
            chosen.setdefault(dest, []).extend(rcpts)
        return chosen

    def room(self, address: str) -> bool:
        """May ``address`` carry one more message today?"""
        source = self.sources.get(address)
        cap = warmup_cap(source, self._today()) if source is not None else None
        return cap is None or self.counts.get(address, 0) < cap

    def choose(self, sender: str, recipient_domain: str, provider: str | None = None) -> Source | AllCapped | None:
        """The address for this message (counted against it now), ``AllCapped``, or None: no ``[egress]`` rule
        applies (the system chooses, as without the section). ``provider``: the recipient's shaping provider."""
        target = self.section.target_for(sender, recipient_domain, provider)
        return None if target is None else self.pick(target)

    def pick(self, target: str) -> Source | AllCapped:
        """An address of ``target`` (a pool's name or one address) with room today, counted against it now."""
        members = self.pools.get(target, ((target, 1),))
        open_ = [(address, weight) for address, weight in members if self.room(address)]
        if not open_:
            return AllCapped(target)
        credit = self._current.setdefault(target, {})
        for address, weight in open_:
            credit[address] = credit.get(address, 0) + weight
        chosen = max(open_, key=lambda m: credit[m[0]])[0]  # max keeps the first of equals: the file's order
        credit[chosen] -= sum(weight for _, weight in open_)
        self.counts[chosen] = self.counts.get(chosen, 0) + 1
        return self.sources.get(chosen) or Source(chosen)

    def give_back(self, address: str) -> None:
        """A message counted against ``address`` reached no next hop: it does not count."""
        if self.counts.get(address, 0) > 0:
            self.counts[address] -= 1

    def rebuild(self, spool_dir: str) -> int:
        """Today's counts from the log's DELIVERY records (see the module's doc); returns the records counted."""
        day = self._today()
        midnight_ms = int(dt.datetime.combine(day, dt.time(), dt.UTC).timestamp() * 1000)
        log_dir = os.path.join(spool_dir, LOG_DIR)
        try:
            names = sorted(os.listdir(log_dir))
        except FileNotFoundError:
            return 0
        first: int | None = None
        for name in names:
            seg = parse_segment_name(name)
            if seg is None:
                continue
            try:
                if os.stat(os.path.join(log_dir, name)).st_mtime * 1000 >= midnight_ms:
                    first = seg
                    break
            except FileNotFoundError:
                continue
        if first is None:
            return 0
        stream = EventStream(spool_dir)
        counted: set[int] = set()
        since: int | None = make_pos(first, _FIRST_RECORD)
        after: int | None = None
        while True:
            try:
                batch = stream.read(after, since=since if after is None else None, max_records=4096)
            except NotARecord:  # the segment holds no record yet (its header alone)
                return len(counted)
            for ev in batch.events:
                source = ev.fields.get("source")
                if ev.kind in _COUNTED_KINDS and source and ev.fields.get("code") and ev.time_ms >= midnight_ms \
                        and ev.pos not in counted:
                    counted.add(ev.pos)
                    self.counts[source] = self.counts.get(source, 0) + 1
            if batch.after is None or batch.after == after:
                return len(counted)
            after = batch.after
