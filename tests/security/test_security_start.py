"""A start that cannot succeed is one line naming the setting, exit 2 (config) or 1 (the rest), no traceback.

Each case runs the real ``mta serve`` as a subprocess (docs/operations.md,
"Exit statuses"), and Ctrl-C is a real SIGINT to a relay that answers SMTP.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import smtplib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trustme
from process_support import MTA, run_mta
from relay_support import NextHop, start_relay, tls_files

from mta.config import ConfigError, parse_config
from mta.process.security import UnsafeFile, check_tls_key


def _readable(fd: int, timeout: float) -> bool:
    """Is ``fd`` readable within ``timeout``? epoll, not select(): the test process may hold descriptors past
    FD_SETSIZE (every in-process relay of the suite keeps its spool open, crash-only)."""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout))

def write(tmp_path: Path, server: str = "", rest: str = "") -> Path:
    path = tmp_path / "relay.toml"
    path.write_text(f'[server]\nhostname = "relay.test"\n{server}\n[spool]\ndir = "spool"\n{rest}\n')
    return path


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    return run_mta("serve", "--config", str(config), cwd=config.parent)


def refused(config: Path, code: int, pattern: str) -> str:
    """``mta serve`` exits ``code`` with exactly one line on stderr matching ``pattern``, and made no spool."""
    run = serve(config)
    assert run.returncode == code, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and run.stderr.endswith("\n"), run.stderr
    assert re.fullmatch(pattern, lines[0]), lines[0]
    assert not (config.parent / "spool").exists()
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# -- listening ------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path, taken_port: int, processes: int) -> None:
    config = write(tmp_path, f'listen = ["127.0.0.1:{taken_port}"]\nprocesses = {processes}')
    refused(config, 1, rf"mta: {re.escape(str(config))}: server\.listen\[0\]: cannot listen on "
                       rf"127\.0\.0\.1:{taken_port}: the address is in use \(another program listens there\)")


@pytest.mark.parametrize("processes", [1, 2])
def test_a_metrics_port_in_use_is_one_line_and_exit_1(tmp_path: Path, taken_port: int, processes: int) -> None:
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\nmetrics_listen = "127.0.0.1:{taken_port}"\n'
                             f'processes = {processes}')
    refused(config, 1, rf"mta: {re.escape(str(config))}: server\.metrics_listen: cannot listen on "
                       rf"127\.0\.0\.1:{taken_port}: the address is in use \(another program listens there\)")


@pytest.mark.parametrize("processes", [1, 2])
def test_an_address_this_host_does_not_have_is_one_line_and_exit_2(tmp_path: Path, processes: int) -> None:
    config = write(tmp_path, f'listen = ["127.0.0.1:0", "192.0.2.1:2525"]\nprocesses = {processes}')
    refused(config, 2, rf"mta: {re.escape(str(config))}: server\.listen\[1\]: cannot listen on 192\.0\.2\.1:2525: "
                       r"192\.0\.2\.1 is not an address of this host")


@pytest.mark.parametrize("processes", [1, 2])
def test_a_listen_host_that_does_not_resolve_is_one_line(tmp_path: Path, processes: int) -> None:
    """Exit 2 when the name does not exist; exit 1 when the resolver cannot say now (a restart may help)."""
    host = "no-such-host.invalid"
    config = write(tmp_path, f'listen = ["{host}:2525"]\nprocesses = {processes}')
    prefix = rf"mta: {re.escape(str(config))}: server\.listen\[0\]: cannot listen on {re.escape(host)}:2525: "
    try:
        socket.getaddrinfo(host, 2525)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:  # this machine's resolver is down: the other answer, just as checked
            refused(config, 1, prefix + rf"cannot resolve '{re.escape(host)}' now \(.*\)")
            return
        assert exc.errno == socket.EAI_NONAME, exc
    else:
        raise AssertionError(f"{host} resolves here")
    refused(config, 2, prefix + rf"host '{re.escape(host)}' does not resolve")


# -- TLS --------------------------------------------------------------------------------


def test_a_certificate_that_is_not_pem_is_one_line_and_exit_2(tmp_path: Path, ca: trustme.CA) -> None:
    _, key = tls_files(tmp_path, ca)
    (tmp_path / "cert.der").write_bytes(os.urandom(600))
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\ntls_cert = "cert.der"\ntls_key = "{key}"')
    refused(config, 2, rf"mta: {re.escape(str(config))}: server\.tls_cert: {re.escape(str(tmp_path))}/cert\.der "
                       r"is not a PEM certificate \(.+\)")
    # A PEM file with a broken body is caught too, by OpenSSL's own parser.
    (tmp_path / "cert.der").write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    refused(config, 2, r".*server\.tls_cert: .*/cert\.der is not a PEM certificate \(.+\)")


def test_a_key_that_does_not_match_its_certificate_is_one_line_and_exit_2(tmp_path: Path, ca: trustme.CA) -> None:
    cert, _ = tls_files(tmp_path, ca)
    ca.issue_cert("other.test").private_key_pem.write_to_path(str(tmp_path / "other.key"))
    os.chmod(tmp_path / "other.key", 0o600)
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\ntls_cert = "{cert}"\ntls_key = "other.key"')
    refused(config, 2, rf"mta: {re.escape(str(config))}: server\.tls_key: {re.escape(str(tmp_path))}/other\.key "
                       rf"does not match the certificate in {re.escape(str(cert))}")


def test_a_key_that_is_not_pem_or_is_encrypted_is_one_line_and_exit_2(tmp_path: Path, ca: trustme.CA) -> None:
    cert, key = tls_files(tmp_path, ca)
    key.write_bytes(os.urandom(300))
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\ntls_cert = "{cert}"\ntls_key = "{key}"')
    refused(config, 2, r".*: server\.tls_key: .*/key\.pem is not a PEM private key \(.+\)")
    from cryptography.hazmat.primitives import serialization

    pem = ca.issue_cert("relay.test")
    private = serialization.load_pem_private_key(pem.private_key_pem.bytes(), None)
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.BestAvailableEncryption(b"secret")))
    pem.cert_chain_pems[0].write_to_path(str(cert))
    refused(config, 2, r".*: server\.tls_key: .*/key\.pem is encrypted; the relay needs a key without a passphrase")


@pytest.mark.parametrize(("mode", "who"), [(0o644, "other users"), (0o604, "other users"),
                                           (0o640, "its group"), (0o620, r"its group \(it can change it\)")])
def test_a_tls_key_others_can_read_is_refused_in_one_line_exit_1(tmp_path: Path, ca: trustme.CA, mode: int,
                                                                 who: str) -> None:
    cert, key = tls_files(tmp_path, ca)
    key.chmod(mode)
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\ntls_cert = "{cert}"\ntls_key = "{key}"')
    refused(config, 1, rf"mta: {re.escape(str(config))}: server\.tls_key: {re.escape(str(key))} is open to {who} "
                       rf"\(mode 0{mode:o}\); chmod 600 it and consider the key exposed; refusing to start")
    assert key.stat().st_mode & 0o777 == mode  # not the relay's file to change


def test_a_group_readable_key_of_another_owner_is_the_distribution_convention(tmp_path: Path) -> None:
    """root:ssl-cert 0640 (Debian) is how a service is granted its key: accepted; others' access is not."""
    key = tmp_path / "key.pem"
    key.write_text("")
    me = os.geteuid()
    key.chmod(0o640)
    check_tls_key(str(key), owner=me + 1)  # owned by someone else (root, say): its group may read it
    with pytest.raises(UnsafeFile, match="open to its group"):
        check_tls_key(str(key), owner=me)
    key.chmod(0o644)
    with pytest.raises(UnsafeFile, match=r"open to other users \(mode 0644\); chmod o-rwx,g-w it"):
        check_tls_key(str(key), owner=me + 1)
    key.chmod(0o600)
    check_tls_key(str(key), owner=me)
    key.chmod(0o400)
    check_tls_key(str(key), owner=me)


