"""Listening sockets for the SMTP server.

With several relay processes on one host (``[server] processes``), each opens
its own sockets on the same addresses with SO_REUSEPORT and the kernel spreads
incoming connections over them; a process that dies takes only its own
sockets with it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

import trio

from mta.config import ListenAddress

BACKLOG = 1024


async def open_listeners(addrs: Iterable[ListenAddress], *, reuse_port: bool = False) -> list[trio.SocketListener]:
    if not reuse_port:
        listeners: list[trio.SocketListener] = []
        for addr in addrs:
            listeners += await trio.open_tcp_listeners(addr.port, host=addr.host, backlog=BACKLOG)
        return listeners
    out: list[trio.SocketListener] = []
    for addr in addrs:
        infos = await trio.socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM,
                                              flags=socket.AI_PASSIVE)
        for family, type_, proto, _, sockaddr in infos:
            sock = trio.socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(sockaddr)
                sock.listen(BACKLOG)
            except BaseException:
                sock.close()
                raise
            out.append(trio.SocketListener(sock))
    return out
