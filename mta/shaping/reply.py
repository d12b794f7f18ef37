"""The next hop's reply in an outcome, as the rules read it; the relay's own deferrals have none.

An outcome records a reply in one of two ways: with its code (a refused
RCPT or DATA: ``code``, ``enhanced``, the text, the host that said it), or,
when the server said it and closed the connection (a ``421`` greeting, or a
``421`` to MAIL or RCPT: how Gmail's ``4.7.28`` comes), as a connection
failure whose text begins with the host and ends with the reply
(``mx.example.net[192.0.2.1]:25: the server is closing the connection: 421
4.7.28 ...``). Both count. The relay's own deferrals (a suspended provider,
a backed-off destination whose text repeats the last error, a local error)
carry no code and do not begin with a host, so no rule ever counts them.
"""

from __future__ import annotations

import re
from typing import Final

import attrs

__all__ = ["RemoteReply", "remote_reply"]

_QUOTED: Final = re.compile(r"(?P<hop>[^\s\[\]]+\[[^\]]*\]:\d+): [^;]*?(?P<code>[45]\d\d)"
                            r"(?: (?P<enhanced>[245]\.\d{1,3}\.\d{1,3}))?(?: (?P<text>[^;]*))?")


@attrs.frozen
class RemoteReply:
    code: int
    enhanced: str
    text: str
    next_hop: str  # the host that said it, ``host[address]:port``


def remote_reply(code: int, enhanced: str, text: str, next_hop: str) -> RemoteReply | None:
    """What the next hop said in this outcome, or None if it said nothing (the relay's own deferral)."""
    if code:  # a 2xx or 3xx is no complaint: rules match refusals (4xx, 5xx) only
        return RemoteReply(code, enhanced, text, next_hop) if next_hop and code >= 400 else None
    m = _QUOTED.match(text)
    if m is None:
        return None
    return RemoteReply(int(m["code"]), m["enhanced"] or "", (m["text"] or "").strip(), m["hop"])
