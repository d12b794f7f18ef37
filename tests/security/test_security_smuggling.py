"""SMTP smuggling (CVE-2023-51764/5/6) end to end: raw socket in, the NextHop out (docs/security.md).

The payload hides a second transaction behind a fake end of data. Whatever
the relay does with it, the next hop must see one message or none, never two:
with the default config the message is refused (550 5.6.11); with
``normalize_bare_lf`` it is accepted and passed on as one message whose body
contains the would-be second one (dot-stuffed on the way out).
"""

from __future__ import annotations

import smtplib

import trio
from relay_support import DeliveryWatch, NextHop, RawClient, relay_config, start_relay

from spool.format.record import Status

ENDS = [b"\n.\n", b"\r.\r", b"\r\n.\n", b"\n.\r\n", b"\r.\r\n"]


def payload(end: bytes) -> bytes:
    return (b"Subject: first\r\n\r\nfirst body" + end
            + b"MAIL FROM:<evil@example.org>\r\nRCPT TO:<victim@far.example>\r\nDATA\r\n"
            + b"Subject: smuggled\r\n\r\nsmuggled body\r\n.\r\n")


async def smuggle(port: int, end: bytes) -> list[bytes]:
    c = await RawClient.connect(port)
    await c.reply()
    await c.command(b"EHLO smuggler.example")
    assert (await c.command(b"MAIL FROM:<a@example.org>"))[0].startswith(b"250")
    assert (await c.command(b"RCPT TO:<first@far.example>"))[0].startswith(b"250")
    assert (await c.command(b"DATA"))[0].startswith(b"354")
    await c.send(payload(end))
    answer = await c.reply()
    # Anything after it would be the reply to a smuggled command.
    await c.send(b"QUIT\r\n")
    rest = await c.closed()
    assert rest.startswith(b"221 ") and rest.count(b"\r\n") == 1, rest
    return answer


def _sentinel(port: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("a@example.org", ["sentinel@far.example"], "Subject: sentinel\r\n\r\nlast\r\n")


async def test_smuggled_message_is_refused_by_default(tmp_path: object) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))
        watch = DeliveryWatch(relay)
        for end in ENDS:
            answer = await smuggle(relay.ports[0], end)
            assert answer[0].startswith(b"550 5.6.11"), (end, answer)
        await trio.to_thread.run_sync(_sentinel, relay.ports[0])
        await watch.wait_for(Status.DELIVERED, 1)
        (msg,) = await hop.wait_messages(1)
        assert msg.recipients == ["sentinel@far.example"]
        assert [o.recipient for _, o in watch.outcomes] == ["sentinel@far.example"]
        nursery.cancel_scope.cancel()


async def test_smuggled_message_stays_inside_one_message_when_normalising(tmp_path: object) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}, extra="normalize_bare_lf = true\n")
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        for i, end in enumerate(ENDS, 1):
            answer = await smuggle(relay.ports[0], end)
            assert answer[0].startswith(b"250"), (end, answer)
            await watch.wait_for(Status.DELIVERED, i)
            msgs = await hop.wait_messages(i)
            assert len(msgs) == i and msgs[-1].recipients == ["first@far.example"], (end, msgs)
            # The would-be second message arrived as text inside the first, with CRLF line ends only.
            data = msgs[-1].data
            assert b"first body\r\n" in data and b"\r\nMAIL FROM:<evil@example.org>\r\n" in data, end
            assert b"smuggled body" in data
            assert b"\r" not in data.replace(b"\r\n", b"") and b"\n" not in data.replace(b"\r\n", b"")
        await trio.to_thread.run_sync(_sentinel, relay.ports[0])
        msgs = await hop.wait_messages(len(ENDS) + 1)
        assert [m.recipients for m in msgs] == [["first@far.example"]] * len(ENDS) + [["sentinel@far.example"]]
        nursery.cancel_scope.cancel()
