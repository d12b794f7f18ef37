"""What the scheduler (``mta.delivery.scheduler``) keeps of its work, and how an outcome reads in it.

A claimed message and how many of its jobs are still out (``Tracker``); a destination's queue, its connections
in use, its backoff and its shape (``DestState``); a deferral's text as the queue shows it (``last_error``) and
the queue lifetime as an expiry names it (``lifetime_text``).
"""

from __future__ import annotations

import collections

import attrs

from mta.delivery.transport import Job
from mta.shaping.gate import DestShape
from spool import Attempt, Outcome


@attrs.define(eq=False)
class Tracker:
    """One claimed message: how many of its jobs are still out."""

    attempt: Attempt
    outstanding: int = 0
    last_error: str = ""
    hold: bool = False  # its data is damaged and on_damaged_body = "hold": it goes to the held class
    appended_to: int = 0  # the log's head after its last DELIVERY (and DSN) was appended: durable before FINISH
    # Recipients past the point of no return whose outcome was lost with the process sending them (a delivery
    # worker killed): in doubt, held with in_doubt = "hold", as recovery does after the relay's own crash.
    in_doubt: tuple[str, ...] = ()
    # DSNs appended and not yet logged: (the job whose outcomes they report, the DSN's queue id, recipients).
    dsns: list[tuple[Job, str, int]] = attrs.field(factory=list)
    delay_warned: bool = False  # a delay notice was appended in this attempt (the replacement envelope says so)
    # Recipients deferred without a connection because their provider is suspended: recipient -> the
    # suspension's end (unix time), from which the message's retry class is chosen (mta.delivery.retry_class).
    suspended: dict[str, float] = attrs.field(factory=dict)


@attrs.define(eq=False)
class DestState:
    queue: collections.deque[tuple[Job, Tracker]] = attrs.field(factory=collections.deque)
    active: int = 0
    failures: int = 0
    backoff_until: float = 0.0
    last_error: str = ""
    last_enhanced: str = "4.4.1"  # the last failure's code: a postponed try says the same (a TLS or login fault)
    shape: DestShape | None = None  # its provider and limits ([shaping]); None while its MX hosts are looked up


def last_error(o: Outcome) -> str:
    """A deferral as ``mta queue list`` and ``show`` give it: the reply with its codes, and the host that sent it."""
    text = " ".join(part for part in (str(o.code) if o.code else "", o.enhanced, o.reply) if part)
    relay = o.next_hop.partition(" tls=")[0]
    return f"{text} (from {relay})" if relay and o.code else text


def lifetime_text(seconds: float) -> str:
    """``5 days``, ``6 hours``, ``90 s``: the queue lifetime as an expiry's reply names it."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if (seconds >= size and seconds % size == 0) or seconds >= 2 * size:
            count = f"{seconds / size:.3g}"
            return f"{count} {unit}" if count == "1" else f"{count} {unit}s"
    return f"{seconds:.3g} s"
