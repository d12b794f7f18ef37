"""``mta config check``: the file and this host checked as ``mta serve`` would, with nothing started or changed.

Every case runs the real ``mta config check`` as a subprocess on real files
and directories (docs/operations.md, "Checking and showing the config").
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import trustme
from process_support import run_mta
from relay_support import tls_files

ENV = {k: v for k, v in os.environ.items() if k != "LOGSPOOL_CONFIG"}


def write(tmp_path: Path, server: str = "", spool: str = "", spool_dir: Path | None = None) -> Path:
    path = tmp_path / "relay.toml"
    path.write_text(f'[server]\nhostname = "relay.test"\nlisten = ["127.0.0.1:0"]\n{server}\n'
                    f'[spool]\ndir = "{spool_dir or tmp_path / "spool"}"\n{spool}\n')
    return path


def mta(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_mta(*args, cwd=cwd, env=ENV)


def check(config: Path) -> subprocess.CompletedProcess[str]:
    run = mta("config", "check", "--config", str(config), cwd=config.parent)
    assert "Traceback" not in run.stderr
    return run


def problems(config: Path, code: int) -> list[str]:
    """``mta config check`` exits ``code``, prints nothing on stdout, and one line per problem on stderr."""
    run = check(config)
    assert run.returncode == code, run.stderr
    assert run.stdout == "" and run.stderr.endswith("\n"), (run.stdout, run.stderr)
    return run.stderr.splitlines()


def test_a_good_config_is_one_line_on_stdout_and_exit_0_and_creates_nothing(tmp_path: Path) -> None:
    config = write(tmp_path)
    run = check(config)
    assert (run.returncode, run.stdout, run.stderr) == (0, f"config OK: {config}\n", "")
    assert not (tmp_path / "spool").exists()


def test_no_file_checks_the_defaults(tmp_path: Path) -> None:
    run = mta("config", "check", cwd=tmp_path)
    assert (run.returncode, run.stdout, run.stderr) == (0, "config OK: <defaults>\n", "")
    assert not (tmp_path / "var").exists()


def test_every_problem_of_the_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write(tmp_path, "max_recipients = 0\nlisen = 1", 'retry_intervals = ["5m", "1m"]')
    lines = problems(config, 2)
    where = re.escape(str(config))
    assert len(lines) == 3, lines
    assert re.fullmatch(rf"mta: {where}: server\.max_recipients: must be between 1 and \d+, got 0", lines[0])
    assert lines[1] == f"mta: {config}: server.lisen: unknown key; did you mean 'listen'?"
    assert lines[2] == f"mta: {config}: spool.retry_intervals: retry intervals must not decrease: the last class " \
                       "sweeps the log"


def test_a_spool_others_can_write_is_refused_exit_1_and_left_as_it_was(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    spool.chmod(0o770)
    config = write(tmp_path)
    assert problems(config, 1) == [f"mta: {config}: spool.dir: unsafe spool: {spool} is writable by group or others "
                                   "(mode 0770); refusing to start"]
    assert stat.S_IMODE(spool.stat().st_mode) == 0o770


def test_a_symlink_in_the_spool_is_refused_exit_1(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    (spool / "log").mkdir(mode=0o700, parents=True)
    spool.chmod(0o700)
    (spool / "log" / "000000000001.seg").symlink_to(tmp_path / "elsewhere")
    config = write(tmp_path)
    assert problems(config, 1) == [f"mta: {config}: spool.dir: unsafe spool: {spool}/log/000000000001.seg is a "
                                   "symlink; refusing to start"]


def test_a_spool_others_can_only_read_is_a_warning_that_serve_repairs(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o755)
    (spool / "checkpoint").write_text("")
    (spool / "checkpoint").chmod(0o644)
    config = write(tmp_path)
    run = check(config)
    assert (run.returncode, run.stdout) == (0, f"config OK: {config}\n")
    assert run.stderr == (f"mta: warning: {config}: spool.dir: group or others can read 2 entries (the first: "
                          f"{spool}); mta serve makes them private (directories 0700, files 0600)\n")
    assert stat.S_IMODE(spool.stat().st_mode) == 0o755  # check changes nothing
    assert stat.S_IMODE((spool / "checkpoint").stat().st_mode) == 0o644


def test_a_spool_that_cannot_be_created_is_exit_1(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("a file, not a directory")
    config = write(tmp_path, spool_dir=tmp_path / "plain" / "spool")
    assert problems(config, 1) == [f"mta: {config}: spool.dir: cannot create {tmp_path}/plain/spool: "
                                   f"{tmp_path}/plain is not a directory"]


def test_a_spool_path_that_is_a_file_is_named_twice_as_serve_meets_it(tmp_path: Path) -> None:
    """The control socket's directory first (a config problem, exit 2, as ``mta serve`` stops there), then the spool."""
    (tmp_path / "spool").write_text("")
    config = write(tmp_path)
    assert problems(config, 2) == [f"mta: {config}: server.control_socket: {tmp_path}/spool is not a directory",
                                   f"mta: {config}: spool.dir: spool {tmp_path}/spool is not a directory"]


