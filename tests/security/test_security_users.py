"""The users file of SMTP AUTH and ``mta user add|passwd|del`` (docs/operations.md, "Submission"): the real
command in a child process, with the password from stdin or typed at a real terminal (a pty); the file written
atomically, mode 0600, and read back by the relay's own reader; a bad file refused at start in one line;
the failed-attempt limiter's window and bounds."""

from __future__ import annotations

import os
import re
import selectors
import time
from pathlib import Path

import pytest
import trustme
from process_support import MTA, run_mta
from relay_support import tls_files

from mta.auth.limiter import FailureLimiter
from mta.auth.users import UsersFile, UsersFileError, add_user, parse_users, read_users


def _readable(fd: int, timeout: float) -> bool:
    """Is ``fd`` readable within ``timeout``? epoll, not select(): the test process may hold descriptors past
    FD_SETSIZE (every in-process relay of the suite keeps its spool open, crash-only)."""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout))

def user_cmd(tmp_path: Path, *args: str, password: str | None = None) -> tuple[int, str, str]:
    """``mta user ARGS --file tmp/users``; ``password``: given on stdin with --password-stdin."""
    import subprocess

    extra = ["--password-stdin"] if password is not None else []
    run = subprocess.run([MTA, "user", *args, "--file", str(tmp_path / "users"), *extra], capture_output=True,
                         text=True, timeout=60, check=False, cwd=str(tmp_path),
                         input=password + "\n" if password is not None else None)
    return run.returncode, run.stdout, run.stderr


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_add_passwd_del_from_stdin(tmp_path: Path) -> None:
    users = tmp_path / "users"
    assert user_cmd(tmp_path, "add", "alice", password="first pw")[:2] == (0, f"mta user: added alice to {users}\n")
    assert os.stat(users).st_mode & 0o777 == 0o600
    assert UsersFile(str(users)).verify("alice", "first pw")
    assert "first pw" not in users.read_text()
    code, _, err = user_cmd(tmp_path, "add", "alice", password="again")
    assert code == 1 and one_line(err) == "mta: user 'alice' exists already (mta user passwd changes a password)"
    assert user_cmd(tmp_path, "passwd", "alice", password="second pw")[0] == 0
    reader = UsersFile(str(users))
    assert reader.verify("alice", "second pw") and not reader.verify("alice", "first pw")
    assert user_cmd(tmp_path, "add", "bob", password="b")[0] == 0
    assert user_cmd(tmp_path, "del", "alice")[:2] == (0, f"mta user: removed alice from {users}\n")
    assert list(read_users(str(users))) == ["bob"]
    code, _, err = user_cmd(tmp_path, "del", "alice")
    assert code == 1 and one_line(err) == f"mta: no user 'alice' in {users}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["users", "users.lock"]  # no temporary file left


@pytest.mark.parametrize(("name", "password", "problem"), [
    ("al:ice", "pw", "a user name has no colon, white space or control character"),
    ("al ice", "pw", "a user name has no colon, white space or control character"),
    ("a" * 256, "pw", "a user name has 1 to 255 characters"),
    ("alice", "", "the password is empty"),
])
def test_a_bad_name_or_password_is_one_line_and_changes_nothing(
        tmp_path: Path, name: str, password: str, problem: str) -> None:
    code, out, err = user_cmd(tmp_path, "add", name, password=password)
    assert (code, out) == (1, "") and one_line(err) == f"mta: {problem}"
    assert not (tmp_path / "users").exists()


def test_without_a_terminal_or_password_stdin_the_command_says_so(tmp_path: Path) -> None:
    run = run_mta("user", "add", "alice", "--file", str(tmp_path / "users"), cwd=tmp_path)
    assert run.returncode == 2
    assert re.fullmatch(r"mta user add: standard input is not a terminal: give --password-stdin .*",
                        one_line(run.stderr))


def test_without_users_file_in_the_config_the_command_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "relay.toml").write_text('[spool]\ndir = "spool"\n')
    run = run_mta("user", "del", "alice", "--config", str(tmp_path / "relay.toml"), cwd=tmp_path)
    assert run.returncode == 2
    assert one_line(run.stderr) == f"mta: {tmp_path / 'relay.toml'}: submission.users_file: not set: give it, " \
                                   "or --file PATH"


def test_the_password_typed_at_a_terminal_is_asked_twice_and_not_echoed(tmp_path: Path) -> None:
    (tmp_path / "relay.toml").write_text(f'[submission]\nusers_file = "{tmp_path / "users"}"\n')
    pid, fd = os.forkpty()
    if pid == 0:  # the child: mta on the pty, which is its controlling terminal
        os.execv(MTA, [MTA, "user", "add", "alice", "--config", str(tmp_path / "relay.toml")])
    screen = b""

    def until(text: bytes) -> None:
        nonlocal screen
        deadline = time.monotonic() + 30
        while text not in screen:
            assert _readable(fd, max(0.0, deadline - time.monotonic())), f"no {text!r} in {screen!r}"
            try:
                screen += os.read(fd, 1024)
            except OSError:  # EIO: the child closed the pty
                break

    until(b"Password: ")
    os.write(fd, b"typed secret\n")
    until(b"Repeat for confirmation: ")
    os.write(fd, b"typed secret\n")
    until(b"mta user: added alice")
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert b"typed secret" not in screen
    assert UsersFile(str(tmp_path / "users")).verify("alice", "typed secret")


