"""Admin changes to one message: hold, release, delete, flush (retry now).

An admin change is an attempt of its own: the envelope is claimed with a START
of kind ADMIN (refused with MessageBusy while the message is being delivered),
and ended with a replacement envelope (hold: the held class; release and
flush: new mail's class) or, for a delete, a DELIVERY record that gives every
remaining recipient the DELETED outcome and a FINISH. The listing side (find,
list, count) is ``spool.read.listing``; the trio layer's ``AsyncSpool.hold`` and
friends call these.
"""

from __future__ import annotations

from spool.engine.claims import Claims
from spool.engine.core import Attempt
from spool.errors import CorruptRecord, MessageBusy, MessageMoved, SpoolError
from spool.format.record import HELD_CLASS, Outcome, RecordType, StartKind, Status
from spool.read import listing as admin
from spool.read.reader import Reporter
from spool.write.log import LogWriter


class AdminChanges(Claims):
    """Changes by queue id, made as attempts (``spool.engine.claims``) that end at once."""

    # What ``spool.read.listing`` lists through (its ``Listable``): the listing side.

    def source(self) -> LogWriter:
        return self.writer

    def live_start(self) -> int:
        """Every live envelope lies at or after this position (see spool.read.listing)."""
        return min([r.pos for r in self.runners] + list(self.by_envelope))

    def active(self) -> dict[int, Attempt]:
        return self.by_envelope

    def damage_reporter(self) -> Reporter:
        """An admin read goes past damage: quarantined and named (``spool.damage.policy``)."""
        return self.damage.reporter("an admin read")

    # -- the changes ---------------------------------------------------------------

    def claim_for_admin(self, pos: int) -> Attempt:
        """Claim a live envelope for an admin change. Raises MessageBusy while it is being delivered."""
        if pos in self.by_envelope or self.writer.mark_pending(pos):
            raise MessageBusy("the message is being delivered right now; try again when the attempt ends")
        try:
            frame = self.writer.read_frame(pos)
        except (CorruptRecord, FileNotFoundError) as exc:
            anomaly = self.anomaly_at(pos, getattr(exc, "reason", None) or str(exc))
            self.damage.report(anomaly, "an admin change")
            raise CorruptRecord(f"the message's envelope is damaged: {anomaly.message()}", anomaly.path,
                                anomaly.offset) from None
        if frame.garbage or frame.rtype != RecordType.ENVELOPE:
            raise MessageMoved("the message changed while we looked; list it again")
        return self._claim(frame, self._now(), StartKind.ADMIN)

    def admin_replace(self, attempt: Attempt, *, klass: int, held: bool) -> int:
        new = self._write_replacement(attempt.envelope, attempt.envelope_pos, klass,
                                      list(attempt.envelope.recipients),
                                      attempts=attempt.envelope.attempts, held=held)
        self._end(attempt, new)
        return new

    def admin_delete(self, attempt: Attempt, reason: str = "deleted by the administrator") -> None:
        outs = [Outcome(r, Status.DELETED, 0, "", reason, "") for r in attempt.remaining]
        self.record_delivery(attempt, outs)
        self._end(attempt, None)

    def change(self, message_id: int, action: str) -> bool:
        """Offline admin change by queue id: hold, release, delete or flush. Durable on return.

        Returns False when there was nothing to do (already held, not deferred, ...).
        """
        done = self.apply_change(admin.find(self, message_id), action)
        if done:
            self.commit()
        return done

    def apply_change(self, msg: admin.LiveMessage, action: str) -> bool:
        """Make ``action`` on the message a listing found (no second walk to find it); not yet committed.

        Returns False when there was nothing to do. Raises MessageBusy while
        it is being delivered or if it changed since it was listed.
        """
        if not wanted(msg, action):
            return False
        attempt = self.claim_for_admin(msg.pos)
        if action == "delete":
            self.admin_delete(attempt)
        elif action == "hold":
            self.admin_replace(attempt, klass=HELD_CLASS, held=True)
        elif action in ("release", "flush"):
            self.admin_replace(attempt, klass=0, held=False)
        else:
            raise ValueError(f"unknown action {action!r}")
        return True

    def change_batch(self, msgs: list[admin.LiveMessage], action: str) -> list[bool | str]:
        """``apply_change`` for each listed message, then one commit: each one's result or error."""
        results: list[bool | str] = []
        for msg in msgs:
            try:
                results.append(self.apply_change(msg, action))
            except (SpoolError, OSError) as exc:  # busy, changed meanwhile, damaged: that message alone
                results.append(str(exc))
        if any(r is True for r in results):
            self.commit()
        return results


def wanted(msg: admin.LiveMessage, action: str) -> bool:
    """Whether ``action`` would change the message: not a hold of a held one, a release of a free one,
    or a flush of one that is held or already due (new mail's class)."""
    return not ((action == "hold" and msg.held) or (action == "release" and not msg.held)
                or (action == "flush" and (msg.held or msg.klass == 0)))
