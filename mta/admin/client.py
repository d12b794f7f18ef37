"""The client side of the control socket: one request to a running relay, one answer.

The protocol is ``mta.admin.control``'s: one JSON object per line each way.
An error answer carries a ``code`` (``control.ERROR_CODES``) that says
which ``mta.admin.errors`` class it becomes here.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from mta.admin.errors import AdminError, BadRequest, NoSuchMessage, RelayNotAnswering, RequestFailed
from mta.admin.queue_ops import CHANGES

ANSWER_TIMEOUT = 120.0  # a full flush or a count over a large queue takes a while; a hung relay does not get forever
SELECTION_ANSWER_TIMEOUT = 3600.0  # a change of a selection (no ids): control.SELECTION_TIMEOUT on the relay's side
_BY_CODE: dict[str, type[AdminError]] = {"bad_request": BadRequest, "not_found": NoSuchMessage}


def ask_relay(path: str, req: dict[str, Any]) -> dict[str, Any] | None:
    """The relay's answer to ``req`` (``"ok": true``), or None when no relay listens on ``path``.

    Raises:
        RelayNotAnswering: the socket failed during the request, or the answer is not one JSON object.
        BadRequest, NoSuchMessage, RequestFailed: the relay refused the request (by its ``code``).
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            selection = req.get("op") in CHANGES and not req.get("ids")
            s.settimeout(SELECTION_ANSWER_TIMEOUT if selection else ANSWER_TIMEOUT)
            s.connect(path)
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = bytearray()
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except (FileNotFoundError, NotADirectoryError, ConnectionRefusedError):
        return None  # no socket, or one left by a relay that is gone: read the spool from disk
    except OSError as exc:
        raise RelayNotAnswering(f"control socket {path}: {exc}") from None
    try:
        answer = json.loads(buf)
    except ValueError:
        raise RelayNotAnswering(f"control socket {path}: no answer from the relay (see its log)") from None
    if not isinstance(answer, dict):
        raise RelayNotAnswering(f"control socket {path}: the relay's answer is not a JSON object")
    if not answer.get("ok"):
        error = _BY_CODE.get(str(answer.get("code")), RequestFailed)
        raise error(str(answer.get("error", "request failed")))
    return answer
