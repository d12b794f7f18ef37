"""The policy servers of a relay, asked in order at one stage; their actions made into one verdict.

The rules are Postfix's for ``check_policy_service`` in a list of
restrictions (access(5)): ``DUNNO`` asks the next server; ``OK`` ends the
asking, accepted; ``REJECT``, ``DEFER`` and ``4NN``/``5NN text`` end it
with that reply; ``DEFER_IF_PERMIT`` defers unless a later server rejects
(and is how postgrey greylists); ``DEFER_IF_REJECT`` turns a later
rejection into its deferral; ``PREPEND`` adds a header field to the
message; ``WARN`` is logged. The actions on the whole message: ``REDIRECT
user@domain`` (it goes to that one address instead), ``BCC user@domain``
(one more recipient), ``HOLD text`` (stored held, as a quarantine),
``FILTER transport:destination`` (delivered to that next hop) ask the
next server, as Postfix's smtpd goes on to its next restriction after
them, and the last of each kind in a transaction wins; ``DISCARD text``
ends the asking, accepted (a 250, nothing stored). They are kept for the
end of the data (``Verdict``), where the session carries them out. Any other
action, and every failure to get a reply, is logged and
costs ``on_failure``: ``tempfail`` (``451 4.3.5``) or ``dunno`` (the next
server is asked).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs

from mta.config.policy import PolicySection
from mta.observe.logline import event
from mta.policy.client import PolicyClient, PolicyUnavailable
from mta.policy.codec import (
    Bcc,
    DeferIfPermit,
    DeferIfReject,
    Discard,
    Dunno,
    Filter,
    Hold,
    Permit,
    PolicyProtocolError,
    Prepend,
    Redirect,
    Refuse,
    Unsupported,
    Warn,
    parse_action,
)
from mta.policy.filter_route import filter_route
from mta.smtp.common import Reply

__all__ = ["R_POLICY_FAILED", "PolicyChecks", "Verdict"]

log = logging.getLogger("mta.policy")

R_POLICY_FAILED = Reply(451, "4.3.5", "Policy service unavailable, try again later")


@attrs.frozen
class Verdict:
    """What the policy servers said at one stage: a refusal (``reply``), or go on with ``headers`` prepended and
    the message's ``redirect``, ``bcc``, ``hold`` and ``discard`` (each None: not asked for)."""

    reply: Reply | None = None
    reason: str = "policy"
    headers: tuple[str, ...] = ()
    redirect: str | None = None
    bcc: str | None = None
    hold: str | None = None
    discard: str | None = None
    filter: str | None = None


ACCEPTED = Verdict()


class PolicyChecks:
    """Every configured policy server's client, and the rules that read their answers."""

    def __init__(self, section: PolicySection) -> None:
        self.section = section
        self.clients = [PolicyClient(a, section.timeout, section.max_idle) for a in section.servers]

    def asked(self, stage: str, trusted: bool) -> bool:
        """Whether a session (trusted: in mynetworks or authenticated) is asked about at ``stage``."""
        return bool(self.clients) and stage in self.section.stages and not (trusted and self.section.skip_trusted)

    async def ask(self, attributes: Mapping[str, str], queue_id: str | None = None) -> Verdict:
        """Ask the servers in order about one request (``attributes``, already complete) and decide."""
        if_permit: Reply | None = None
        if_reject: Reply | None = None
        headers: list[str] = []
        message: dict[str, str] = {}  # redirect, bcc, hold, discard: the last of each
        for client in self.clients:
            try:
                action = parse_action(await client.ask(attributes))
            except (PolicyUnavailable, PolicyProtocolError) as exc:
                event(log, "policy_failed", queue_id, level=logging.WARNING, server=str(client.address),
                      error=str(exc), default=self.section.on_failure)
                if self.section.on_failure == "tempfail":
                    return Verdict(R_POLICY_FAILED, "policy_unavailable")
                continue
            if isinstance(action, Permit):
                break
            if isinstance(action, Refuse):
                if action.reply.is_permanent and if_reject is not None:
                    return Verdict(if_reject)
                return Verdict(action.reply)
            if isinstance(action, DeferIfPermit):
                if_permit = if_permit or action.reply
            elif isinstance(action, DeferIfReject):
                if_reject = if_reject or action.reply
            elif isinstance(action, Prepend):
                headers.append(action.header)
            elif isinstance(action, Redirect | Bcc):
                message["redirect" if isinstance(action, Redirect) else "bcc"] = action.address
            elif isinstance(action, Filter) and (route := filter_route(action.route)) is not None:
                message["filter"] = route
            elif isinstance(action, Hold):
                message["hold"] = action.text or "held by a policy server"
            elif isinstance(action, Discard):
                message["discard"] = action.text or "discarded by a policy server"
                break
            elif isinstance(action, Warn):
                event(log, "policy_warn", queue_id, level=logging.WARNING, server=str(client.address),
                      client=attributes.get("client_address"), text=action.text)
            elif isinstance(action, Unsupported | Filter):  # a FILTER to no next hop the relay can name
                event(log, "policy_unsupported", queue_id, level=logging.WARNING, server=str(client.address),
                      action=action.action if isinstance(action, Unsupported) else f"FILTER {action.route}",
                      default=self.section.on_failure)
                if self.section.on_failure == "tempfail":
                    return Verdict(R_POLICY_FAILED, "policy_unavailable")
            else:
                assert isinstance(action, Dunno)
        if if_permit is not None and "discard" not in message:
            return Verdict(if_permit)
        if not headers and not message:
            return ACCEPTED
        return Verdict(headers=tuple(headers), redirect=message.get("redirect"), bcc=message.get("bcc"),
                       hold=message.get("hold"), discard=message.get("discard"), filter=message.get("filter"))

    def close(self) -> None:
        for client in self.clients:
            client.close()
