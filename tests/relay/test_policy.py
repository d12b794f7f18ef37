"""Policy servers on the real relay: postgrey (Debian's, started by the test) greylisting a first attempt and
accepting the retry; a scripted server for the rest (down, hanging, broken, every stage and action).

The clients are smtplib from 127.0.0.5, outside ``mynetworks`` (127.0.0.1
only here), sending to a relay domain; a trusted client from 127.0.0.1 is
never asked (``skip_trusted``). Nothing waits a fixed time: a retry is
attempted until it is accepted, within a deadline.
"""

from __future__ import annotations

import email
import functools
import logging
import shutil
import smtplib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from relay_support import NextHop, relay_config, start_relay

from mta.config import Config

OUTSIDE = "127.0.0.5"  # a client outside mynetworks
BODY = b"From: a@example.org\r\nTo: bob@dest.test\r\nSubject: policy\r\n\r\nhello\r\n"
POSTGREY_DELAY = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def postgrey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Debian's postgrey on 127.0.0.1, its database in the test's directory, greylisting for 1 s; its port."""
    exe = shutil.which("postgrey") or "/usr/sbin/postgrey"
    where = tmp_path_factory.mktemp("postgrey")
    port = free_port()
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    group = subprocess.run(["id", "-gn"], capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.Popen(
        [exe, f"--inet=127.0.0.1:{port}", f"--dbdir={where}", f"--delay={POSTGREY_DELAY}",
         f"--pidfile={where}/postgrey.pid", f"--user={user}", f"--group={group}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(where / "postgrey.log", "wb"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 30
        while True:  # until it listens (a condition with a deadline)
            assert proc.poll() is None, (where / "postgrey.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "postgrey did not listen within 30 s"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def policy_config(tmp: Path, hop: int, policy: str) -> Config:
    extra = f'\n[relay]\nmynetworks = ["127.0.0.1/32"]\nrelay_domains = ["dest.test"]\n[policy]\n{policy}\n'
    return relay_config(str(tmp), {"dest.test": f"smtp://127.0.0.1:{hop}"}, extra=extra)


def _attempt(port: int, sender: str, rcpts: list[str], source: str, body: bytes) -> list[tuple[int, str]]:
    """One transaction: the reply to each RCPT, then (if one was accepted) to the end of data."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30, source_address=(source, 0)) as s:
        s.ehlo("client.example")
        code, _ = s.mail(sender)
        assert code == 250
        got = [(code, text.decode()) for code, text in (s.rcpt(r) for r in rcpts)]
        if any(code == 250 for code, _ in got):
            code, text = s.data(body)  # the reply to the final dot (smtplib raises only for DATA's own)
            got.append((250, "data") if code == 250 else (code, text.decode()))
        return got


async def attempt(port: int, sender: str, rcpts: list[str], source: str = OUTSIDE,
                  body: bytes = BODY) -> list[tuple[int, str]]:
    return await trio.to_thread.run_sync(_attempt, port, sender, rcpts, source, body)


async def test_postgrey_defers_the_first_attempt_and_accepts_the_retry(tmp_path: Path, postgrey: int) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, policy_config(tmp_path, port, f'servers = ["inet:127.0.0.1:{postgrey}"]'))
        (first,) = await attempt(relay.ports[0], "grey@example.org", ["bob@dest.test"])
        assert first[0] == 450
        assert first[1].startswith("4.2.0 Greylisted, see http://postgrey.schweikert.ch/help/dest.test.html")
        with trio.fail_after(30):  # retried until postgrey's delay has passed
            while (again := await attempt(relay.ports[0], "grey@example.org", ["bob@dest.test"]))[0][0] == 450:
                await trio.sleep(0.2)
        assert [code for code, _ in again] == [250, 250]
        (got,) = await hop.wait_messages(1)
        fields = email.message_from_bytes(got.data).items()
        assert fields[0][0] == "Received" and fields[0][1].startswith("from client.example")
        assert fields[1][0] == "X-Greylist" and fields[1][1].startswith("delayed ")  # postgrey's PREPEND
        assert "by postgrey" in fields[1][1]
        assert got.data.endswith(BODY)
        # A client in mynetworks is not asked: accepted the first time.
        trusted = await attempt(relay.ports[0], "fresh@example.org", ["bob@dest.test"], source="127.0.0.1")
        assert [code for code, _ in trusted] == [250, 250]
        nursery.cancel_scope.cancel()


