"""``[recipients]``: the tables of local recipients and aliases, and how far an alias may expand.

The tables themselves are files (their format: ``mta.recipients.table``),
read at start and again when they change, without a restart
(``mta.recipients.maps``). A domain with at least one address in a table is
a domain the relay knows every recipient of: any other address there is
refused at RCPT with ``550 5.1.1``.

``verify`` names relayed domains whose recipients are checked with their
next hop at RCPT instead (``mta.recipients.verify``).
"""

from __future__ import annotations

import os

import attrs

from mta.config.routes import Domain
from spool import Boolean, Derived, Duration, Integer, ListOf, Path, setting

__all__ = ["RecipientsSection"]


@attrs.frozen(kw_only=True)
class RecipientsSection:
    """``[recipients]``."""

    tables: tuple[str, ...] = setting(
        ListOf(Path()),
        "files of local recipients and aliases (one `ADDRESS [TARGET, ...]` a line; see \"Recipient tables and "
        "aliases\"), read at start and again within a second of a change; an address of a domain they name that "
        "is in none of them is refused at RCPT with `550 5.1.1`", ())
    alias_depth: int = setting(
        Integer(1, 100),
        "how many aliases deep one expansion may go; a deeper chain is refused at RCPT with `550 5.4.6`, as a "
        "loop is (Postfix's virtual_alias_recursion_limit)", 10)
    alias_fanout: int = setting(
        Integer(1, 100000),
        "how many recipients one RCPT may expand into; more is refused at RCPT with `452 4.5.3` "
        "(Postfix's virtual_alias_expansion_limit)", 1000)
    strict_local: bool = setting(
        Boolean(), "`true`: every domain named with a `maildir` or `lmtp` route is known to the tables, even one with "
        "no address in them, so a recipient there that no table lists is refused `550 5.1.1` (Postfix's "
        "local_recipient_maps); `false`: only the domains the tables name are", False)
    verify: tuple[str, ...] = setting(
        ListOf(Domain()),
        "domains (`.example.com`: every subdomain) whose recipients are verified at RCPT by asking their route's next "
        "hop (MAIL, RCPT, RSET, never DATA): one it refuses is refused `550 5.1.1`, "
        "one it cannot be asked about `450 4.1.1` (Postfix's reject_unverified_recipient)", ())
    verify_positive_ttl: float = setting(
        Duration(positive=True), "how long a next hop's yes to an address is remembered", 86400.0)
    verify_negative_ttl: float = setting(
        Duration(positive=True), "how long a next hop's no (a 5xx to RCPT) is remembered", 3600.0)
    verify_cache: str = setting(
        Path(), "the next hops' answers, shared by the relay's processes and kept across restarts (an append-only "
        "file, rewritten when it grows; see \"Recipient verification for relayed domains\"); made only when `verify` "
        "names a domain",
        derived=Derived("`<spool.dir>/verify-cache`", lambda r: os.path.join(r("spool.dir"), "verify-cache")))
    verify_timeout: float = setting(
        Duration(positive=True), "how long a probe may take, connecting included, before the RCPT gets `450 4.1.1`",
        10.0)
