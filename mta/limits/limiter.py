"""Which counters a command counts on, and the reply when one is full.

At MAIL, a message is counted on its client address, its authenticated user
and its sender; at RCPT, a recipient on the same three. All of a command's
counters are counted together or not at all (``RateTable.take``), and a
refused command counts on none, so a client that waits gets back under its
limits as the window slides. Who is counted on what:

- the client address: only for sessions that are not authenticated (an
  authenticated user is counted as the user, whichever address, NAT or
  webmail host, they come from), and not for clients in ``mynetworks``
  when ``exempt_mynetworks`` is on;
- the user: every authenticated session;
- the sender: every message but those with the null sender (a DSN's), and
  not those from ``mynetworks`` when ``exempt_mynetworks`` is on.
"""

from __future__ import annotations

import functools
import time

import attrs

from mta.config.limits import LimitsSection, Rate
from mta.errors import StartError
from mta.limits.table import Counter, RateTable
from mta.smtp.common import Reply

__all__ = ["Over", "RateLimits"]


@attrs.frozen
class Over:
    """A command over a limit: the reply it gets and the limit's setting name (``client_messages``)."""

    reply: Reply
    limit: str


@functools.lru_cache(maxsize=4096)
def _counter(name: str, limit: int, window: int) -> Counter:
    """A session takes on the same few counters at each MAIL and RCPT: their digests are made once."""
    return Counter(name, limit, window)


class RateLimits:
    """The relay's limits and the shared table; ``None`` table when no limit is set.

    """

    def __init__(self, section: LimitsSection, source: str = "", previous: RateTable | None = None) -> None:
        """``previous``: the table of the limits this replaces (a reload), kept if it is the same file and size.

        Raises StartError (``source``'s ``limits.table``) when the table cannot be opened or mapped.
        """
        self.section = section
        self.table: RateTable | None = None
        if previous is not None and (previous.path, previous.slots) == (section.table, section.table_slots):
            self.table = previous
        elif section.any():
            try:
                self.table = RateTable(section.table, section.table_slots)
            except OSError as exc:
                raise StartError(f"cannot open the counter table {section.table}: {exc.strerror or exc}", source,
                                 "limits.table") from None

    def at_connect(self, client_ip: str, trusted: bool) -> Over | None:
        """A new connection: counted on ``client_connections`` (unless exempt), or refused with ``421 4.7.0``."""
        rate = self.section.client_connections
        if self.table is None or rate is None or (trusted and self.section.exempt_mynetworks):
            return None
        counter = _counter(f"client:{client_ip}:connections", rate.count, rate.window)
        if self.table.take([counter], time.time()) is None:
            return None
        return Over(Reply(421, "4.7.0", f"Error: too many connections from {client_ip}, try again later"),
                    "client_connections")

    def at_mail(self, client_ip: str, trusted: bool, user: str | None, sender: str) -> Over | None:
        return self._take("messages", client_ip, trusted, user, sender)

    def at_rcpt(self, client_ip: str, trusted: bool, user: str | None, sender: str) -> Over | None:
        return self._take("recipients", client_ip, trusted, user, sender)

    def _take(self, what: str, client_ip: str, trusted: bool, user: str | None, sender: str) -> Over | None:
        if self.table is None:
            return None
        exempt = trusted and self.section.exempt_mynetworks
        wanted: list[tuple[str, Rate | None, str, str]] = []
        if user is not None:
            wanted.append(("user", getattr(self.section, f"user_{what}"), user, "this user"))
        elif not exempt:
            wanted.append(("client", getattr(self.section, f"client_{what}"), client_ip, client_ip))
        if sender and not exempt:
            wanted.append(("sender", getattr(self.section, f"sender_{what}"), sender.lower(), "this sender"))
        counters = {_counter(f"{kind}:{key}:{what}", rate.count, rate.window): (kind, whom)
                    for kind, rate, key, whom in wanted if rate is not None}
        full = self.table.take(list(counters), time.time())
        if full is None:
            return None
        kind, whom = counters[full]
        text = f"too much mail from {whom}" if what == "messages" else f"too many recipients from {whom}"
        return Over(Reply(450, "4.7.1", f"Error: {text}, try again later"), f"{kind}_{what}")
