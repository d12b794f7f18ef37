"""FILTER's next hop, read into the relay's own route syntax (``smtp://HOST:PORT``, ``lmtp:/socket``).

Why apart from the codec: the route grammar is the config's, which the
sans-IO codec may not import. A policy server written for Postfix names
the content filter as ``transport:destination`` (transport(5)):
``smtp:[10.0.0.1]:10025``, ``lmtp:unix:/path``; the relay's own syntax is
taken too. Only next hops over SMTP or LMTP: a content filter is a server
that passes the message on.
"""

from __future__ import annotations

import re

from mta.config.routes import LmtpRoute, SmtpRoute, parse_route
from spool import ConfigError

__all__ = ["filter_route"]

# Postfix's smtp:[HOST]:PORT, smtp:HOST:PORT, lmtp:inet:HOST:PORT.
_POSTFIX_NEXT_HOP = re.compile(r"(smtp|lmtp):(?:inet:)?\[?([A-Za-z0-9.:-]+?)\]?(?::([0-9]{1,5}))?")


def filter_route(text: str) -> str | None:
    """FILTER's next hop in the relay's route syntax, or None: not a next hop over SMTP or LMTP.

    Postfix's ``smtp:[10.0.0.1]:10025`` and the relay's own ``smtp://10.0.0.1:10025`` both; a unix socket
    as ``lmtp:/path`` or Postfix's ``lmtp:unix:/path``.
    """
    text = text.strip()
    if text.startswith("lmtp:unix:"):
        text = "lmtp:" + text.removeprefix("lmtp:unix:")
    elif "://" not in text and (m := _POSTFIX_NEXT_HOP.fullmatch(text)):
        kind, host, port = m.groups()
        host = f"[{host}]" if ":" in host else host
        text = f"{kind}://{host}" + (f":{port}" if port else "")
    if text.startswith("lmtp:") and not text.startswith(("lmtp://", "lmtp:/")):
        return None  # a relative socket path: relative to what?
    try:
        route = parse_route(text)
    except ConfigError:
        return None
    return text if isinstance(route, SmtpRoute | LmtpRoute) else None


