"""The trio side of the PROXY protocol: a balancer's header read off a new connection within its deadline.

The parsing is ``mta.inbound.proxy_header``'s; this reads bytes into it and
says, through ``refused``, why a connection gets no session (a bad header,
none, or none in time). The server closes those connections unanswered.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from mta.inbound.proxy_header import HeaderReader, NeedData, ProxyHeader, ProxyHeaderError

READ_SIZE = 4096  # a v1 header is at most 107 bytes, a v2 one without TLVs 28 or 52

Refused = Callable[[str, str], None]  # (reason, detail): ``proxy_header`` or ``proxy_timeout``, and why


async def receive_header(stream: trio.abc.ReceiveStream, timeout: float, refused: Refused) -> ProxyHeader | None:
    """The PROXY header at the start of ``stream``, read within ``timeout``; None (``refused`` told why) if
    the bytes are no header, the connection closed first, or the time ran out.

    Raises: trio.BrokenResourceError or OSError from the stream (the balancer went away).
    """
    reader = HeaderReader()
    with trio.move_on_after(timeout):
        while True:
            try:
                found = reader.next_event()
            except ProxyHeaderError as exc:
                refused("proxy_header", str(exc))
                return None
            if not isinstance(found, NeedData):
                return found
            data = await stream.receive_some(READ_SIZE)
            if not data:
                refused("proxy_header", "closed before a whole PROXY header")
                return None
            reader.receive_data(data)
    refused("proxy_timeout", "no whole PROXY header within header_timeout")
    return None
