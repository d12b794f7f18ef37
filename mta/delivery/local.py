"""Transports that stay on this machine: maildir (the embedded default) and discard (benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from mta.delivery import maildir
from mta.delivery.transport import BeforeDot, Destination, Job, OnOutcome
from spool.fileio import FileIO
from spool.format.record import Outcome, Status


class MaildirTransport:
    """Delivers into ``PATH/<localpart>/new`` and reports success only once it is durable there.

    ``io``: the file layer under the Maildirs (the spool's, so that one recording sees both).
    """

    PASSES_DOT = True  # the point of no return of a job: before its first write into a Maildir

    def __init__(self, hostname: str, io: FileIO | None = None) -> None:
        self.hostname = hostname
        self.writer = maildir.MaildirWriter(io)

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        results = []
        for i, job in enumerate(jobs):
            if before_dot is not None:
                await before_dot(i)
            outcomes = await trio.to_thread.run_sync(self._deliver_job, destination.target, job)
            if on_outcome is not None:
                on_outcome(i, outcomes)
            results.append(outcomes)
        return results

    def _deliver_job(self, root: str, job: Job) -> list[Outcome]:
        outs: list[Outcome] = []
        hop = f"maildir:{root}"
        for rcpt in job.recipients:
            try:
                self.writer.deliver(root, rcpt, job.sender, job.body, hostname=self.hostname)
            except maildir.InvalidMailbox as exc:
                outs.append(Outcome(rcpt, Status.BOUNCED, exc.code, exc.status, str(exc), hop))
            except OSError as exc:
                outs.append(Outcome(rcpt, Status.DEFERRED, 451, "4.3.0", f"maildir write failed: {exc}", hop))
            else:
                outs.append(Outcome(rcpt, Status.DELIVERED, 250, "2.0.0", "delivered to maildir", hop))
        return outs


class DiscardTransport:
    PASSES_DOT = True  # nothing leaves: no point of no return, nothing ever in doubt

    async def deliver(self, destination: Destination, jobs: Sequence[Job], on_outcome: OnOutcome | None = None,
                      *, before_dot: BeforeDot | None = None) -> list[list[Outcome]]:
        """All at once, with no I/O: nothing for ``on_outcome`` to shorten, and no ``before_dot`` to await."""
        return [[Outcome(r, Status.DELIVERED, 250, "2.0.0", "discarded", "discard") for r in job.recipients]
                for job in jobs]