# -- the control socket -------------------------------------------------------------------


def test_a_control_socket_path_too_long_for_unix_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / ("c" * (108 - len(str(tmp_path)) - 1))
    assert len(str(path)) == 108
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\ncontrol_socket = "{path}"')
    refused(config, 2, rf"mta: {re.escape(str(config))}: server\.control_socket: {re.escape(str(path))} is 108 "
                       r"bytes long; a Unix socket path holds at most 107")


def test_a_control_socket_path_too_long_for_one_shard_is_refused_before_any_child_starts(tmp_path: Path) -> None:
    """Shard 1's socket is the path plus '.1': 107 bytes fit shard 0, 109 do not fit shard 1."""
    path = tmp_path / ("c" * (107 - len(str(tmp_path)) - 1))
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\ncontrol_socket = "{path}"\nprocesses = 2')
    refused(config, 2, rf"mta: {re.escape(str(config))}: server\.control_socket: {re.escape(str(path))}\.1 is 109 "
                       r"bytes long; a Unix socket path holds at most 107")


def test_a_control_socket_in_a_missing_directory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write(tmp_path, 'listen = ["127.0.0.1:0"]\ncontrol_socket = "run/logspool/control.sock"')
    refused(config, 2, rf"mta: {re.escape(str(config))}: server\.control_socket: directory "
                       rf"{re.escape(str(tmp_path))}/run/logspool does not exist")


def test_a_control_socket_path_that_is_another_file_is_refused_not_deleted(tmp_path: Path) -> None:
    (tmp_path / "precious").write_text("keep me")
    config = write(tmp_path, 'listen = ["127.0.0.1:0"]\ncontrol_socket = "precious"')
    refused(config, 2, r".*: server\.control_socket: .*/precious exists and is not a socket")
    assert (tmp_path / "precious").read_text() == "keep me"


def test_a_control_socket_directory_others_can_write_is_refused_exit_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    config = write(tmp_path, 'listen = ["127.0.0.1:0"]\ncontrol_socket = "run/control.sock"')
    refused(config, 1, rf"mta: {re.escape(str(config))}: server\.control_socket: {re.escape(str(run_dir))} is "
                       r"writable by group or others \(mode 0777\); refusing to start")