Answer = Callable[[dict[str, str]], str | None]  # the action for a request; None: never answer


class ScriptedPolicy:
    """A policy server in the test: records every request and its connection, answers as ``answer`` says."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[dict[str, str]] = []
        self.connections = 0
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._serve, 0, host="127.0.0.1"))
        self.port = int(listeners[0].socket.getsockname()[1])
        return self.port

    async def start_unix(self, nursery: trio.Nursery, path: Path) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(str(path))
        sock.listen()
        await nursery.start(trio.serve_listeners, self._serve, [trio.SocketListener(sock)])

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buf = b""
        while True:
            data = await stream.receive_some(4096)
            if not data:
                return
            buf += data
            while b"\n\n" in buf:
                request, buf = buf.split(b"\n\n", 1)
                attrs = dict(line.split("=", 1) for line in request.decode().split("\n"))
                self.requests.append(attrs)
                action = self.answer(attrs)
                if action is None:
                    await trio.sleep_forever()
                await stream.send_all(f"action={action}\n\n".encode())


async def test_a_server_that_is_down_costs_its_session_the_failure_default(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        down = free_port()
        relay = await start_relay(nursery, policy_config(tmp_path, port, f'servers = ["inet:127.0.0.1:{down}"]'))
        got = await attempt(relay.ports[0], "a@example.org", ["bob@dest.test"])
        assert got == [(451, "4.3.5 Policy service unavailable, try again later")]
        (line,) = [r.getMessage() for r in caplog.records if "event=policy_failed" in r.getMessage()]
        assert f"server=inet:127.0.0.1:{down}" in line and "default=tempfail" in line
        nursery.cancel_scope.cancel()


async def test_a_hanging_server_times_out_while_other_sessions_go_on(tmp_path: Path) -> None:
    """One session waits for a server that never answers; another (not asked) is served meanwhile; the first
    gets the failure default after ``timeout``; with ``on_failure = "dunno"`` the next server decides."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        hang = ScriptedPolicy(lambda r: None)
        await hang.start(nursery)
        relay = await start_relay(nursery, policy_config(
            tmp_path, port, f'servers = ["inet:127.0.0.1:{hang.port}"]\ntimeout = "1s"'))
        done: list[list[tuple[int, str]]] = []

        async def stuck() -> None:
            done.append(await attempt(relay.ports[0], "slow@example.org", ["bob@dest.test"]))

        started = trio.current_time()
        nursery.start_soon(stuck)
        with trio.fail_after(30):
            while not hang.requests:  # the stuck session is waiting on the server
                await trio.sleep(0.01)
        quick = await attempt(relay.ports[0], "quick@example.org", ["bob@dest.test"], source="127.0.0.1")
        assert [code for code, _ in quick] == [250, 250] and not done
        with trio.fail_after(30):
            while not done:
                await trio.sleep(0.01)
        assert done == [[(451, "4.3.5 Policy service unavailable, try again later")]]
        assert trio.current_time() - started >= 1.0
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        hang = ScriptedPolicy(lambda r: None)
        reject = ScriptedPolicy(lambda r: "REJECT 5.7.1 second says no")
        servers = f'"inet:127.0.0.1:{await hang.start(nursery)}", "inet:127.0.0.1:{await reject.start(nursery)}"'
        (tmp_path / "dunno").mkdir()
        relay = await start_relay(nursery, policy_config(
            tmp_path / "dunno", port, f'servers = [{servers}]\ntimeout = "0.3s"\non_failure = "dunno"'))
        got = await attempt(relay.ports[0], "a@example.org", ["bob@dest.test"])
        assert got == [(554, "5.7.1 second says no")]
        nursery.cancel_scope.cancel()


