"""Planned stops and reloads of the real relay process: SIGTERM drains, SIGHUP reloads, systemd is told.

The relay runs as ``mta serve`` (``process_support.RelayProcess``); the next
hop and the clients run in the test, over TCP on 127.0.0.1. Every wait is on
the relay's log lines, its exit, the next hop's messages or a datagram.
"""

from __future__ import annotations

import os
import re
import signal
import smtplib
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
import trio
from process_support import RelayProcess, mta, run_mta
from relay_support import GatedHop, write_relay_config

DRAIN_TIMEOUT = 20.0


def message(i: int) -> tuple[str, str]:
    return f"r{i}@far.example", f"Message-ID: <drain-{i}@test>\r\nSubject: drain {i}\r\n\r\nbody {i}\r\n"


def send_until_refused(port: int, first: int, count: int, accepted: list[str]) -> None:
    """Messages ``first..`` over one connection; each Message-ID the relay answered ``250`` to is recorded."""
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
            for i in range(first, first + count):
                rcpt, body = message(i)
                s.sendmail("sender@example.org", [rcpt], body)
                accepted.append(f"drain-{i}@test")
    except (smtplib.SMTPException, OSError):
        return


def lines_with(relay: RelayProcess, text: str) -> list[str]:
    return [line for line in relay.lines if text in line]


