"""Pieces for relay tests: a relay in this process, a scriptable next hop, and delivery events.

The next hop is a real SMTP server on 127.0.0.1 built on the project's own
server core, whose answers a test chooses per message; tests wait for what the
relay reports (``DeliveryWatch``) or for what the next hop received, never for
a fixed time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import attrs
import trio

from mta.app import Relay
from mta.config import Config, parse_config
from mta.smtp_common import Reply
from mta.smtp_server import (
    ConnectionClosed,
    DataAborted,
    DataChunk,
    EndOfData,
    MailFrom,
    NeedData,
    Quit,
    RcptTo,
    ServerConnection,
    StartTls,
)
from spool.record import Outcome, Status


def relay_config(tmp: str, routes: dict[str, str], extra: str = "", retry: str = '["1s", "2s"]') -> Config:
    lines = [f'"{k}" = "{v}"' for k, v in routes.items()]
    text = f"""
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
{extra}
[spool]
dir = "spool"
retry_intervals = {retry}
[routes]
""" + "\n".join(lines) + "\n"
    return parse_config(text, source=os.path.join(tmp, "test.toml"), base_dir=tmp)


async def start_relay(nursery: trio.Nursery, config: Config) -> Relay:
    relay: Relay = await nursery.start(Relay(config).run)
    return relay


class DeliveryWatch:
    """Collects outcomes as the scheduler reports them durable; tests await counts."""

    def __init__(self, relay: Relay) -> None:
        self.outcomes: list[tuple[str, Outcome]] = []
        self._changed = trio.Event()
        relay.scheduler.observers.append(self._observe)

    def _observe(self, qid: str, outcome: Outcome) -> None:
        self.outcomes.append((qid, outcome))
        self._changed.set()
        self._changed = trio.Event()

    def count(self, status: Status, recipient: str | None = None) -> int:
        return sum(1 for _, o in self.outcomes
                   if o.status is status and (recipient is None or o.recipient == recipient))

    async def wait_for(self, status: Status, n: int = 1, recipient: str | None = None,
                       timeout: float = 60) -> list[Outcome]:
        with trio.fail_after(timeout):
            while self.count(status, recipient) < n:
                await self._changed.wait()
        return [o for _, o in self.outcomes if o.status is status and (recipient is None or o.recipient == recipient)]


@attrs.define
class Received:
    sender: str
    recipients: list[str]
    data: bytes


Policy = Callable[[str, Any], Reply | None]


class NextHop:
    """A next-hop SMTP server whose replies the test scripts.

    ``policy(stage, value)`` is asked at "rcpt" (the address) and "data" (a
    Received with the message); it returns a Reply to refuse, or None to accept.
    """

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or (lambda stage, value: None)
        self.messages: list[Received] = []
        self.connections = 0
        self.port = 0
        self._changed = trio.Event()

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1"))
        self.port = int(listeners[0].socket.getsockname()[1])
        return self.port

    async def wait_messages(self, n: int, timeout: float = 60) -> list[Received]:
        with trio.fail_after(timeout):
            while len(self.messages) < n:
                await self._changed.wait()
        return self.messages

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = ServerConnection("nexthop.test")
        sender, rcpts, data = "", [], bytearray()
        try:
            while True:
                out = conn.data_to_send()
                if out:
                    await stream.send_all(out)
                ev = conn.next_event()
                if isinstance(ev, NeedData):
                    out = conn.data_to_send()
                    if out:
                        await stream.send_all(out)
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(ev, MailFrom):
                    sender, rcpts, data = ev.address, [], bytearray()
                    conn.accept()
                elif isinstance(ev, RcptTo):
                    refuse = self.policy("rcpt", ev.address)
                    if refuse is None:
                        rcpts.append(ev.address)
                        conn.accept()
                    else:
                        conn.reject(refuse)
                elif isinstance(ev, DataChunk):
                    data += ev.data
                elif isinstance(ev, EndOfData):
                    msg = Received(sender, rcpts, bytes(data))
                    refuse = self.policy("data", msg)
                    if refuse is None:
                        self.messages.append(msg)
                        self._changed.set()
                        self._changed = trio.Event()
                        conn.accept()
                    else:
                        conn.reject(refuse)
                elif isinstance(ev, StartTls):
                    conn.reject(Reply(454, "4.7.0", "no TLS here"))
                elif isinstance(ev, DataAborted):
                    data = bytearray()
                elif isinstance(ev, (Quit, ConnectionClosed)):
                    out = conn.data_to_send()
                    if out:
                        await stream.send_all(out)
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
