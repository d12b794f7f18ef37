"""A recipient table: which local addresses exist, which are aliases, and what an RCPT expands into.

One format for both, in the manner of Postfix's ``virtual`` file::

    # a comment; blank lines are skipped
    alice@example.com                                   # an address that exists
    sales@example.com    alice@example.com, bob@example.com  # an alias: delivered to its targets
    bob@example.com      bob@example.com, b@elsewhere.example  # keeps a copy: it names itself

A line is an address, then (after white space) its targets, separated by
commas or white space. An address alone exists and is delivered as itself;
an address with targets is an alias and is delivered to them instead
(unless it names itself among them, which keeps a copy for it). Targets may
be aliases in turn, or addresses anywhere. Addresses are compared without
regard to case. An address that appears twice is an error, named with its
line, as is anything that is not ``local@domain``.

A domain that any address of the table is at is *known*: every recipient
of it must be in the table (``Refused`` 550 5.1.1 otherwise, at RCPT, never
a bounce later). Expansion is depth first, keeps the first of duplicates,
stops at ``depth`` aliases deep and at ``fanout`` recipients, and refuses
a loop (an alias reached again through its own targets) with 5.4.6.

Lookups are one dict access per alias followed: the table is read into a
dict once (``parse``), however many lines it has.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import attrs

from mta.smtp.common import Reply

__all__ = ["Expanded", "Refused", "Table", "TableError", "parse", "table_of"]

_ADDRESS = re.compile(r"[^\s@,<>\"]+@[^\s@,<>\"]+")
_SEPARATORS = re.compile(r"[\s,]+")


class TableError(ValueError):
    """A table file that cannot be used: names the file and line."""


@attrs.frozen
class Expanded:
    """What one RCPT becomes: the envelope's recipients (the address itself, if it is no alias)."""

    recipients: tuple[str, ...]


@attrs.frozen
class Refused:
    """The RCPT is refused with ``reply``; ``why`` is the log line's and the metric's reason
    (unknown_recipient, alias_loop, alias_depth, alias_fanout)."""

    reply: Reply
    why: str


def _key(address: str) -> str:
    return address.casefold()


def _domain(address: str) -> str:
    return address.rpartition("@")[2].casefold().rstrip(".")


@attrs.frozen
class Table:
    """The parsed table: ``entries`` maps an address (case-folded) to its targets (empty: it is delivered as
    itself); ``domains`` are the known domains."""

    entries: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    domains: frozenset[str] = frozenset()

    def knows(self, domain: str) -> bool:
        return domain.casefold().rstrip(".") in self.domains

    def expand(self, address: str, *, depth: int, fanout: int, known: bool = False) -> Expanded | Refused:
        """``address`` as the envelope should hold it, or why it is refused (module docstring).

        ``known``: its domain is known even if no address of the table is at it (``strict_local``).
        """
        if not known and not self.knows(_domain(address)):
            return Expanded((address,))
        if _key(address) not in self.entries:
            return Refused(Reply(550, "5.1.1", f"<{address}>: Recipient address rejected: user unknown"),
                           "unknown_recipient")
        out: dict[str, str] = {}  # case-folded -> as written, in order
        refusal = self._walk(address, (), depth, fanout, out)
        return refusal if refusal is not None else Expanded(tuple(out.values()))

    def _walk(self, address: str, chain: tuple[str, ...], depth: int, fanout: int,
              out: dict[str, str]) -> Refused | None:
        key = _key(address)
        targets = self.entries.get(key)
        if not targets:
            out.setdefault(key, address)
            if len(out) > fanout:
                return Refused(Reply(452, "4.5.3", f"<{chain[0] if chain else address}>: alias expands to more "
                                                   f"than {fanout} recipients"), "alias_fanout")
            return None
        if len(chain) >= depth:
            return Refused(Reply(550, "5.4.6", f"<{chain[0]}>: alias expansion deeper than {depth} aliases"),
                           "alias_depth")
        inner = (*chain, key)
        for target in targets:
            t = _key(target)
            if t == key:  # names itself: keeps a copy, not expanded again
                out.setdefault(key, address)
            elif t in inner:
                path = " -> ".join((*inner, t))
                return Refused(Reply(550, "5.4.6", f"<{inner[0]}>: alias loop ({path})"), "alias_loop")
            elif (refusal := self._walk(target, inner, depth, fanout, out)) is not None:
                return refusal
        if len(out) > fanout:
            return Refused(Reply(452, "4.5.3", f"<{inner[0]}>: alias expands to more than {fanout} recipients"),
                           "alias_fanout")
        return None


def parse(lines: Iterable[str], source: str, into: dict[str, tuple[str, ...]] | None = None) -> dict[str, tuple[
        str, ...]]:
    """The entries of one file (added to ``into``, several files making one table). Raises TableError."""
    entries = {} if into is None else into
    for number, raw in enumerate(lines, 1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        words = [w for w in _SEPARATORS.split(line) if w]
        for word in words:
            if not _ADDRESS.fullmatch(word) or len(word) > 254:
                raise TableError(f"{source}:{number}: {word!r} is not an address (local@domain)")
        key = _key(words[0])
        if key in entries:
            raise TableError(f"{source}:{number}: {words[0]} is listed twice")
        entries[key] = tuple(words[1:])
    return entries


def table_of(entries: dict[str, tuple[str, ...]]) -> Table:
    return Table(entries, frozenset(_domain(k) for k in entries))
