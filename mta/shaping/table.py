"""The shaping table: providers (matched by MX host suffix or by domain), per-domain limits, adaptive rules.

Two sources, read the same way: the table shipped in ``defaults.toml`` and
the operator's file (``shaping.file``). The operator's entries override the
shipped ones field by field (a provider or domain named in both keeps the
shipped fields the operator's entry does not set; a rule of the same name
replaces the shipped rule), and each limit remembers which file set it, so
``mta shape resolve`` can say. Any problem is a ``ShapingError`` naming the
file and the entry, in one line.

Grammar (TOML)::

    [provider.NAME]   mx_suffix = [".example.net"], domains = ["example.com"], LIMITS
    [domain."D"]      LIMITS
    [[rule]]          name, applies_to ("provider:NAME" | "domain:D" | "*"), code, enhanced, text (a regex),
                      threshold, window, action ("suspend" | "bounce" | "limit"), scope ("provider" | "domain"),
                      limit = {LIMIT = VALUE | "N%"}, floor = {LIMIT = VALUE}, duration, ramp_steps, ramp_step

    LIMITS: connections, messages_per_connection, rate ("N/s", "N/min", "N/h"), tls_required
"""

from __future__ import annotations

import importlib.resources
import re
import tomllib
from collections.abc import Mapping
from typing import Any, Final

import attrs

from spool import ConfigError, parse_duration

__all__ = [
    "ACTIONS",
    "BUILTIN",
    "LIMIT_NAMES",
    "Change",
    "Limits",
    "Provider",
    "Rate",
    "Rule",
    "ShapingError",
    "ShapingTable",
    "load_table",
    "parse_rate",
]

BUILTIN: Final = "<builtin>"
LIMIT_NAMES: Final = ("connections", "messages_per_connection", "rate", "tls_required")
ADJUSTABLE: Final = ("connections", "messages_per_connection", "rate")  # what a rule's ``limit`` may change
ACTIONS: Final = ("suspend", "bounce", "limit")
SCOPES: Final = ("provider", "domain")
_RATE: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hr|hour)\s*")
_PER: Final = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
               "h": 3600.0, "hr": 3600.0, "hour": 3600.0}
_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_.-]*")


class ShapingError(ConfigError):
    """A shaping table that cannot be used: one line naming the file, the entry and the problem."""


@attrs.frozen
class Rate:
    """``count`` messages per ``per`` seconds: a token bucket of ``count`` tokens refilled over ``per``."""

    count: float
    per: float

    @property
    def per_second(self) -> float:
        return self.count / self.per

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "min", 3600.0: "h"}.get(self.per, f"{self.per:g}s")
        return f"{self.count:g}/{unit}"


def parse_rate(raw: object) -> Rate:
    """``"100/s"``, ``"20/min"``, ``"500/h"``. Raises ValueError."""
    if not isinstance(raw, str) or not (m := _RATE.fullmatch(raw)) or float(m.group(1)) <= 0:
        raise ValueError(f"{raw!r} is not a rate (write N/s, N/min or N/h with N > 0)")
    return Rate(float(m.group(1)), _PER[m.group(2)])


@attrs.frozen
class Limits:
    """Limits as one entry sets them; ``None``: not set here. ``sources``: limit name -> the file that set it."""

    connections: int | None = None
    messages_per_connection: int | None = None
    rate: Rate | None = None
    tls_required: bool | None = None
    sources: Mapping[str, str] = attrs.field(factory=dict, eq=False)

    def over(self, base: Limits) -> Limits:
        """These limits, with ``base``'s where these set none."""
        values = {n: getattr(self, n) if getattr(self, n) is not None else getattr(base, n) for n in LIMIT_NAMES}
        sources = {**base.sources, **self.sources}
        return Limits(**values, sources=sources)


@attrs.frozen
class Provider:
    name: str
    mx_suffixes: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()
    limits: Limits = Limits()
    source: str = BUILTIN


@attrs.frozen
class Change:
    """How a rule changes one limit: to ``value`` (absolute), or by ``factor`` (``"50%"``), never below ``floor``."""

    name: str
    value: float | None = None
    factor: float | None = None
    floor: float = 1.0

    def apply(self, current: float) -> float:
        new = self.value if self.value is not None else current * (self.factor or 1.0)
        return max(self.floor, new)


