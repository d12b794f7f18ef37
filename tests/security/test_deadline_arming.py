"""The client's command deadline is armed lazily (``mta.inbound.session._Session._arm``): never early, at most
the slack late, however many commands moved it on.

A real SmtpServer over TCP on the autojump clock: no message is sent, so no commit runs in a worker thread
and virtual time moves only when everything waits; the client's pauses between commands are the clock's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from spool_support import running_spool, spool_config

from mta.config import parse_config
from mta.inbound.server import SmtpServer
from mta.inbound.session import DEADLINE_SLACK
from mta.observe.metrics import Metrics

SERVER_TOML = """
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
command_timeout = "{timeout}"
[spool]
dir = "{dir}"
[routes]
"dest.test" = "discard"
"""


async def reply(stream: trio.SocketStream) -> bytes:
    got = b""
    while not got.endswith(b"\r\n") or got.split(b"\r\n")[-2][3:4] == b"-":
        data = await stream.receive_some(4096)
        if not data:
            break
        got += data
    return got


@pytest.mark.parametrize(("timeout", "gap"), [(1.0, 0.003), (1.0, 0.2), (300.0, 0.05), (300.0, 7.0)])
async def test_a_silent_client_is_cut_at_its_deadline_not_before_and_at_most_the_slack_after(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, timeout: float, gap: float) -> None:
    cfg = parse_config(SERVER_TOML.format(dir=tmp_path / "spool", timeout=f"{timeout}s"), base_dir=str(tmp_path))
    slack = min(DEADLINE_SLACK, timeout / 100)
    async with running_spool(tmp_path / "spool", spool_config()) as aspool:
        server = SmtpServer(cfg, aspool, Metrics())
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            port = listeners[0].socket.getsockname()[1]
            client = await trio.open_tcp_stream("127.0.0.1", port)
            assert (await reply(client)).startswith(b"220")
            await client.send_all(b"EHLO client.test\r\n")
            assert (await reply(client)).startswith(b"250")
            for _ in range(12):  # each command moves the deadline on by the gap
                await trio.sleep(gap)
                await client.send_all(b"NOOP\r\n")
                assert (await reply(client)).startswith(b"250")
            last = trio.current_time()  # the server waits for the next command from here
            got = await reply(client)
            cut = trio.current_time() - last
            assert got.startswith(b"421 4.4.2"), got
            assert timeout <= cut <= timeout + slack + 1e-6, (cut, timeout, slack)
            nursery.cancel_scope.cancel()