def test_free_space_below_queue_minfree_is_exit_1(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    config = write(tmp_path, spool=f"queue_minfree = {free + (1 << 40)}")
    [line] = problems(config, 1)
    assert re.fullmatch(rf"mta: {re.escape(str(config))}: spool\.queue_minfree: [0-9.]+ MiB free on the filesystem "
                        rf"of {re.escape(str(tmp_path))}, less than spool\.queue_minfree \([0-9.]+ MiB\): the relay "
                        r"would start but refuse all mail with 452", line), line


def test_an_archive_dir_that_cannot_be_created_is_exit_1(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("")
    config = write(tmp_path, spool=f'archive_dir = "{tmp_path / "plain" / "archive"}"')
    assert problems(config, 1) == [f"mta: {config}: spool.archive_dir: cannot create {tmp_path}/plain/archive: "
                                   f"{tmp_path}/plain is not a directory"]


def test_good_tls_files_pass(tmp_path: Path, ca: trustme.CA) -> None:
    cert, key = tls_files(tmp_path, ca)
    run = check(write(tmp_path, f'tls_cert = "{cert}"\ntls_key = "{key}"'))
    assert (run.returncode, run.stderr) == (0, "")


def test_tls_problems_are_what_serve_says_with_its_exit_status(tmp_path: Path, ca: trustme.CA) -> None:
    """A key that is not the certificate's is a config problem (2); a key others can read is the host's (1)."""
    cert, key = tls_files(tmp_path, ca)
    ca.issue_cert("other.test").private_key_pem.write_to_path(str(tmp_path / "other.key"))
    os.chmod(tmp_path / "other.key", 0o600)
    config = write(tmp_path, f'tls_cert = "{cert}"\ntls_key = "other.key"')
    assert problems(config, 2) == [f"mta: {config}: server.tls_key: {tmp_path}/other.key does not match the "
                                   f"certificate in {cert}"]
    key.chmod(0o644)
    config = write(tmp_path, f'tls_cert = "{cert}"\ntls_key = "{key}"')
    assert problems(config, 1) == [f"mta: {config}: server.tls_key: {key} is open to other users (mode 0644); chmod "
                                   "600 it and consider the key exposed; refusing to start"]
    assert stat.S_IMODE(key.stat().st_mode) == 0o644


def test_each_shards_control_socket_is_checked(tmp_path: Path) -> None:
    """107 bytes fit shard 0's socket; shard 1's is the path plus '.1', too long."""
    path = tmp_path / ("c" * (107 - len(str(tmp_path)) - 1))
    config = write(tmp_path, f'control_socket = "{path}"\nprocesses = 2')
    assert problems(config, 2) == [f"mta: {config}: server.control_socket: {path}.1 is 109 bytes long; a Unix "
                                   "socket path holds at most 107"]


def test_problems_of_both_kinds_are_all_listed_and_exit_2(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o777)
    config = write(tmp_path, f'control_socket = "{tmp_path}/no/such/dir/ctl.sock"')
    lines = problems(config, 2)
    assert lines == [f"mta: {config}: server.control_socket: directory {tmp_path}/no/such/dir does not exist",
                     f"mta: {config}: spool.dir: unsafe spool: {spool} is writable by group or others (mode 0777); "
                     "refusing to start"]


@pytest.mark.parametrize(("server", "code"), [
    ("lisen = 1", 2),  # the file
    ("max_sessions = 5\nreserved_sessions = 5", 2),  # a rule that spans settings
    ('control_socket = "/nonexistent-dir/ctl.sock"', 2),  # the host, config must change
])
def test_check_says_what_serve_says(tmp_path: Path, server: str, code: int) -> None:
    """The same line and the same exit status as ``mta serve`` (which stops there and creates no spool)."""
    config = write(tmp_path, server)
    served = mta("serve", "--config", str(config), cwd=tmp_path)
    assert served.returncode == code and not (tmp_path / "spool").exists()
    assert problems(config, code) == served.stderr.splitlines()
