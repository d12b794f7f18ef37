"""Bounce-class rules: what a rules file holds, read and checked, and which class an outcome gets.

Theory of operation. A rule names a class and up to three conditions (the
reply code and the enhanced code as ``fnmatch`` patterns, the text as a
regular expression searched without regard to case); it matches when every
condition it names holds. A ``Classifier`` tries the operator's rules, then
the shipped ones (``defaults.toml``, unless the operator turns them off),
and gives the first match's class, else ``other``. Nothing here does I/O
beyond reading a rules file's text in ``load_file``; the class of an outcome
is a pure function of its recorded code, enhanced code and reply, so every
reader derives it from the log at read time and none needs it stored.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.resources
import re
import tomllib
from collections.abc import Sequence

import attrs

from spool import ConfigError, Outcome, Status

__all__ = ["CLASSED", "CLASSES", "Classifier", "Rule", "RulesError", "default_rules", "glob_regex", "load_file",
           "parse_rules"]

# Every class there is, in the order the docs and the metrics list them.
CLASSES = ("bad-mailbox", "mailbox-full", "policy", "rate-limited", "dns", "tls", "connection", "other")
_KEYS = ("class", "code", "enhanced", "text", "source")
# Outcomes that get a class: the ones that did not deliver (a deletion is the administrator's, not a reply).
CLASSED = frozenset({Status.DEFERRED, Status.BOUNCED, Status.EXPIRED})


class RulesError(ConfigError):
    """A rules file that cannot be used: its origin and the rule's index are in the one-line message."""


@attrs.frozen
class Rule:
    """One rule: ``klass`` when every condition given holds (an empty pattern is no condition)."""

    klass: str
    code: str = ""
    enhanced: str = ""
    text: re.Pattern[str] | None = None
    source: str = ""

    def matches(self, code: int, enhanced: str, text: str) -> bool:
        if self.code and not fnmatch.fnmatchcase(str(code), self.code):
            return False
        if self.enhanced and not fnmatch.fnmatchcase(enhanced, self.enhanced):
            return False
        return self.text is None or self.text.search(text) is not None


def glob_regex(pattern: str) -> str:
    """A rule's code pattern (``?``, ``*``, ``[...]``) as an anchored regular expression that Python's ``re``
    and Java's (the Spark report's ``rlike``) read alike."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "?":
            out.append(".")
        elif c == "*":
            out.append(".*")
        elif c == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            out.append("[" + "".join("\\" + ch if ch in "\\[]^" else ch for ch in pattern[i + 1:end]) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "^" + "".join(out) + "$"


def parse_rules(text: str, origin: str) -> tuple[Rule, ...]:
    """The ``[[rule]]`` tables of a rules file's ``text``. Raises RulesError naming ``origin`` and the rule."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(f"not TOML: {exc}", origin) from None
    extra = sorted(set(data) - {"rule"})
    if extra:
        raise RulesError(f"unknown key {extra[0]!r} (a rules file holds [[rule]] tables)", origin)
    entries = data.get("rule", [])
    if not isinstance(entries, list):
        raise RulesError("rule must be an array of tables ([[rule]])", origin)
    return tuple(_rule(entry, origin, i) for i, entry in enumerate(entries))


def _rule(entry: object, origin: str, i: int) -> Rule:
    where = f"rule[{i}]"
    if not isinstance(entry, dict):
        raise RulesError("a rule is a table", origin, where)
    for key in entry:
        if key not in _KEYS:
            raise RulesError("unknown key", origin, f"{where}.{key}")
    for key, value in entry.items():
        if not isinstance(value, str):
            raise RulesError(f"must be a string, got {value!r}", origin, f"{where}.{key}")
    klass = entry.get("class")
    if klass not in CLASSES:
        raise RulesError(f"class must be one of {', '.join(CLASSES)}, got {klass!r}", origin, f"{where}.class")
    pattern: re.Pattern[str] | None = None
    if "text" in entry:
        try:
            pattern = re.compile(entry["text"], re.IGNORECASE)
        except re.error as exc:
            raise RulesError(f"not a regular expression: {exc}", origin, f"{where}.text") from None
    if not any(key in entry for key in ("code", "enhanced", "text")):
        raise RulesError("a rule needs at least one of code, enhanced, text", origin, where)
    return Rule(klass, entry.get("code", ""), entry.get("enhanced", ""), pattern, entry.get("source", ""))


@functools.cache
def default_rules() -> tuple[Rule, ...]:
    """The rules shipped in the package (``defaults.toml``)."""
    text = importlib.resources.files(__package__).joinpath("defaults.toml").read_text(encoding="utf-8")
    return parse_rules(text, "mta/bounce_class/defaults.toml")


def load_file(path: str) -> tuple[Rule, ...]:
    """An operator's rules file. Raises RulesError (a file that cannot be read included)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise RulesError(f"cannot read it: {getattr(exc, 'strerror', None) or exc}", path) from None
    return parse_rules(text, path)


def rules_table(rules: Sequence[Rule]) -> str:
    """The rules as the markdown table docs/operations.md shows (a test keeps the two the same)."""
    rows = ["| # | class | code | enhanced | text (regular expression) | source |",
            "| --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(rules, 1):
        text = r.text.pattern.replace("|", "\\|") if r.text is not None else ""
        cells = [str(i), r.klass, f"`{r.code}`" if r.code else "", f"`{r.enhanced}`" if r.enhanced else "",
                 f"`{text}`" if text else "", r.source.replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


class Classifier:
    """The class of an outcome: the first of ``rules`` that matches, else ``other``."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)

    def classify(self, code: int, enhanced: str, text: str) -> str:
        for rule in self.rules:
            if rule.matches(code, enhanced, text):
                return rule.klass
        return "other"

    def of(self, outcome: Outcome) -> str | None:
        """An outcome's class, or None for one that needs none (delivered, deleted)."""
        if outcome.status not in CLASSED:
            return None
        return self.classify(outcome.code, outcome.enhanced, outcome.reply)
