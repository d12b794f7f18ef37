"""Which recipients get which notice: the client's DSN request (RFC 3461 §5) against what happened to them.

The request is in the envelope's extra map (``mta.smtp.dsn_params``); the
notices themselves are built by ``mta.delivery.dsn`` and enqueued by the
scheduler. The rules, as docs/operations.md "Delivery status notifications"
tells the operator:

- failure: a recipient that bounced or expired gets a failure notice unless
  its NOTIFY left FAILURE out (``NEVER``, or only SUCCESS/DELAY);
- delay: a recipient with NOTIFY naming DELAY gets one delay notice once the
  message has waited ``delivery.delay_warning`` (or ``DEFAULT_NOTIFY_DELAY``
  when that is unset); one that gave no NOTIFY only when
  ``delivery.delay_warning`` is set (Postfix's ``delay_warning_time``); NEVER
  or a NOTIFY without DELAY, never;
- success: only a recipient that asked for it (NOTIFY naming SUCCESS), once
  delivered: ``delivered`` when the relay itself put it in a mailbox (a
  Maildir route), ``relayed`` when a next hop took it without taking the
  request too (it did not offer DSN); a next hop that did take the request
  (``DSN_PASSED`` in the outcome's next-hop text) sends it itself, so the
  relay sends none. A discard route sends none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from mta.delivery import dsn as dsnmod
from mta.smtp.dsn_params import wants
from spool import Outcome, Status

__all__ = ["DEFAULT_NOTIFY_DELAY", "DSN_PASSED", "delay_due", "failures_to_report", "passed_on", "strip_passed",
           "successes_to_report"]

# The end of a delivered recipient's next-hop text when the next hop took its NOTIFY (mta.delivery.smtp_transport).
DSN_PASSED: Final = " dsn=passed"
# How long a message waits before a recipient that asked for NOTIFY=DELAY is told, when delay_warning is unset:
# sendmail's Timeout.queuewarn.
DEFAULT_NOTIFY_DELAY: Final = 4 * 3600.0


def passed_on(next_hop: str) -> bool:
    """Did the next hop take the recipient's DSN request (so its notices are the next hop's)?"""
    return next_hop.endswith(DSN_PASSED)


def strip_passed(next_hop: str) -> str:
    """The next-hop text without ``DSN_PASSED``: as the delivery line names the hop."""
    return next_hop.removesuffix(DSN_PASSED)


def failures_to_report(extra: Mapping[str, object], failed: Sequence[Outcome]) -> list[Outcome]:
    """The bounced or expired outcomes whose recipients did not turn failure notices off."""
    return [o for o in failed if wants(extra, o.recipient, "FAILURE", default=True)]


def successes_to_report(extra: Mapping[str, object],
                        outcomes: Sequence[Outcome]) -> list[tuple[Outcome, dsnmod.Action]]:
    """The delivered outcomes that asked for a success notice the relay must send, each with its action."""
    out: list[tuple[Outcome, dsnmod.Action]] = []
    for o in outcomes:
        if o.status is not Status.DELIVERED or passed_on(o.next_hop) or o.next_hop == "discard":
            continue
        if wants(extra, o.recipient, "SUCCESS", default=False):
            out.append((o, "relayed" if dsnmod.remote_mta_name(o.next_hop) else "delivered"))
    return out


def delay_due(extra: Mapping[str, object], recipient: str, delay_warning: float | None, age: float) -> bool:
    """Whether a deferred ``recipient`` of a message queued ``age`` seconds is owed its delay notice now."""
    if wants(extra, recipient, "DELAY", default=False):
        return age >= (delay_warning if delay_warning is not None else DEFAULT_NOTIFY_DELAY)
    if delay_warning is None or not wants(extra, recipient, "DELAY", default=True):
        return False
    return age >= delay_warning