# -- open relay -----------------------------------------------------------------------------


@pytest.mark.parametrize("networks", ['"0.0.0.0/0"', '"::/0"', '"0:0::0/0"', '"::ffff:0.0.0.0/96"',
                                      '"10.0.0.0/8", "0.0.0.0/1", "128.0.0.0/1"', '"::/1", "8000::/1"'])
def test_mynetworks_that_cover_every_address_are_refused_exit_2(tmp_path: Path, networks: str) -> None:
    config = write(tmp_path, 'listen = ["127.0.0.1:0"]', f"[relay]\nmynetworks = [{networks}]")
    refused(config, 2, rf"mta: {re.escape(str(config))}: relay\.mynetworks: covers every address, which makes an "
                       r"open relay \(anyone may send anywhere\); set \[relay\] allow_open_relay = true if that is "
                       r"really meant")


def test_mapped_ipv4_networks_mean_their_ipv4_network() -> None:
    config = parse_config('[relay]\nmynetworks = ["::ffff:10.0.0.0/104"]\n')
    assert config.in_mynetworks("10.1.2.3") and config.in_mynetworks("::ffff:10.1.2.3")
    assert not config.in_mynetworks("11.0.0.1")
    with pytest.raises(ConfigError, match="open relay"):
        parse_config('[relay]\nmynetworks = ["::ffff:0:0/96"]\n')
    assert not parse_config('[relay]\nmynetworks = ["0.0.0.0/1", "::/1"]\n').relay.open_to_all()


async def test_allow_open_relay_lets_anyone_relay_as_the_operator_asked(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        text = (f'[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\n[spool]\ndir = "spool"\n'
                f'[relay]\nmynetworks = ["0.0.0.0/0"]\nallow_open_relay = true\n'
                f'[routes]\n"*" = "smtp://127.0.0.1:{port}?tls=none"\n')
        relay = await start_relay(nursery, parse_config(text, str(tmp_path / "r.toml"), str(tmp_path)))
        assert any("open relay" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)

        def send() -> None:  # from 127.0.0.9: outside the default mynetworks only by config, inside 0.0.0.0/0
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30, source_address=("127.0.0.9", 0)) as s:
                s.sendmail("a@example.org", ["b@far.example"], "Subject: open\r\n\r\nopen\r\n")

        await trio.to_thread.run_sync(send)
        (msg,) = await hop.wait_messages(1)
        assert msg.recipients == ["b@far.example"]
        nursery.cancel_scope.cancel()


# -- Ctrl-C -------------------------------------------------------------------------------------


class Lines:
    """A process's stderr read as lines, waiting with select (bounded), never with a sleep."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        self.fd = proc.stderr.fileno()
        self.buf = b""
        self.seen: list[str] = []

    def _next(self) -> str:
        while b"\n" not in self.buf:
            assert _readable(self.fd, 60), f"no output for 60 s; so far: {self.seen}"
            chunk = os.read(self.fd, 65536)
            assert chunk, f"stderr closed; so far: {self.seen}"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        self.seen.append(line.decode("utf-8", "replace"))
        assert "Traceback" not in self.seen[-1], self.seen
        return self.seen[-1]

    def until(self, pattern: str, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` lines so far or to come that match, in order."""
        found = [m for line in self.seen if (m := re.search(pattern, line))]
        while len(found) < count:
            if m := re.search(pattern, self._next()):
                found.append(m)
        return found[:count]


def _answers_220(port: int) -> None:
    with smtplib.SMTP(timeout=30) as s:
        assert s.connect("127.0.0.1", port)[0] == 220


def _wait_gone(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert _readable(fd, 30), f"pid {pid} still runs"
    finally:
        os.close(fd)


@pytest.mark.parametrize("processes", [1, 2])
def test_ctrl_c_ends_mta_serve_at_once_in_one_line_exit_130(tmp_path: Path, processes: int) -> None:
    """SIGINT once the relay answers SMTP: one line, exit 130 (the shell's code for Ctrl-C), no traceback."""
    config = write(tmp_path, f'listen = ["127.0.0.1:0"]\nprocesses = {processes}')
    proc = subprocess.Popen([MTA, "serve", "--config", str(config)], cwd=str(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        lines = Lines(proc)
        children: list[int] = []
        if processes == 2:
            children = [int(m.group(1)) for m in lines.until(r"shard \d started \(pid (\d+)\)", 2)]
        ready = lines.until(r"listening on 127\.0\.0\.1:(\d+),", processes)[-1]
        _answers_220(int(ready.group(1)))
        proc.send_signal(signal.SIGINT)
        assert proc.stderr is not None
        rest = proc.stderr.read().decode("utf-8", "replace")
        assert proc.wait(timeout=30) == 130
        assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
        assert [ln for ln in rest.splitlines() if "interrupted" in ln] == [
            "mta: interrupted (SIGINT); nothing to shut down, the next start recovers"], rest
        for pid in children:
            _wait_gone(pid)
    finally:
        proc.kill()
        proc.wait()
