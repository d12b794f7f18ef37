"""Listening sockets for the SMTP server.

With several relay processes on one host (``[server] processes``), each opens
its own sockets on the same addresses with SO_REUSEPORT and the kernel spreads
incoming connections over them; a process that dies takes only its own
sockets with it.

An address that cannot be had is one line naming ``server.listen`` and the
problem (``bind_error``): a ``ConfigError`` (exit 2) when the config must
change (a host that does not resolve, an address this host does not have),
a ``StartError`` (exit 1) when something else stands in the way (a port
another program holds, a resolver that is down, a privileged port).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

import trio

from mta.config import ConfigError, ListenAddress
from mta.errors import StartError

BACKLOG = 1024
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def bind_error(addr: ListenAddress, index: int | str, exc: OSError) -> ConfigError | StartError:
    """What an operator needs to read when ``addr`` (``server.listen[index]``, or the key ``index``) cannot be bound."""
    key = f"server.listen[{index}]" if isinstance(index, int) else index
    where = f"cannot listen on {addr}"
    if isinstance(exc, socket.gaierror):
        if exc.errno in _NO_SUCH_NAME:
            return ConfigError(f"{where}: host {addr.host!r} does not resolve", key=key)
        return StartError(f"{where}: cannot resolve {addr.host!r} now ({exc.strerror})", key=key)
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"{where}: {addr.host} is not an address of this host", key=key)
    if exc.errno == errno.EADDRINUSE:
        return StartError(f"{where}: the address is in use (another program listens there)", key=key)
    if exc.errno == errno.EACCES:
        return StartError(f"{where}: permission denied (a port below 1024 needs root or CAP_NET_BIND_SERVICE)",
                          key=key)
    return StartError(f"{where}: {exc.strerror or exc}", key=key)


async def open_listeners(addrs: Iterable[ListenAddress], *, reuse_port: bool = False,
                         key: str = "server.listen") -> list[trio.SocketListener]:
    """Listen on every address (all of a host name's addresses); ``key``: the setting they come from.

    Raises:
        ConfigError, StartError: an address cannot be had (see ``bind_error``).
    """
    out: list[trio.SocketListener] = []
    try:
        for index, addr in enumerate(addrs):
            try:
                out += (await _open_reusing(addr) if reuse_port else
                        await trio.open_tcp_listeners(addr.port, host=addr.host, backlog=BACKLOG))
            except OSError as exc:
                raise bind_error(addr, index if key == "server.listen" else f"{key}[{index}]", exc) from None
    except BaseException:
        for listener in out:
            listener.socket.close()
        raise
    return out


async def _open_reusing(addr: ListenAddress) -> list[trio.SocketListener]:
    infos = await trio.socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[trio.SocketListener] = []
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
            for listener in out:
                listener.socket.close()
            raise
        out.append(trio.SocketListener(sock))
    return out