@attrs.frozen
class Rule:
    """A pattern on the reply, a threshold of ``threshold`` hits within ``window`` seconds, and an action for
    ``duration`` seconds; then, for a ``limit``, back to the normal limits in ``ramp_steps`` steps of
    ``ramp_step`` seconds each."""

    name: str
    applies_to: str  # "provider:NAME", "domain:D" or "*"
    code: int | None
    enhanced: str | None
    text: re.Pattern[str] | None
    threshold: int
    window: float
    action: str
    scope: str
    changes: tuple[Change, ...]
    duration: float
    ramp_steps: int = 0
    ramp_step: float = 0.0
    source: str = BUILTIN

    def matches(self, code: int, enhanced: str, text: str) -> bool:
        """Does a reply the next hop gave match? Every part the rule names must match."""
        if self.code is not None and code != self.code:
            return False
        if self.enhanced is not None and enhanced != self.enhanced:
            return False
        return self.text is None or self.text.search(text) is not None

    @property
    def span(self) -> float:
        """How far back in the log a hit may still matter: its window, the override and its ramp."""
        return self.window + self.duration + self.ramp_steps * self.ramp_step


@attrs.frozen
class ShapingTable:
    providers: tuple[Provider, ...] = ()
    domains: Mapping[str, Limits] = attrs.field(factory=dict)
    rules: tuple[Rule, ...] = ()
    # The rules by what they apply to ("*", "provider:NAME", "domain:D"): a domain's are found without a scan.
    rules_for: Mapping[str, tuple[Rule, ...]] = attrs.field(init=False, eq=False)
    # The providers by a domain they list and by an MX suffix they name (the first provider to name it wins).
    provider_of_domain: Mapping[str, Provider] = attrs.field(init=False, eq=False)
    provider_of_suffix: Mapping[str, Provider] = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        index: dict[str, list[Rule]] = {}
        for rule in self.rules:
            index.setdefault(rule.applies_to, []).append(rule)
        object.__setattr__(self, "rules_for", {k: tuple(v) for k, v in index.items()})
        domains: dict[str, Provider] = {}
        suffixes: dict[str, Provider] = {}
        for provider in self.providers:
            for domain in provider.domains:
                domains.setdefault(domain, provider)
            for suffix in provider.mx_suffixes:
                suffixes.setdefault(suffix, provider)
        object.__setattr__(self, "provider_of_domain", domains)
        object.__setattr__(self, "provider_of_suffix", suffixes)

    @property
    def span(self) -> float:
        return max((r.span for r in self.rules), default=0.0)


