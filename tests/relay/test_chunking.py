"""CHUNKING (RFC 3030) at the relay's SMTP port: BDAT pipelined, its limits, and a cut that queues nothing.

A real relay in this process, clients on raw sockets (they send exactly the
bytes each test gives), the project's ``NextHop`` as the next hop: what it
receives is what was queued. Exim sending BDAT is in ``test_exim_bdat.py``,
the relay sending BDAT to Postfix in ``test_bdat_postfix.py``.
"""

from __future__ import annotations

from pathlib import Path

import trio
from relay_support import DeliveryWatch, NextHop, RawClient, relay_config, start_relay

from spool.format.record import Status

ENVELOPE = b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@far.example>\r\n"


async def session(port: int) -> RawClient:
    client = await RawClient.connect(port)
    assert await client.code() == 220
    ehlo = await client.command(b"EHLO client.test")
    assert b"250-CHUNKING" in ehlo or b"250 CHUNKING" in ehlo
    return client


async def good_message(port: int, token: bytes) -> None:
    client = await session(port)
    body = b"Subject: " + token + b"\r\n\r\n" + token + b"\r\n"
    await client.send(ENVELOPE + b"BDAT %d LAST\r\n" % len(body) + body)
    assert [await client.code() for _ in range(3)] == [250, 250, 250]
    await client.aclose()


async def test_pipelined_chunks_are_one_message_and_250_comes_after_the_last(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            port = await hop.start(nursery)
            relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))
            client = await session(relay.ports[0])
            first, second = b"Subject: chunks\r\n\r\nline one\r\n.\r\n", b"..line two\r\nno end"
            await client.send(ENVELOPE + b"BDAT %d\r\n" % len(first) + first
                              + b"BDAT %d LAST\r\n" % len(second) + second + b"QUIT\r\n")
            replies = [await client.reply() for _ in range(5)]
            (got,) = await hop.wait_messages(1)
            nursery.cancel_scope.cancel()
    assert [r[0][:3] for r in replies] == [b"250", b"250", b"250", b"250", b"221"]
    assert replies[2] == [b"250 2.0.0 %d octets received" % len(first)]
    assert replies[3][0].startswith(b"250 2.0.0 Ok: queued as ")
    # Chunk content is sent as it is: the dot lines are content, and the message gets its last CRLF.
    assert got.data.endswith(b"\r\n\r\nline one\r\n.\r\n..line two\r\nno end\r\n")


async def test_bare_lf_too_big_and_a_cut_chunk_queue_nothing(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}, extra="max_message_size = 2000")
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            smtp = relay.ports[0]

            client = await session(smtp)
            bare = b"Subject: bare\r\n\r\nsmuggled\n.\nMAIL FROM:<x@example.org>\n"
            await client.send(ENVELOPE + b"BDAT %d LAST\r\n" % len(bare) + bare + b"NOOP\r\n")
            assert [(await client.reply())[0][:10] for _ in range(4)] == [
                b"250 2.1.0 ", b"250 2.1.5 ", b"550 5.6.11", b"250 2.0.0 "]

            big = (b"x" * 98 + b"\r\n") * 15
            await client.send(ENVELOPE + b"BDAT %d\r\n" % len(big) + big + b"BDAT %d LAST\r\n" % len(big) + big
                              + b"NOOP\r\n")
            assert [(await client.reply())[0][:10] for _ in range(5)] == [
                b"250 2.1.0 ", b"250 2.1.5 ", b"250 2.0.0 ", b"552 5.3.4 ", b"250 2.0.0 "]
            await client.aclose()

            cut = await session(smtp)
            await cut.send(ENVELOPE + b"BDAT 500 LAST\r\nSubject: cut\r\n\r\nhalf a chunk")
            assert [await cut.code() for _ in range(2)] == [250, 250]
            await cut.aclose()

            await good_message(smtp, b"the-only-one")
            await watch.wait_for(Status.DELIVERED, 1)
            (got,) = await hop.wait_messages(1)
            nursery.cancel_scope.cancel()
    assert b"the-only-one" in got.data
    assert watch.count(Status.DELIVERED) == 1 and len(hop.messages) == 1
