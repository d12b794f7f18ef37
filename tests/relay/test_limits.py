"""Rate limits on the real relay: a client over its message limit refused at MAIL, the session that keeps going
closed with 421, and one limit counted across two relay processes (``mta serve`` with ``processes = 2``)."""

from __future__ import annotations

import re
import smtplib
import subprocess
from pathlib import Path

import pytest
import trio
import trustme
from process_support import ServeProcess
from relay_support import NextHop, RawClient, relay_config, start_relay, tls_files, write_relay_config

from mta.auth.users import add_user
from mta.config import Config, load_config, parse_config
from mta.inbound.session import Port
from mta.limits.limiter import RateLimits
from mta.process.reload import reload
from mta.shards import parse_queue_id

OUTSIDE = "127.0.0.5"
PASSWORD = "correct horse battery staple"
QUEUED_AS = re.compile(r"queued as (\S+)")
SHARD_UP = re.compile(r"listening on 127\.0\.0\.1:(\d+), spool \S+, shard (\d+) \(pid (\d+)\)")
START_TIMEOUT = 180  # a loaded two-core machine takes a while to start two Python relays
LIMITS = '\n[relay]\nmynetworks = ["127.0.0.1/32"]\nrelay_domains = ["dest.test"]\n[limits]\n'


class Supervised(ServeProcess):
    """``mta serve`` with two processes; ``pids`` once both listen (their "listening ... shard K (pid P)")."""

    port = 0

    def pids(self) -> dict[int, int]:
        up = {}
        for line in self.lines:
            if m := SHARD_UP.search(line):
                self.port = int(m.group(1))
                up[int(m.group(2))] = int(m.group(3))
        return up

    async def start(self, nursery: trio.Nursery) -> dict[int, int]:
        await self.launch(nursery)
        await self.wait_output(lambda: len(self.pids()) == 2, START_TIMEOUT, "both shards listening")
        return self.pids()


def limits_config(tmp: Path, hop: int, limits: str) -> Config:
    return relay_config(str(tmp), {"dest.test": f"smtp://127.0.0.1:{hop}"}, extra=LIMITS + limits)


def _send(port: int, source: str, sender: str = "a@example.org") -> tuple[int, str]:
    """One message on a connection of its own: the reply to MAIL if refused, else to the end of data."""
    with smtplib.SMTP("127.0.0.1", port, timeout=60, source_address=(source, 0)) as s:
        s.ehlo("client.example")
        code, text = s.mail(sender)
        if code != 250:
            return code, text.decode()
        assert s.rcpt("bob@dest.test")[0] == 250
        code, text = s.data(b"Subject: limits\r\n\r\nhello\r\n")
        return code, text.decode()


async def send(port: int, source: str = OUTSIDE, sender: str = "a@example.org") -> tuple[int, str]:
    return await trio.to_thread.run_sync(_send, port, source, sender)


async def test_a_client_over_its_message_rate_is_refused_at_mail(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, limits_config(tmp_path, port, 'client_messages = "3/1h"'))
        got = [await send(relay.ports[0]) for _ in range(4)]
        assert [code for code, _ in got] == [250, 250, 250, 450]
        assert got[3][1] == "4.7.1 Error: too much mail from 127.0.0.5, try again later"
        assert (await send(relay.ports[0], "127.0.0.6"))[0] == 250  # another client has its own count
        assert (await send(relay.ports[0], "127.0.0.1"))[0] == 250  # mynetworks is exempt
        assert (await send(relay.ports[0]))[0] == 450  # still over
        await hop.wait_messages(5)
        nursery.cancel_scope.cancel()


async def test_a_session_that_keeps_going_over_its_limit_gets_421_and_is_closed(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, limits_config(
            tmp_path, port, 'client_recipients = "2/1h"\nrefusals_before_close = 2'))
        client = await RawClient.connect(relay.ports[0], source=OUTSIDE)
        assert await client.code() == 220
        assert (await client.command(b"EHLO client.example"))[0].startswith(b"250")
        assert (await client.command(b"MAIL FROM:<a@example.org>"))[0][:3] == b"250"
        # Pipelined: the 421 is the last reply; nothing after it is answered.
        await client.send(b"RCPT TO:<r1@dest.test>\r\nRCPT TO:<r2@dest.test>\r\nRCPT TO:<r3@dest.test>\r\n"
                          b"RCPT TO:<r4@dest.test>\r\nRCPT TO:<r5@dest.test>\r\n")
        rest = await client.closed()
        assert rest == (b"250 2.1.5 Ok\r\n250 2.1.5 Ok\r\n"
                        b"450 4.7.1 Error: too many recipients from 127.0.0.5, try again later\r\n"
                        b"421 4.7.0 Error: too many requests over the rate limits, closing connection\r\n")
        nursery.cancel_scope.cancel()


def test_who_is_counted_on_what(tmp_path: Path) -> None:
    """Users by name whatever their address, senders without regard to case, the null sender never, and
    mynetworks not at all while exempt."""
    config = parse_config(f'[limits]\nclient_messages = "1/1h"\nuser_messages = "2/1h"\nsender_messages = "3/1h"\n'
                          f'table = "{tmp_path}/t"\n')
    limits = RateLimits(config.limits)
    assert limits.at_mail("192.0.2.1", False, "alice", "x@example.org") is None
    assert limits.at_mail("192.0.2.2", False, "alice", "y@example.org") is None
    over = limits.at_mail("192.0.2.3", False, "alice", "z@example.org")
    assert over is not None and over.limit == "user_messages" and "this user" in over.reply.text
    assert limits.at_mail("198.51.100.1", False, None, "X@Example.org") is None
    assert limits.at_mail("198.51.100.2", False, None, "x@example.org") is None
    over = limits.at_mail("198.51.100.3", False, None, "x@EXAMPLE.org")
    assert over is not None and over.limit == "sender_messages"
    over = limits.at_mail("198.51.100.1", False, None, "")
    assert over is not None and over.limit == "client_messages"  # the null sender: only the client counts
    for _ in range(5):
        assert limits.at_mail("127.0.0.1", True, None, "x@example.org") is None  # exempt