def load_table(builtin: bool, path: str | None) -> ShapingTable:
    """The shipped table (``builtin``) with the operator's file (``path``) over it. Raises ShapingError."""
    tables: list[tuple[str, Mapping[str, Any]]] = []
    if builtin:
        text = importlib.resources.files("mta.shaping").joinpath("defaults.toml").read_text("utf-8")
        tables.append((BUILTIN, _toml(text, BUILTIN)))
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                tables.append((path, _toml(f.read(), path)))
        except OSError as exc:
            raise ShapingError(f"shaping file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ShapingError(f"shaping file {path}: not UTF-8 text") from None
    providers: dict[str, Provider] = {}
    domains: dict[str, Limits] = {}
    rules: dict[str, Rule] = {}
    for source, data in tables:
        _merge(source, data, providers, domains, rules)
    for rule in rules.values():
        kind, _, name = rule.applies_to.partition(":")
        if kind == "provider" and name not in providers:
            raise ShapingError(f"{rule.source}: rule {rule.name}: applies_to names no provider ({name!r})")
    return ShapingTable(tuple(providers.values()), domains, tuple(rules.values()))


def _toml(text: str, source: str) -> Mapping[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ShapingError(f"shaping file {source}: {exc}") from None


def _merge(source: str, data: Mapping[str, Any], providers: dict[str, Provider], domains: dict[str, Limits],
           rules: dict[str, Rule]) -> None:
    unknown = set(data) - {"provider", "domain", "rule"}
    if unknown:
        raise ShapingError(f"{source}: unknown table {min(unknown)!r} (provider, domain and rule are known)")
    for name, entry in _table(data.get("provider", {}), source, "provider").items():
        where = f"{source}: provider.{name}"
        if not _NAME.fullmatch(name):
            raise ShapingError(f"{where}: a provider's name is lower-case letters, digits, '.', '-', '_'")
        entry = _table(entry, source, f"provider.{name}")
        _only(entry, where, {"mx_suffix", "domains", *LIMIT_NAMES})
        old = providers.get(name, Provider(name, source=source))
        suffixes = tuple(_suffix(s, where) for s in _list(entry.get("mx_suffix", []), where, "mx_suffix"))
        names = tuple(_domain(d, where) for d in _list(entry.get("domains", []), where, "domains"))
        limits = _limits(entry, where, source).over(old.limits)
        provider = Provider(name, suffixes or old.mx_suffixes, names or old.domains, limits, source)
        if not provider.mx_suffixes and not provider.domains:
            raise ShapingError(f"{where}: names neither mx_suffix nor domains, so it matches nothing")
        providers[name] = provider
    for name, entry in _table(data.get("domain", {}), source, "domain").items():
        where = f"{source}: domain.{name}"
        domain = _domain(name, where)
        entry = _table(entry, source, f"domain.{name}")
        _only(entry, where, set(LIMIT_NAMES))
        domains[domain] = _limits(entry, where, source).over(domains.get(domain, Limits()))
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise ShapingError(f"{source}: rule must be an array of tables ([[rule]])")
    for i, entry in enumerate(raw_rules, 1):
        rule = _rule(entry, f"{source}: rule[{i}]", source)
        rules[rule.name] = rule


def _table(value: object, source: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ShapingError(f"{source}: {where} must be a table")
    return value


def _only(entry: Mapping[str, Any], where: str, known: set[str]) -> None:
    for key in entry:
        if key not in known:
            raise ShapingError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


def _list(value: object, where: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ShapingError(f"{where}: {key} must be a list of strings")
    return value


def _suffix(value: str, where: str) -> str:
    text = value.strip().lower().rstrip(".")
    if not text.startswith(".") or len(text) < 3:
        raise ShapingError(f"{where}: mx_suffix {value!r} must begin with a dot (\".google.com\")")
    return text


def _domain(value: str, where: str) -> str:
    text = value.strip().lower().rstrip(".")
    if not text or not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", text):
        raise ShapingError(f"{where}: {value!r} is not a domain")
    return text


def _positive_int(value: object, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShapingError(f"{where}: {key} must be a whole number of 1 or more")
    return value


def _limits(entry: Mapping[str, Any], where: str, source: str) -> Limits:
    values: dict[str, Any] = {}
    if "connections" in entry:
        values["connections"] = _positive_int(entry["connections"], where, "connections")
    if "messages_per_connection" in entry:
        values["messages_per_connection"] = _positive_int(entry["messages_per_connection"], where,
                                                          "messages_per_connection")
    if "rate" in entry:
        try:
            values["rate"] = parse_rate(entry["rate"])
        except ValueError as exc:
            raise ShapingError(f"{where}: rate: {exc}") from None
    if "tls_required" in entry:
        if not isinstance(entry["tls_required"], bool):
            raise ShapingError(f"{where}: tls_required must be true or false")
        values["tls_required"] = entry["tls_required"]
    return Limits(**values, sources=dict.fromkeys(values, source))


def _duration(value: object, where: str, key: str) -> float:
    try:
        seconds = parse_duration(value)
    except ConfigError as exc:
        raise ShapingError(f"{where}: {key}: {exc}") from None
    if seconds <= 0:
        raise ShapingError(f"{where}: {key} must be more than 0")
    return seconds


def _amount(name: str, value: object, where: str) -> float:
    """A limit's value as a number: connections and messages as they are, a rate in messages per second."""
    if name == "rate":
        try:
            return parse_rate(value).per_second
        except ValueError as exc:
            raise ShapingError(f"{where}: rate: {exc}") from None
    return float(_positive_int(value, where, name))


def _changes(entry: Mapping[str, Any], where: str) -> tuple[Change, ...]:
    limit = _table(entry.get("limit", {}), where, "limit")
    floor = _table(entry.get("floor", {}), where, "floor")
    for key in [*limit, *floor]:
        if key not in ADJUSTABLE:
            raise ShapingError(f"{where}: cannot change {key!r} (connections, messages_per_connection, rate can)")
    for key in floor:
        if key not in limit:
            raise ShapingError(f"{where}: floor.{key} for a limit the rule does not change")
    changes = []
    for key, value in limit.items():
        low = _amount(key, floor[key], where) if key in floor else (1 / 3600 if key == "rate" else 1.0)
        if isinstance(value, str) and value.strip().endswith("%"):
            try:
                percent = float(value.strip()[:-1])
            except ValueError:
                raise ShapingError(f"{where}: limit.{key} {value!r} is not a percentage") from None
            if not 0 < percent < 100:
                raise ShapingError(f"{where}: limit.{key} {value!r}: a relative limit is between 0% and 100%")
            changes.append(Change(key, factor=percent / 100, floor=low))
        else:
            changes.append(Change(key, value=_amount(key, value, where), floor=low))
    return tuple(changes)


def _rule(entry: object, where: str, source: str) -> Rule:
    if not isinstance(entry, dict):
        raise ShapingError(f"{where} must be a table")
    _only(entry, where, {"name", "applies_to", "code", "enhanced", "text", "threshold", "window", "action", "scope",
                         "limit", "floor", "duration", "ramp_steps", "ramp_step"})
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ShapingError(f"{where}: name is required (lower-case letters, digits, '.', '-', '_')")
    where = f"{source}: rule {name}"
    applies_to = entry.get("applies_to", "*")
    kind, _, target = str(applies_to).partition(":")
    if applies_to != "*" and (kind not in ("provider", "domain") or not target):
        raise ShapingError(f"{where}: applies_to {applies_to!r} is not \"provider:NAME\", \"domain:D\" or \"*\"")
    if kind == "domain":
        applies_to = f"domain:{_domain(target, where)}"
    code = entry.get("code")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int) or not 400 <= code <= 599):
        raise ShapingError(f"{where}: code must be a refusal's SMTP reply code (400 to 599)")
    enhanced = entry.get("enhanced")
    if enhanced is not None and (not isinstance(enhanced, str) or not re.fullmatch(r"[45]\.\d{1,3}\.\d{1,3}",
                                                                                  enhanced)):
        raise ShapingError(f"{where}: enhanced must be an enhanced status code (\"4.7.28\")")
    text = entry.get("text")
    pattern = None
    if text is not None:
        try:
            pattern = re.compile(str(text))
        except re.error as exc:
            raise ShapingError(f"{where}: text is not a regular expression: {exc}") from None
    if code is None and enhanced is None and pattern is None:
        raise ShapingError(f"{where}: names no pattern (code, enhanced or text): it would match every reply")
    action = entry.get("action")
    if action not in ACTIONS:
        raise ShapingError(f"{where}: action must be one of {', '.join(ACTIONS)}")
    scope = entry.get("scope", "provider" if kind == "provider" else "domain")
    if scope not in SCOPES:
        raise ShapingError(f"{where}: scope must be provider or domain")
    changes = _changes(entry, where)
    if action == "limit" and not changes:
        raise ShapingError(f"{where}: action limit needs a limit table ({{connections = \"50%\"}})")
    if action != "limit" and changes:
        raise ShapingError(f"{where}: limit and floor belong to action limit only")
    threshold = _positive_int(entry.get("threshold", 1), where, "threshold")
    ramp_steps = entry.get("ramp_steps", 0)
    if isinstance(ramp_steps, bool) or not isinstance(ramp_steps, int) or not 0 <= ramp_steps <= 100:
        raise ShapingError(f"{where}: ramp_steps must be a whole number from 0 to 100")
    ramp_step = _duration(entry["ramp_step"], where, "ramp_step") if "ramp_step" in entry else 0.0
    if ramp_steps and not ramp_step:
        raise ShapingError(f"{where}: ramp_steps needs ramp_step (how long each step lasts)")
    if ramp_steps and action != "limit":
        raise ShapingError(f"{where}: ramp_steps belong to action limit only")
    return Rule(name, str(applies_to), code, enhanced, pattern, threshold,
                _duration(entry.get("window", "1h"), where, "window"), str(action), str(scope), changes,
                _duration(entry.get("duration"), where, "duration") if "duration" in entry
                else _missing(where, "duration"), ramp_steps, ramp_step, source)


def _missing(where: str, key: str) -> float:
    raise ShapingError(f"{where}: {key} is required")