async def test_servers_in_order_at_rcpt_and_end_of_data_over_one_connection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DUNNO asks the next; OK ends the asking; a rejection at END-OF-MESSAGE refuses the data; the attributes
    are Postfix's; one connection per server carries every request; an unsupported action is logged and
    costs the failure default."""
    caplog.set_level(logging.INFO)

    def first(r: dict[str, str]) -> str:
        rcpt = r["recipient"]
        if r["protocol_state"] == "END-OF-MESSAGE":
            return "REJECT 5.7.0 content refused" if r["sender"] == "spam@example.org" else "DUNNO"
        return {"ok@dest.test": "OK", "odd@dest.test": "FILTER smtp:[10.0.0.1]", "warn@dest.test": "WARN looked odd",
                "nobody@dest.test": "DEFER_IF_REJECT 4.7.1 wait"}.get(rcpt, "DUNNO")

    def second(r: dict[str, str]) -> str:
        return "550 5.1.1 no such user" if r["recipient"] == "nobody@dest.test" else "DUNNO"

    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        one, two = ScriptedPolicy(first), ScriptedPolicy(second)
        servers = f'"inet:127.0.0.1:{await one.start(nursery)}", "inet:127.0.0.1:{await two.start(nursery)}"'
        relay = await start_relay(nursery, policy_config(
            tmp_path, port, f'servers = [{servers}]\nstages = ["rcpt", "data"]'))
        got = await attempt(relay.ports[0], "a@example.org",
                            ["ok@dest.test", "nobody@dest.test", "odd@dest.test", "warn@dest.test"])
        assert got == [(250, "2.1.5 Ok"), (450, "4.7.1 wait"),  # DEFER_IF_REJECT turned the 550 into its deferral
                       (451, "4.3.5 Policy service unavailable, try again later"), (250, "2.1.5 Ok"),
                       (250, "data")]
        assert [r["recipient"] for r in two.requests] == ["nobody@dest.test", "warn@dest.test", ""]
        eom = [r for r in one.requests if r["protocol_state"] == "END-OF-MESSAGE"]
        assert len(eom) == 1 and eom[0]["recipient_count"] == "2" and eom[0]["recipient"] == ""
        assert eom[0]["queue_id"] and int(eom[0]["size"]) > len(BODY)
        rcpt = one.requests[0]
        assert rcpt["request"] == "smtpd_access_policy" and rcpt["protocol_state"] == "RCPT"
        assert rcpt["protocol_name"] == "ESMTP" and rcpt["helo_name"] == "client.example"
        assert rcpt["client_address"] == OUTSIDE and rcpt["sender"] == "a@example.org"
        assert rcpt["recipient_count"] == "0" and rcpt["instance"] == eom[0]["instance"]
        refused = await attempt(relay.ports[0], "spam@example.org", ["ok@dest.test"])
        assert refused == [(250, "2.1.5 Ok"), (554, "5.7.0 content refused")]
        assert len({r["instance"] for r in one.requests}) == 2  # one per transaction
        assert (one.connections, two.connections) == (1, 1)  # kept between requests, and between sessions
        messages = [r.getMessage() for r in caplog.records]
        assert any("event=policy_unsupported" in m and 'action="FILTER smtp:[10.0.0.1]"' in m for m in messages)
        assert any("event=policy_warn" in m and 'text="looked odd"' in m for m in messages)
        await hop.wait_messages(1)
        nursery.cancel_scope.cancel()



async def test_a_server_on_a_unix_socket(tmp_path: Path) -> None:
    """``unix:policy.sock`` resolves against the config file's directory, as every path in it."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        server = ScriptedPolicy(lambda r: "REJECT 5.7.1 not from " + r["client_address"])
        await server.start_unix(nursery, tmp_path / "policy.sock")
        relay = await start_relay(nursery, policy_config(tmp_path, port, 'servers = ["unix:policy.sock"]'))
        got = await attempt(relay.ports[0], "a@example.org", ["bob@dest.test"])
        assert got == [(554, "5.7.1 not from 127.0.0.5")]
        nursery.cancel_scope.cancel()
