"""The relay's accept loop (mta.inbound.accept) on real sockets: a full file table is waited out, connections
are admitted in the order they came, and a stream its handler left open is closed."""

from __future__ import annotations

import logging
import os
import resource
import socket
from typing import Any

import trio

from mta.inbound.accept import accept_loop


class _Seen(logging.Handler):
    """Sets ``event`` at the first record whose message holds ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def _listener() -> trio.SocketListener:
    return (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]


async def _greeted(sock: trio.socket.SocketType) -> bytes:
    got = b""
    while not got.endswith(b"\n"):
        chunk = await sock.recv(100)
        if not chunk:
            break
        got += chunk
    return got


async def test_a_full_file_table_is_waited_out_and_every_client_then_served() -> None:
    listener = await _listener()
    port = listener.socket.getsockname()[1]
    served: list[Any] = []

    async def handler(stream: trio.SocketStream, peer: Any, admitted: object) -> None:
        served.append(peer)
        await stream.send_all(b"hello\r\n")
        await stream.aclose()

    seen = _Seen("event=accept_failed error=EMFILE")
    logger = logging.getLogger("mta.smtpd")
    logger.addHandler(seen)
    clients = [trio.socket.socket() for _ in range(3)]  # their descriptors exist before the table is full
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_loop, listener, lambda peer: None, handler)
            lowest_free = os.open(os.devnull, os.O_RDONLY)
            os.close(lowest_free)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor can be had
            try:
                for client in clients:
                    await client.connect(("127.0.0.1", port))
                with trio.fail_after(10):
                    await seen.event.wait()  # the accept failed, was logged, and the loop lives on
                assert served == []
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            with trio.fail_after(10):
                for client in clients:
                    assert await _greeted(client) == b"hello\r\n"
            assert sorted(p[1] for p in served) == sorted(c.getsockname()[1] for c in clients)
            nursery.cancel_scope.cancel()
    finally:
        logger.removeHandler(seen)
        for client in clients:
            client.close()


async def test_connections_are_admitted_in_the_order_they_were_made() -> None:
    listener = await _listener()
    port = listener.socket.getsockname()[1]
    admitted: list[int] = []
    clients = []
    for _ in range(6):  # all queued before the loop runs: it takes them in one burst
        sock = socket.create_connection(("127.0.0.1", port))
        clients.append(sock)
    done = trio.Event()

    async def handler(stream: trio.SocketStream, peer: Any, ticket: object) -> None:
        await stream.aclose()
        if len(admitted) == len(clients):
            done.set()

    def admit(peer: Any) -> int:
        admitted.append(peer[1])
        return len(admitted)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_loop, listener, admit, handler)
            with trio.fail_after(10):
                await done.wait()
            nursery.cancel_scope.cancel()
        assert admitted == [c.getsockname()[1] for c in clients]
    finally:
        for sock in clients:
            sock.close()


async def test_a_stream_its_handler_left_open_is_closed() -> None:
    listener = await _listener()
    port = listener.socket.getsockname()[1]
    returned = trio.Event()

    async def handler(stream: trio.SocketStream, peer: Any, ticket: object) -> None:
        await stream.send_all(b"bye\r\n")
        returned.set()  # and the stream is left open

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_loop, listener, lambda peer: None, handler)
        client = trio.socket.socket()
        try:
            await client.connect(("127.0.0.1", port))
            with trio.fail_after(10):
                await returned.wait()
                assert await _greeted(client) == b"bye\r\n"
                assert await client.recv(100) == b""  # closed by the loop, not left to linger
        finally:
            client.close()
        nursery.cancel_scope.cancel()
