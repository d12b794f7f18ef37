"""What a transport is: a way to hand a batch of messages to one destination.

The scheduler groups the recipients of due messages by *destination* (the
transport and its next hop) and gives a transport a batch of jobs for one
destination at a time, so an SMTP transport can send several messages over one
connection. A transport reports one outcome per recipient; it never touches
the spool (the scheduler records outcomes and makes them durable).

A job's body is an iterable of chunks that may be read from the spool as it is
iterated (``spool.aio.async_spool.StoredBody``): iterate it in a worker thread, or in
the event loop with ``async for chunk in body_chunks(job.body)`` (which reads
big bodies in a worker thread). It may be iterated again, from the start, to
retry. Never join it: a body may be 50 MB.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Protocol, TypeGuard

import attrs

from spool import Outcome, Status


@attrs.frozen
class Destination:
    """Where recipients go: ``kind`` is smtp, mx, maildir or discard; ``target`` its next hop.

    ``source`` and ``helo``: the local address an SMTP connection binds to and the EHLO name it gives
    (``[egress]``; "" for the system's choice and ``server.hostname``). They are part of the key, so
    mail from two addresses to one next hop waits in two queues and rides two sets of connections.
    """

    kind: str
    target: str
    tls: str = "opportunistic"
    source: str = ""
    helo: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}" if self.target else self.kind


@attrs.define(eq=False)
class Job:
    """Some recipients of one message, all bound for the same destination."""

    queue_id: str
    sender: str
    recipients: tuple[str, ...]
    body: Iterable[bytes]
    size: int
    extra: dict[str, object] = attrs.field(factory=dict)
    source: str = ""  # the egress address chosen for it (its DELIVERY record names it)


OnOutcome = Callable[[int, list[Outcome]], None]
"""``on_outcome(i, outcomes)``: job ``i``'s outcomes are final (its next hop answered)."""

BeforeDot = Callable[[int, Sequence[str]], Awaitable[None]]
"""``await before_dot(i, recipients)``: these recipients of job ``i`` reach their point of no return
(docs/design.md, "The point of no return").

A transport awaits it right before it writes what lets the next hop take
them (SMTP's final dot; a Maildir's rename into ``new/``), and writes that
only once it returned: it returns when a record of it is durable in the
spool, so that recovery holds those recipients in doubt after a crash from
then on, and only then. It raises (a full disk, say) when that record could not be
made durable: the job must then not be sent, and the exception ends the
batch as any local error does."""


class TransportLost(RuntimeError):
    """A transport's own process went away mid-batch (a delivery worker died). Its cause is logged where it
    was seen, so the scheduler defers the batch with a one-line reason and no traceback.

    ``marked``: the batch's jobs (by index) whose point of no return that process had made durable itself (a
    worker's own marks), and for which recipients: in doubt, as if ``before_dot`` had returned for them.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.marked: dict[int, tuple[str, ...]] = {}


class Transport(Protocol):
    async def deliver(self, destination: Destination, jobs: Sequence[Job],
                      on_outcome: OnOutcome | None = None) -> list[list[Outcome]]:
        """Deliver ``jobs``; return, per job, one Outcome per recipient (in order).

        A failure to reach the destination at all is reported as DEFERRED
        outcomes with the reason, not raised: the scheduler backs off the
        destination when every outcome of a batch is a connection failure.

        A transport that sends jobs one after another calls ``on_outcome`` as
        soon as a job's outcomes are final, before it sends the next. Why: the
        scheduler then records them at once, and a crash later in the batch
        does not deliver the messages the next hop already took a second
        time. The returned list still holds every job's outcomes.

        A transport whose class sets ``PASSES_DOT = True`` also takes
        ``before_dot`` (a keyword, ``BeforeDot``) and awaits it for each job
        before that job's point of no return. For any other transport the
        scheduler records the point of no return of every job before it calls
        ``deliver`` (a claim is then doubt, as before the point existed).
        """
        ...


class DotTransport(Transport, Protocol):
    """A transport that awaits ``before_dot`` before each job's point of no return (``PASSES_DOT``)."""

    PASSES_DOT: bool

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]: ...


def passes_dot(transport: Transport) -> TypeGuard[DotTransport]:
    """Does ``transport`` take ``before_dot`` and await it before each job's point of no return?"""
    return bool(getattr(transport, "PASSES_DOT", False))


async def body_chunks(body: Iterable[bytes]) -> AsyncIterator[bytes]:
    """A job's body chunk by chunk, for a transport in the event loop: without blocking it on big reads."""
    if hasattr(body, "__aiter__"):
        async for chunk in body:  # a StoredBody: reads big bodies in a worker thread
            yield chunk
    else:
        for chunk in body:
            yield chunk


def failed_all(job: Job, status: Status, code: int, enhanced: str, reply: str, next_hop: str) -> list[Outcome]:
    return [Outcome(r, status, code, enhanced, reply, next_hop) for r in job.recipients]
