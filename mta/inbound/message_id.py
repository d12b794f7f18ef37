"""The Message-ID of a message being received, read from its header block as the data streams in.

Why: the operator follows a message from the relay's log to the next hop's
by its Message-ID (docs/operations.md, "After a crash"), so the accepted and
delivery lines carry it. Only the header block is looked at, at most
``LIMIT`` bytes of it; a message without one (or with a longer header block)
has none in the log.
"""

from __future__ import annotations

import re
from typing import Final

LIMIT: Final = 16 << 10
_MESSAGE_ID = re.compile(rb"(?im)^message-id:[ \t]*(<[^<>\r\n]{1,250}>)")
_FOLD = re.compile(rb"\r?\n[ \t]+")


class MessageIdPeek:
    """Fed the message's data chunk by chunk; ``value`` once the header block ended (or ``LIMIT`` was reached)."""

    __slots__ = ("_head", "done")

    def __init__(self) -> None:
        self._head = bytearray()
        self.done = False

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        start = max(0, len(self._head) - 3)
        self._head += data[: LIMIT + 4 - len(self._head)]
        if self._head.startswith((b"\r\n", b"\n")):
            del self._head[:]
            self.done = True
            return
        ends = [i for i in (self._head.find(b"\n\r\n", start), self._head.find(b"\n\n", start)) if i >= 0]
        if ends:
            del self._head[min(ends) + 1:]
            self.done = True
        elif len(self._head) > LIMIT:
            self.done = True

    def value(self) -> str | None:
        """The first Message-ID header's ``<...>``, or None."""
        m = _MESSAGE_ID.search(_FOLD.sub(b" ", bytes(self._head)))
        return m.group(1).decode("utf-8", "replace") if m else None
