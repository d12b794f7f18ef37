"""Pieces the group-commit tests share: a relay config for real sessions, SMTP steps on a trio stream, a spool
with the inline commit path on (spool/aio/inline_commit.py), and lone enqueues to warm its timings up."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from spool_support import running_spool, spool_config

from spool.aio.async_spool import AsyncSpool
from spool.aio.inline_commit import INLINE_SYNC_FAST
from spool.fileio import FileIO

SERVER_TOML = """
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
[spool]
dir = "{dir}"
[routes]
"dest.test" = "discard"
"""


async def smtp(stream: trio.SocketStream, line: bytes, expect: bytes) -> None:
    """Send ``line`` and read the whole reply (its last line), which must start with ``expect``."""
    await stream.send_all(line)
    got = b""
    with trio.fail_after(30):
        while not got.endswith(b"\r\n") or got.split(b"\r\n")[-2][3:4] == b"-":
            data = await stream.receive_some(4096)
            assert data, f"connection closed waiting for {expect!r}"
            got += data
    assert got.startswith(expect), got


async def greeted(port: int, name: str = "client.test") -> trio.SocketStream:
    """A session on 127.0.0.1:``port`` past its greeting and EHLO."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await smtp(stream, b"", b"220")
    await smtp(stream, b"EHLO %s\r\n" % name.encode(), b"250")
    return stream


async def to_data(client: trio.SocketStream) -> None:
    """MAIL, RCPT and DATA of one message on a greeted session: the client is to send its data next."""
    for line, expect in ((b"MAIL FROM:<s@src.test>\r\n", b"250"), (b"RCPT TO:<r@dest.test>\r\n", b"250"),
                         (b"DATA\r\n", b"354")):
        await smtp(client, line, expect)


@asynccontextmanager
async def inline_spool(path: Path, io: FileIO, **overrides: Any) -> AsyncIterator[AsyncSpool]:
    """A spool over ``io`` with the inline path on (INLINE_SYNC_FAST), as a relay whose deliveries run in
    workers has it."""
    async with running_spool(path, spool_config(**overrides), io) as aspool:
        aspool.inline_sync(INLINE_SYNC_FAST)
        yield aspool


async def lone_enqueues(aspool: AsyncSpool, n: int, tag: str) -> None:
    """``n`` messages one after the other, each waiting for its commit (warms the inline path's timings up)."""
    for i in range(n):
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"%s %d" % (tag.encode(), i))
