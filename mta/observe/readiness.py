"""``GET /ready`` on the metrics listener: the check a load balancer polls before it sends clients here.

Ready means the relay takes new mail: its SMTP listeners are open (the
metrics listener opens after them) and no drain has begun. The answer turns
to ``503`` the moment SIGTERM starts a drain (``mta.process.lifecycle``),
while transactions in flight finish, so a balancer stops sending new
clients before the listeners refuse them. ``HEAD`` is answered as ``GET``
without a body. Nothing else is said: the page tells no secret.
"""

from __future__ import annotations

READY_PATH = "/ready"

_READY = ("200 OK", b"ready\n")
_DRAINING = ("503 Service Unavailable", b"draining\n")


def answer(ready: bool, method: str) -> tuple[str, list[tuple[str, str]], bytes]:
    """Status line, headers and body of the readiness answer; a method other than GET or HEAD gets 405."""
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")]
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", [*headers, ("Allow", "GET, HEAD")], b"GET or HEAD\n"
    status, body = _READY if ready else _DRAINING
    return status, headers, body if method == "GET" else b""
