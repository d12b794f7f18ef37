"""``[events]``: the delivery event stream's HTTP endpoint on the relay, consumers' cursors, and the shippers.

The stream itself needs no setting: it is the spool's log (``spool.EventStream``).
What is set here is how it is served (``listen`` and its bounds), where the
consumers' cursors live, and where the shippers (``mta events ship``) send.
"""

from __future__ import annotations

import attrs

from mta.config.values import Listen, ListenAddress
from spool import Duration, Integer, Optional, setting

__all__ = ["EventsSection"]


@attrs.frozen(kw_only=True)
class EventsSection:
    """``[events]``."""

    listen: ListenAddress | None = setting(
        Optional(Listen()), "the HTTP endpoint `GET /events` (see \"Consuming events\"); not set, none", None)
    max_connections: int = setting(
        Integer(1, 256), "event requests served at once; more wait in the listen backlog", 8)
    max_wait: float = setting(
        Duration(at_most=3600.0), "the longest a request with `wait=` is held open for new events", 30.0)
    page_records: int = setting(
        Integer(1, 100_000), "records read for one answer at most (their events are sent whole)", 1000)