@pytest.mark.slow
async def test_two_processes_count_one_limit(tmp_path: Path) -> None:
    """A client limited to 12 messages an hour, its connections spread by the kernel over two processes:
    exactly 12 are accepted in all, by both processes, and both refuse the ones after."""
    limit, after = 12, 16
    with trio.fail_after(START_TIMEOUT + 120):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            hop_port = await hop.start(nursery)
            config = write_relay_config(tmp_path, {"dest.test": f"smtp://127.0.0.1:{hop_port}"},
                                        extra=f"processes = 2\n{LIMITS}client_messages = \"{limit}/1h\"\n")
            relay = Supervised(config)
            pids = await relay.start(nursery)
            got = [await send(relay.port) for _ in range(limit + after)]
            assert [code for code, _ in got] == [250] * limit + [450] * after
            shards = {parse_queue_id(m.group(1))[0] for _, text in got[:limit] if (m := QUEUED_AS.search(text))}
            assert shards == {0, 1}
            refusing = {int(m.group(1)) for line in relay.lines
                        if "event=reject" in line and "reason=client_messages" in line
                        and (m := re.search(r"\[(\d+)\]", line))}
            assert refusing == set(pids.values())
            await hop.wait_messages(limit)
            nursery.cancel_scope.cancel()


async def test_a_reload_changes_the_limits_of_the_next_sessions(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        path = write_relay_config(tmp_path, {"dest.test": f"smtp://127.0.0.1:{port}"},
                                  extra=LIMITS + 'client_messages = "1/1h"\n')
        relay = await start_relay(nursery, load_config(path))
        assert [(await send(relay.ports[0]))[0] for _ in range(2)] == [250, 450]
        path.write_text(path.read_text().replace('"1/1h"', '"3/1h"'))
        assert reload(relay)
        assert [(await send(relay.ports[0]))[0] for _ in range(3)] == [250, 250, 450]
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def users_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One user, alice (made once: an Argon2 hash takes a third of a second)."""
    path = tmp_path_factory.mktemp("users") / "users"
    add_user(str(path), "alice", PASSWORD)
    return path


def _swaks(port: int, source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["swaks", "--server", f"127.0.0.1:{port}", "--local-interface", source, "--from", "alice@example.org",
         "--to", "bob@dest.test", "--tls", "--auth", "PLAIN", "--auth-user", "alice", "--auth-password", PASSWORD,
         "--timeout", "30"], capture_output=True, text=True, timeout=60, check=False)


async def test_an_authenticated_user_is_counted_as_the_user_from_any_address(
        tmp_path: Path, ca: trustme.CA, users_file: Path) -> None:
    """swaks over STARTTLS and AUTH on the submission port: the user's limit holds across client addresses, and
    the client limit (1 here) does not apply to an authenticated session."""
    cert, key = tls_files(tmp_path, ca)
    tls = f'tls_cert = "{cert}"\ntls_key = "{key}"\n'  # in [server]
    submission = f'[submission]\nlisten = ["127.0.0.1:0"]\nusers_file = "{users_file}"\n'
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        config = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{port}"},
                              extra=tls + LIMITS.replace("[limits]\n", "") + submission
                              + '[limits]\nclient_messages = "1/1h"\nuser_messages = "2/1h"\n')
        relay = await start_relay(nursery, config)
        sub = relay.ports_of(Port.SUBMISSION)[0]
        runs = [await trio.to_thread.run_sync(_swaks, sub, source) for source in ("127.0.0.5", "127.0.0.5",
                                                                                  "127.0.0.6")]
        assert "250 2.0.0 Ok: queued as" in runs[0].stdout and "250 2.0.0 Ok: queued as" in runs[1].stdout
        assert "<~* 450 4.7.1 Error: too much mail from this user, try again later" in runs[2].stdout, runs[2].stdout
        assert (await send(relay.ports[0]))[0] == 250  # unauthenticated from 127.0.0.5: its own client count
        assert (await send(relay.ports[0]))[0] == 450
        nursery.cancel_scope.cancel()


async def test_a_client_over_its_connection_rate_gets_421_before_the_greeting(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, limits_config(tmp_path, port, 'client_connections = "2/1h"'))
        for _ in range(2):
            client = await RawClient.connect(relay.ports[0], source=OUTSIDE)
            assert await client.code() == 220
            await client.aclose()
        refused = await RawClient.connect(relay.ports[0], source=OUTSIDE)
        assert await refused.closed() == b"421 4.7.0 Error: too many connections from 127.0.0.5, try again later\r\n"
        for source in ("127.0.0.6", "127.0.0.1", "127.0.0.1", "127.0.0.1"):  # another client; mynetworks is exempt
            client = await RawClient.connect(relay.ports[0], source=source)
            assert await client.code() == 220
            await client.aclose()
        nursery.cancel_scope.cancel()
