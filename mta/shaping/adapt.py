"""The adaptive state: replies in, overrides out. No I/O, no clock of its own (every call is given the time).

Theory of operation. Each reply a next hop gave (a DELIVERY outcome with a
reply code: the relay's own deferrals have none and never count) is a
``Hit`` for every rule that applies to its domain or provider and matches
it. Hits are counted per (rule, scope) over the rule's sliding window; when
the count reaches the threshold the rule fires an ``Override`` for its
scope (the provider, or the domain) that lasts ``duration`` from that hit;
the threshold reached again while it lasts (or ramps) extends it from that
hit. After it ends, a ``limit`` override ramps back to the normal limit in ``ramp_steps`` equal steps, one each
``ramp_step``, and is gone after the last.

Everything is a function of the hits and their times, so feeding the same
outcomes again (the log's recent suffix, at start, or ``mta shape
explain``) gives the same overrides with the same end times.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

import attrs

from mta.shaping.table import Change, Rule

__all__ = ["MAX_HITS_KEPT", "Adaptive", "Hit", "Override"]

MAX_HITS_KEPT = 16  # the replies an override names (the first that fired it and the latest)


@attrs.frozen
class Hit:
    """One reply that matched a rule: its record's position, the time it was recorded, what was said."""

    pos: int
    time: float
    recipient: str
    code: int
    enhanced: str
    text: str
    next_hop: str

    def describe(self) -> str:
        return f"{self.code} {self.enhanced} {self.text}".replace("  ", " ").strip()


@attrs.define
class Override:
    """A rule's action on one scope (``provider:NAME`` or ``domain:D``), from ``began`` to ``ends``, then its ramp."""

    rule: Rule
    scope: str
    began: float
    ends: float
    hits: list[Hit]

    @property
    def gone(self) -> float:
        """When nothing of it is left: its end, and the ramp after it."""
        return self.ends + self.rule.ramp_steps * self.rule.ramp_step

    def step(self, now: float) -> int:
        """0 while it holds; k (1..ramp_steps) on the k-th step of the ramp back up."""
        if now < self.ends or not self.rule.ramp_steps:
            return 0
        return min(self.rule.ramp_steps, int((now - self.ends) // self.rule.ramp_step) + 1)

    def apply(self, change: Change, normal: float, now: float) -> float:
        """The limit ``change`` makes of ``normal`` now: changed while it holds, then stepping back up."""
        low = min(normal, change.apply(normal))
        k = self.step(now)
        if not k:
            return low
        return low + (normal - low) * k / (self.rule.ramp_steps + 1)

    def next_change(self, now: float) -> float:
        """When its effect next changes (its end, the next ramp step, its going)."""
        if now < self.ends:
            return self.ends
        return min(self.gone, self.ends + self.step(now) * self.rule.ramp_step)


def _applies(rule: Rule, provider: str | None, domain: str) -> bool:
    return rule.applies_to == "*" or rule.applies_to == f"domain:{domain}" or \
        (provider is not None and rule.applies_to == f"provider:{provider}")


def _scope(rule: Rule, provider: str | None, domain: str) -> str:
    return f"provider:{provider}" if rule.scope == "provider" and provider is not None else f"domain:{domain}"


class Adaptive:
    """The rules' counters and the overrides they fired."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = tuple(rules)
        self._windows: dict[tuple[str, str], collections.deque[Hit]] = {}
        self.overrides: dict[tuple[str, str], Override] = {}  # (rule name, scope) -> override
        self._by_scope: dict[str, list[Override]] = {}
        # Rules grouped by what they apply to, so a reply is tested against its own rules only.
        self._named = {rule.name: rule for rule in self.rules}
        self._for: dict[str, list[Rule]] = {}
        for rule in self.rules:
            self._for.setdefault(rule.applies_to, []).append(rule)

    def feed(self, *, pos: int, time: float, recipient: str, code: int, enhanced: str, text: str, next_hop: str,
             provider: str | None) -> list[Override]:
        """Count one outcome; returns the overrides it fired or extended. Outcomes without a reply code (the
        relay's own deferrals: a suspended provider, a backed-off destination, a local error) never count."""
        if not code or not next_hop or not self.rules:
            return []
        domain = recipient.rpartition("@")[2].lower()
        candidates = self._for.get("*", []) + self._for.get(f"domain:{domain}", []) + \
            (self._for.get(f"provider:{provider}", []) if provider is not None else [])
        fired = []
        for rule in candidates:
            if not rule.matches(code, enhanced, text):
                continue
            hit = Hit(pos, time, recipient, code, enhanced, text, next_hop)
            scope = _scope(rule, provider, domain)
            window = self._windows.setdefault((rule.name, scope), collections.deque())
            window.append(hit)
            while window and window[0].time <= time - rule.window:
                window.popleft()
            if len(window) > MAX_HITS_KEPT:
                window.popleft()
            key = (rule.name, scope)
            current = self.overrides.get(key)
            if current is not None and time < current.gone:
                if len(window) >= rule.threshold:
                    current.ends = time + rule.duration  # still triggering: it lasts from this hit
                    current.hits = ([*current.hits, hit])[-MAX_HITS_KEPT:]
                    fired.append(current)
                continue
            if len(window) >= rule.threshold:
                override = Override(rule, scope, time, time + rule.duration, list(window))
                self.overrides[key] = override
                self._by_scope.setdefault(scope, []).append(override)
                fired.append(override)
        return fired

    def expire(self, now: float) -> None:
        """Forget overrides that are gone and hits that have left their windows."""
        for key, override in list(self.overrides.items()):
            if now >= override.gone:
                del self.overrides[key]
                kept = [o for o in self._by_scope.get(override.scope, []) if o is not override]
                if kept:
                    self._by_scope[override.scope] = kept
                else:
                    self._by_scope.pop(override.scope, None)
        for key, window in list(self._windows.items()):
            rule = self._named[key[0]]
            while window and window[0].time <= now - rule.window:
                window.popleft()
            if not window:
                del self._windows[key]

    def active(self, scopes: Iterable[str], now: float) -> list[Override]:
        """The overrides on any of ``scopes`` that still have an effect at ``now``."""
        return [o for scope in scopes for o in self._by_scope.get(scope, ()) if now < o.gone]

    def next_change(self, now: float) -> float:
        """When any override's effect next changes (``math.inf``: none will)."""
        return min((o.next_change(now) for o in self.overrides.values() if now < o.gone), default=math.inf)
