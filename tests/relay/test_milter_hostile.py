"""A milter that breaks the protocol costs its session the failure default, never the relay.

The peers here are raw TCP servers on 127.0.0.1 that answer the relay's
negotiation with bytes that are not the milter protocol, or hang up in the
middle of a conversation: what a broken or hostile filter can send. The
relay's session gets ``milter_default_action`` and one ``filter_failed``
line; the next session is served as well.
"""

from __future__ import annotations

import functools
import logging
import struct
from pathlib import Path

import pytest
import trio
from milter_support import message, transaction
from relay_support import NextHop, relay_config, start_relay

GOOD_OPTNEG = b"\x00\x00\x00\x0dO" + struct.pack(">III", 6, 0x1FF, 0)


async def serve(answer: bytes, hang_up: bool, stream: trio.SocketStream) -> None:
    """Read the negotiation, send ``answer``; then hang up, or reply CONTINUE to everything but hold the end."""
    try:
        await stream.receive_some(65536)
        await stream.send_all(answer)
        if hang_up:
            await stream.aclose()
            return
        while await stream.receive_some(65536):
            await stream.send_all(b"\x00\x00\x00\x01Zjunk")
    except trio.BrokenResourceError:
        pass


@pytest.mark.parametrize(("answer", "hang_up", "reason"), [
    (b"\xff\xff\xff\xff" + b"x" * 64, False, "protocol"),  # a length far beyond any packet
    (b"\x00\x00\x00\x05Hello", False, "protocol"),  # not a negotiation reply
    (GOOD_OPTNEG, False, "protocol"),  # then a reply that does not exist
    (GOOD_OPTNEG, True, "gone"),  # then closed before its answer to CONNECT
])
async def test_a_milter_speaking_nonsense_gets_the_default_and_the_relay_serves_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, answer: bytes, hang_up: bool, reason: str) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, functools.partial(serve, answer, hang_up),
                                                          0, host="127.0.0.1"))
        milter_port = listeners[0].socket.getsockname()[1]
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"},
                           extra=f'\n[filters]\nsmtp_milters = ["inet:{milter_port}@127.0.0.1"]\n')
        relay = await start_relay(nursery, cfg)
        with caplog.at_level(logging.WARNING, logger="mta.milter"):
            for _ in range(2):
                got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], message("x"))
                assert got["mail"] == (451, b"4.7.1 Service unavailable - try again later")
        failures = [r.getMessage() for r in caplog.records if "event=filter_failed" in r.getMessage()]
        assert len(failures) == 2 and all(f"reason={reason}" in f for f in failures)
        assert hop.messages == []
        nursery.cancel_scope.cancel()
