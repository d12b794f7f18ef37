"""Where a recipient goes: its route (``[routes]``, or a content filter's) as the scheduler's ``Destination``."""

from __future__ import annotations

from mta.config import Config, DiscardRoute, LmtpRoute, MaildirRoute, MxRoute, NoRoute, SmtpRoute, tls_text
from mta.config.routes import parse_route
from mta.delivery.transport import Destination


def destination_for(config: Config, recipient: str, filter_route: str | None = None) -> Destination | NoRoute:
    """Where ``recipient`` goes: its route, or ``filter_route`` for every recipient of a message a policy server
    sent through a content filter (``extra["filter"]``, ``mta.policy.gate``)."""
    domain = recipient.rpartition("@")[2].lower()
    route = config.route_for_recipient(recipient) if filter_route is None else parse_route(filter_route)
    if isinstance(route, NoRoute):
        return route
    if isinstance(route, SmtpRoute):
        return Destination("smtp", f"{route.host}:{route.port}", tls_text(route.tls, route.policies))
    if isinstance(route, MxRoute):
        return Destination("mx", domain, tls_text(route.tls, route.policies))
    if isinstance(route, MaildirRoute):
        return Destination("maildir", route.path)
    if isinstance(route, DiscardRoute):
        return Destination("discard", "")
    if isinstance(route, LmtpRoute):
        return Destination("lmtp", route.target, "none")
    raise TypeError(f"unknown route {route!r}")