def test_a_bad_users_file_names_the_line_and_never_the_hash() -> None:
    with pytest.raises(UsersFileError, match=r"^f: line 3: the hash is not an Argon2 hash \(\$argon2id\$\.\.\.\)$"):
        parse_users("# users\n\nalice:$2y$10$secretbcrypthash\n", "f")
    with pytest.raises(UsersFileError, match=r"^f: line 2: the user is named twice$"):
        parse_users("a:$argon2id$x\na:$argon2id$y\n", "f")
    with pytest.raises(UsersFileError, match=r"^f: line 1: no colon"):
        parse_users("alice\n", "f")


def test_the_relay_rereads_a_changed_file_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "users"
    add_user(str(path), "alice", "pw")
    reader = UsersFile(str(path))
    add_user(str(path), "bob", "pw2")
    assert reader.verify("bob", "pw2") and reader.last_error is None
    good = path.read_text()
    path.write_text(good + "broken line\n")
    assert reader.verify("alice", "pw") and reader.verify("bob", "pw2")
    assert reader.last_error is not None and "line 4" in reader.last_error
    assert not reader.verify("nobody", "pw")


def test_submission_without_a_users_file_or_with_an_open_one_does_not_start(tmp_path: Path, ca: trustme.CA) -> None:
    cert, key = tls_files(tmp_path, ca)
    users = tmp_path / "users"
    config = tmp_path / "relay.toml"
    config.write_text(f'[server]\nhostname = "relay.test"\nlisten = ["127.0.0.1:0"]\ntls_cert = "{cert}"\n'
                      f'tls_key = "{key}"\n[spool]\ndir = "spool"\n[submission]\nlisten = ["127.0.0.1:0"]\n'
                      f'users_file = "{users}"\n')
    run = run_mta("serve", "--config", str(config), cwd=tmp_path)
    assert run.returncode == 2
    assert one_line(run.stderr) == f"mta: {config}: submission.users_file: no such file: {users} " \
                                   "(mta user add NAME creates it)"
    check = run_mta("config", "check", "--config", str(config), cwd=tmp_path)  # says the same, starting nothing
    assert check.returncode == 2 and one_line(run.stderr) in check.stderr.splitlines()
    add_user(str(users), "alice", "pw")
    os.chmod(users, 0o644)
    run = run_mta("serve", "--config", str(config), cwd=tmp_path)
    assert run.returncode == 1
    assert one_line(run.stderr) == f"mta: {config}: submission.users_file: {users} is open to other users " \
                                   "(mode 0644); chmod 600 it; refusing to start"
    assert not (tmp_path / "spool").exists()


def test_submission_needs_tls_and_a_users_file_in_the_config(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('[spool]\ndir = "spool"\n[submission]\nimplicit_tls_listen = ["127.0.0.1:0"]\n')
    run = run_mta("config", "check", "--config", str(config), cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"mta: {config}: submission.implicit_tls_listen: a submission listener needs TLS: set [server] tls_cert "
        "and tls_key",
        f"mta: {config}: submission.users_file: a submission listener needs users to authenticate: set users_file"]


def test_the_limiter_counts_failures_in_a_sliding_window_and_forgets_on_success() -> None:
    now = [0.0]
    limiter = FailureLimiter(3, 60.0, clock=lambda: now[0])
    assert [limiter.failed("192.0.2.1") for _ in range(2)] == [1, 2] and not limiter.blocked("192.0.2.1")
    now[0] = 30.0
    assert limiter.failed("192.0.2.1") == 3 and limiter.blocked("192.0.2.1")
    assert not limiter.blocked("192.0.2.2")
    now[0] = 60.0  # the first two are a window old
    assert limiter.failures("192.0.2.1") == 1 and not limiter.blocked("192.0.2.1")
    limiter.succeeded("192.0.2.1")
    assert limiter.failures("192.0.2.1") == 0 and len(limiter) == 0


def test_the_limiter_remembers_at_most_max_clients_addresses() -> None:
    limiter = FailureLimiter(2, 60.0, max_clients=100, clock=lambda: 0.0)
    for i in range(1000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}")
        limiter.failed("192.0.2.9")  # touched every time: never the one forgotten
    assert len(limiter) == 100 and limiter.blocked("192.0.2.9")
    assert limiter.failures("10.0.0.0") == 0 and limiter.failures("10.0.3.231") == 1