@pytest.mark.slow  # a real relay process, started and stopped
async def test_sigterm_drains_within_the_deadline_and_the_next_start_holds_nothing(tmp_path: Path) -> None:
    clients, per_client = 4, 40
    with trio.fail_after(170):
        async with trio.open_nursery() as nursery:
            hop = GatedHop()
            await hop.start(nursery)
            hop.accept_first = 8
            config = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                        extra=f'drain_timeout = "{DRAIN_TIMEOUT:g}s"')
            relay = RelayProcess(config)
            await relay.start(nursery)
            accepted: list[str] = []
            senders_done = trio.Semaphore(0)

            async def sender(k: int) -> None:
                await trio.to_thread.run_sync(send_until_refused, relay.port, k * per_client, per_client, accepted)
                senders_done.release()

            for k in range(clients):
                nursery.start_soon(sender, k)
            await hop.wait_until(lambda: len(hop.held) >= 2)  # deliveries in flight: the next hop holds its 250s
            assert relay.proc is not None
            pid = relay.proc.pid
            relay.proc.send_signal(signal.SIGTERM)
            await relay.wait_output(lambda: bool(lines_with(relay, "event=drain_start")), 30, "the drain's start")
            hop.gate.set()  # the deliveries in flight may finish now, inside the drain
            # The deadline is the relay's own (drain_end's seconds=, from its drain_start); the wall clock here
            # also counts a loaded machine's delays in the signal's delivery and the log lines' reading.
            with trio.fail_after(DRAIN_TIMEOUT + 60):
                await relay.proc.wait()
            assert relay.proc.returncode == 0, relay.lines
            end = lines_with(relay, "event=drain_end")
            assert len(end) == 1 and "deliveries_cut=0" in end[0] and "transactions_cut=0" in end[0], relay.lines
            drained = re.search(r"seconds=([0-9.]+)", end[0])
            assert drained is not None and float(drained.group(1)) < DRAIN_TIMEOUT, end[0]
            for _ in range(clients):
                await senders_done.acquire()
            assert accepted, "no message was accepted before the SIGTERM"

            # The next start on the same spool: nothing held in doubt, every 250 delivered once.
            hop.new_life(accept_first=10**6)
            relay.port = 0  # the next life's "listening" line, not the last one's
            await relay.start(nursery)
            assert relay.proc.pid != pid
            assert relay.in_doubt_logged() == set(), relay.lines
            await hop.wait_until(lambda: set(accepted) <= set(hop.ids()))
            counts = Counter(hop.ids())
            assert [mid for mid, n in counts.items() if n > 1] == []
            assert set(counts) <= {f"drain-{i}@test" for i in range(clients * per_client)}
            held = await mta(config, "queue", "list", "--held", "--json")
            assert b'"total": 0' in held.stdout or b'"total":0' in held.stdout, held.stdout
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # a real relay process, started and stopped
async def test_sigterm_lets_a_transaction_finish_and_refuses_the_next_with_421(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            config = write_relay_config(tmp_path, {"far.example": "discard"}, extra='drain_timeout = "60s"')
            relay = RelayProcess(config)
            await relay.start(nursery)
            assert relay.proc is not None
            client = smtplib.SMTP("127.0.0.1", relay.port, timeout=30)
            idle = smtplib.SMTP("127.0.0.1", relay.port, timeout=30)

            def begin() -> None:
                client.ehlo()
                assert client.mail("sender@example.org")[0] == 250
                assert client.rcpt("r@far.example")[0] == 250
                assert idle.ehlo()[0] == 250

            await trio.to_thread.run_sync(begin)
            relay.proc.send_signal(signal.SIGTERM)
            await relay.wait_output(lambda: bool(lines_with(relay, "event=drain_start")), 30, "the drain's start")
            assert "transactions=1" in lines_with(relay, "event=drain_start")[0]

            def greeting() -> bytes:
                with socket.create_connection(("127.0.0.1", relay.port), timeout=30) as s:
                    return s.recv(1000)

            assert (await trio.to_thread.run_sync(greeting)).startswith(b"421 4.3.2")
            assert (await trio.to_thread.run_sync(idle.noop))[0] == 421  # between transactions: ended at once

            def finish() -> tuple[int, int]:
                code = client.data(message(0)[1])[0]
                again = client.mail("sender@example.org")[0]
                return code, again

            assert await trio.to_thread.run_sync(finish) == (250, 421)
            with trio.fail_after(30):
                await relay.proc.wait()
            assert relay.proc.returncode == 0
            (end,) = lines_with(relay, "event=drain_end")
            assert "transactions_cut=0" in end, end
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # a real relay process, started and stopped
async def test_at_the_drain_deadline_a_delivery_still_running_ends_as_a_crash_does(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            hop = GatedHop()  # takes nothing at once: holds each 250 until the gate opens
            await hop.start(nursery)
            config = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                        extra='drain_timeout = "2s"')
            relay = RelayProcess(config)
            await relay.start(nursery)
            accepted: list[str] = []
            await trio.to_thread.run_sync(send_until_refused, relay.port, 0, 1, accepted)
            assert accepted == ["drain-0@test"]
            await hop.wait_until(lambda: len(hop.held) == 1)  # its final dot is written; no outcome yet
            assert relay.proc is not None
            signalled = time.monotonic()
            relay.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                await relay.proc.wait()
            assert time.monotonic() - signalled >= 2, "it waited for the deadline"
            assert relay.proc.returncode == 0
            (end,) = lines_with(relay, "event=drain_end")
            assert "deliveries_cut=1" in end and "WARNING" in end, end
            drained = re.search(r"seconds=([0-9.]+)", end)  # the relay's own clock, not a loaded machine's
            assert drained is not None and 2 <= float(drained.group(1)) < 2 + 5, end
            # As after a crash: the next start knows the attempt passed its final dot, and holds it in doubt.
            hop.new_life(accept_first=10**6)
            relay.port = 0  # the next life's "listening" line, not the last one's
            await relay.start(nursery)
            assert {rcpt for _qid, rcpt in relay.in_doubt_logged()} == {"r0@far.example"}, relay.lines
            nursery.cancel_scope.cancel()


def too_big(port: int, size: int) -> int:
    """The reply code to a message of ``size`` bytes (250 if taken)."""
    body = "Subject: big\r\n\r\n" + ("x" * 70 + "\r\n") * (size // 72 + 1)
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.sendmail("sender@example.org", ["r@far.example"], body)
    except smtplib.SMTPSenderRefused as exc:
        return exc.smtp_code
    except smtplib.SMTPDataError as exc:
        return exc.smtp_code
    return 250


@pytest.mark.slow  # a real relay process, started and stopped
async def test_sighup_applies_a_new_size_limit_in_the_same_process(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            routes = {"far.example": "discard"}
            config = write_relay_config(tmp_path, routes, extra="max_message_size = 100000")
            relay = RelayProcess(config)
            await relay.start(nursery)
            assert relay.proc is not None
            pid = relay.proc.pid
            assert await trio.to_thread.run_sync(too_big, relay.port, 20000) == 250
            write_relay_config(tmp_path, routes, extra="max_message_size = 10000")
            relay.proc.send_signal(signal.SIGHUP)
            await relay.wait_output(lambda: bool(lines_with(relay, "event=reload ")), 30, "the reload line")
            (line,) = lines_with(relay, "event=reload ")
            assert "server.max_message_size" in line and "needs_restart=nothing" in line, line
            assert relay.proc.returncode is None and relay.proc.pid == pid
            assert await trio.to_thread.run_sync(too_big, relay.port, 20000) == 552

            # ``mta reload`` is the same signal, found through the control socket; a restart-only key is named.
            write_relay_config(tmp_path, routes, extra="max_message_size = 10000\nprocesses = 2")
            done = await mta(config, "reload")
            assert done.returncode == 0, done.stderr
            assert str(pid).encode() in done.stdout
            await relay.wait_output(lambda: len(lines_with(relay, "event=reload ")) == 2, 30, "the second reload")
            assert "needs_restart=server.processes" in lines_with(relay, "event=reload ")[1]
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # a real relay process, started and stopped
async def test_sighup_with_an_invalid_config_keeps_serving_and_says_so_once(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            routes = {"far.example": "discard"}
            config = write_relay_config(tmp_path, routes, extra="max_message_size = 100000")
            relay = RelayProcess(config)
            await relay.start(nursery)
            assert relay.proc is not None
            config.write_text(config.read_text() + "\n[server]\nmax_message_size = -5\n")
            relay.proc.send_signal(signal.SIGHUP)
            await relay.wait_output(lambda: bool(lines_with(relay, "event=reload_failed")), 30, "reload_failed")
            assert len(lines_with(relay, "event=reload_failed")) == 1
            assert not lines_with(relay, "event=reload ")
            assert relay.proc.returncode is None
            assert await trio.to_thread.run_sync(too_big, relay.port, 20000) == 250  # the old limit still holds
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # a real relay process, started and stopped
async def test_systemd_is_told_ready_reloading_and_stopping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    name = f"logspool-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    with trio.fail_after(120), sock:
        async with trio.open_nursery() as nursery:
            config = write_relay_config(tmp_path, {"far.example": "discard"})
            relay = RelayProcess(config)
            await relay.start(nursery)
            assert relay.proc is not None
            ready = await sock.recv(4096)
            assert ready.split(b"\n") == [b"READY=1", f"MAINPID={relay.proc.pid}".encode()]
            assert relay.lines and any("listening on" in line for line in relay.lines)
            relay.proc.send_signal(signal.SIGHUP)
            assert (await sock.recv(4096)).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
            assert await sock.recv(4096) == b"READY=1"
            relay.proc.send_signal(signal.SIGTERM)
            assert await sock.recv(4096) == b"STOPPING=1"
            await relay.proc.wait()
            assert relay.proc.returncode == 0
            nursery.cancel_scope.cancel()


def test_mta_version_prints_the_package_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    done = run_mta("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"mta (logspool) {version('logspool')}"


def test_the_systemd_unit_waits_for_readiness_reloads_by_sighup_and_outlasts_the_drain() -> None:
    from mta.config import load_config
    from spool.config.units import parse_duration

    unit = Path(__file__).parents[2] / "contrib" / "systemd" / "logspool.service"
    settings = dict(line.split("=", 1) for line in unit.read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    assert settings["Type"] == "notify"
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert parse_duration(settings["TimeoutStopSec"] + "s") > load_config(None).server.drain_timeout
    for option in ("NoNewPrivileges", "PrivateTmp", "ProtectSystem", "ReadWritePaths"):
        assert option in settings


def tls_issuer(port: int, ca_pem: bytes) -> bool:
    """Whether STARTTLS on the relay verifies against ``ca_pem`` (the certificate a new session is shown)."""
    import ssl

    context = ssl.create_default_context(cadata=ca_pem.decode())
    context.check_hostname = False
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.starttls(context=context)
            return True
    except ssl.SSLError:
        return False


@pytest.mark.slow  # a real relay process, started and stopped
async def test_sighup_loads_a_renewed_certificate_for_new_sessions(tmp_path: Path) -> None:
    import trustme
    from relay_support import tls_files

    old_ca, new_ca = trustme.CA(), trustme.CA()
    tls_files(tmp_path, old_ca)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            config = write_relay_config(tmp_path, {"far.example": "discard"},
                                        extra='tls_cert = "cert.pem"\ntls_key = "key.pem"')
            relay = RelayProcess(config)
            await relay.start(nursery)
            assert relay.proc is not None
            assert await trio.to_thread.run_sync(tls_issuer, relay.port, old_ca.cert_pem.bytes())
            tls_files(tmp_path, new_ca)  # the renewal, in place (as certbot's deploy hook leaves it)
            relay.proc.send_signal(signal.SIGHUP)
            await relay.wait_output(lambda: bool(lines_with(relay, "event=reload ")), 30, "the reload line")
            assert "files_read_again=tls_cert" in lines_with(relay, "event=reload ")[0]
            assert await trio.to_thread.run_sync(tls_issuer, relay.port, new_ca.cert_pem.bytes())
            assert not await trio.to_thread.run_sync(tls_issuer, relay.port, old_ca.cert_pem.bytes())
            nursery.cancel_scope.cancel()


def test_a_reload_keeps_what_needs_a_restart_and_names_it(tmp_path: Path) -> None:
    from relay_support import relay_config

    from mta.process.reload import applicable, changes

    old = relay_config(str(tmp_path), {"far.example": "discard"}, extra="max_recipients = 10")
    new = relay_config(str(tmp_path), {"far.example": "smtp://127.0.0.1:2?tls=none"},
                       extra='max_recipients = 5\nprocesses = 2\ndrain_timeout = "3s"')
    live, later = changes(old, new)
    assert live == ["server.max_recipients", "routes"]
    assert later == ["server.processes", "server.drain_timeout"]
    applied = applicable(old, new)
    assert applied.server.max_recipients == 5 and dict(applied.routes) == dict(new.routes)
    assert applied.server.processes == 1 and applied.server.drain_timeout == old.server.drain_timeout
    assert applied.spool == old.spool


@pytest.mark.parametrize(("value", "problem"), [('"2h"', "at most 3600 s"), ('"-1s"', ""),
                                                ('"soon"', "")])
def test_drain_timeout_is_validated_like_every_duration(tmp_path: Path, value: str, problem: str) -> None:
    from mta.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"server\.drain_timeout") as raised:
        parse_config(f"[server]\ndrain_timeout = {value}\n", source=str(tmp_path / "x.toml"), base_dir=str(tmp_path))
    assert problem in str(raised.value)
    assert parse_config('[server]\ndrain_timeout = "45s"\n', source="x", base_dir=str(tmp_path)).server.drain_timeout \
        == 45.0


def rcpt_code(port: int) -> int:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail("a@example.org")
        return int(s.rcpt("b@far.example")[0])


@pytest.mark.slow  # a real relay process, started and stopped
async def test_sighup_applies_new_relay_domains_to_the_next_session(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            config = tmp_path / "relay.toml"
            text = write_relay_config(tmp_path, {"far.example": "discard"}).read_text()
            config.write_text(text.replace("[spool]", '[relay]\nmynetworks = ["10.9.9.0/24"]\n\n[spool]', 1))
            relay = RelayProcess(config)
            await relay.start(nursery)
            assert relay.proc is not None
            assert await trio.to_thread.run_sync(rcpt_code, relay.port) >= 500  # not ours to relay for
            config.write_text(text.replace(
                "[spool]", '[relay]\nmynetworks = ["10.9.9.0/24"]\nrelay_domains = ["far.example"]\n\n[spool]', 1))
            relay.proc.send_signal(signal.SIGHUP)
            await relay.wait_output(lambda: bool(lines_with(relay, "event=reload ")), 30, "the reload line")
            assert "relay.relay_domains" in lines_with(relay, "event=reload ")[0]
            assert await trio.to_thread.run_sync(rcpt_code, relay.port) == 250
            nursery.cancel_scope.cancel()
