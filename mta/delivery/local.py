"""Transports that stay on this machine: maildir (the embedded default) and discard (benchmarks)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import trio

from mta.delivery import maildir
from mta.delivery.transport import BeforeDot, Destination, Job, OnOutcome
from spool import FileIO, Outcome, Status


class MaildirTransport:
    """Delivers into ``PATH/<localpart>/new`` and reports success only once it is durable there.

    ``io``: the file layer under the Maildirs (the spool's, so that one recording sees both).
    """

    PASSES_DOT = True  # the point of no return of a job: before its first rename into a Maildir's new/

    def __init__(self, hostname: str, io: FileIO | None = None) -> None:
        self.hostname = hostname
        self.writer = maildir.MaildirWriter(io)

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        results = []
        for i, job in enumerate(jobs):
            point = None if before_dot is None else _Point(before_dot, i)
            outcomes = await trio.to_thread.run_sync(self._deliver_job, destination.target, job, point)
            if on_outcome is not None:
                on_outcome(i, outcomes)
            results.append(outcomes)
        return results

    def _deliver_job(self, root: str, job: Job, point: Callable[[str], None] | None = None) -> list[Outcome]:
        outs: list[Outcome] = []
        hop = f"maildir:{root}"
        for rcpt in job.recipients:
            try:
                self.writer.deliver(root, rcpt, job.sender, job.body, hostname=self.hostname,
                                    before_rename=None if point is None else functools.partial(point, rcpt))
            except maildir.InvalidMailbox as exc:
                outs.append(Outcome(rcpt, Status.BOUNCED, exc.code, exc.status, str(exc), hop))
            except OSError as exc:
                outs.append(Outcome(rcpt, Status.DEFERRED, 451, "4.3.0", f"maildir write failed: {exc}", hop))
            else:
                outs.append(Outcome(rcpt, Status.DELIVERED, 250, "2.0.0", "delivered to maildir", hop))
        return outs


class _Point:
    """``before_dot(i, (recipient,))`` from the worker thread a job is written in, before each recipient's
    rename into ``new/``: a recipient whose file was not renamed yet is not in doubt."""

    def __init__(self, before_dot: BeforeDot, index: int) -> None:
        self.before_dot = before_dot
        self.index = index

    def __call__(self, recipient: str) -> None:
        trio.from_thread.run(self.before_dot, self.index, (recipient,))


class DiscardTransport:
    PASSES_DOT = True  # nothing leaves: no point of no return, nothing ever in doubt

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        """All at once, with no I/O: nothing for ``on_outcome`` to shorten, and no ``before_dot`` to await."""
        return [[Outcome(r, Status.DELIVERED, 250, "2.0.0", "discarded", "discard") for r in job.recipients]
                for job in jobs]
