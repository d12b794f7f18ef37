"""How ``mta`` fails: one line, the documented exit status, and with ``--json`` one shape.

Every test runs the real console script in a subprocess, as an operator
does. Without ``--json`` an error is ``mta: ...`` on stderr and nothing on
stdout; with it, stdout holds exactly one line, ``{"error": ..., "code": ...}``,
and stderr nothing. The table is ``mta.cli.FAILURES`` (docs/operations.md,
"Exit statuses").
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from process_support import run_mta
from relay_support import NextHop, start_relay

from mta.admin.control import ERROR_CODES
from mta.config import parse_config
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_mta(*args, cwd=cwd)


def write_config(tmp_path: Path, spool_dir: str = "spool", route: str = "discard") -> str:
    path = tmp_path / "relay.toml"
    path.write_text(f'[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\n'
                    f'[spool]\ndir = "{spool_dir}"\n[routes]\n"*" = "{route}"\n')
    return str(path)


def make_spool(path: Path) -> Path:
    """An empty spool, as a relay's first start leaves it (the queue commands never create one)."""
    Spool.open(str(path), SpoolConfig()).close()
    return path


def assert_fails(cwd: Path, args: list[str], status: int, code: str, pattern: str) -> None:
    """``mta ARGS`` fails with ``status`` and a message matching ``pattern``, in both output modes."""
    human = run(cwd, *args)
    assert human.returncode == status, (human.returncode, human.stderr)
    assert human.stdout == "" and human.stderr.count("\n") == 1, (human.stdout, human.stderr)
    assert re.fullmatch(f"mta: {pattern}\n", human.stderr), human.stderr
    as_json = run(cwd, *args, "--json")
    assert as_json.returncode == status, (as_json.returncode, as_json.stdout, as_json.stderr)
    assert as_json.stderr == "" and as_json.stdout.count("\n") == 1, (as_json.stdout, as_json.stderr)
    error = json.loads(as_json.stdout)
    assert set(error) == {"error", "code"} and error["code"] == code, error
    assert re.fullmatch(pattern, error["error"]), error


# (arguments after the config, exit status, code, message) with no relay running: the spool is read from disk.
OFFLINE = {
    "show: not a queue id": (["queue", "show", "ZZ"], 2, "bad_request", r"not a queue id: 'ZZ'"),
    "hold: one id of two is not one": (["queue", "hold", "1A", "nope!"], 2, "bad_request",
                                       r"not a queue id: 'nope!'"),
    "list: not a cursor": (["queue", "list", "--cursor", "x"], 2, "bad_request", r"not a list cursor: 'x'"),
    "show: no such message": (["queue", "show", "1A"], 1, "not_found", r"no queued message with id 1A"),
    "show: no such shard": (["queue", "show", "1A-7"], 1, "not_found",
                            r"no queued message with id 1A-7 \(the relay has no shard 7\)"),
    "delete: no such shard": (["queue", "delete", "1A-3"], 1, "not_found",
                              r"no queued message with id 1A-3 \(the relay has no shard 3\)"),
}


@pytest.mark.parametrize("case", list(OFFLINE.values()), ids=list(OFFLINE))
def test_a_bad_or_unknown_id_is_one_line_and_its_exit_status(tmp_path: Path,
                                                            case: tuple[list[str], int, str, str]) -> None:
    args, status, code, pattern = case
    make_spool(tmp_path / "spool")
    assert_fails(tmp_path, [*args, "--config", write_config(tmp_path)], status, code, pattern)


def test_a_config_error_is_exit_2_on_every_queue_command(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    assert_fails(tmp_path, ["queue", "count", "--config", missing], 2, "config",
                 f"{re.escape(missing)}: cannot read config file: No such file or directory")
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nlisen = ["127.0.0.1:2525"]\n')
    for command in (["list"], ["shape"], ["hold", "1A"]):
        assert_fails(tmp_path, ["queue", *command, "--config", str(bad)], 2, "config",
                     rf"{re.escape(str(bad))}: server\.lisen: unknown key; did you mean 'listen'\?")
    assert not (tmp_path / "spool").exists()


def test_a_spool_that_cannot_exist_is_spool_not_found(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory\n")
    config = write_config(tmp_path, spool_dir="afile/spool")
    assert_fails(tmp_path, ["queue", "list", "--config", config], 1, "spool_not_found",
                 f"no spool at {re.escape(str(tmp_path / 'afile' / 'spool'))} "
                 f"\\(spool.dir of {re.escape(config)}\\); nothing was created")


MISSING = {"list": ["list"], "count": ["count", "--held"], "show": ["show", "1A"], "shape": ["shape"],
           "hold": ["hold", "1A"], "flush": ["flush"]}


@pytest.mark.parametrize("command", list(MISSING.values()), ids=list(MISSING))
def test_a_queue_command_on_a_missing_spool_names_it_and_its_config_and_creates_nothing(
        tmp_path: Path, command: list[str]) -> None:
    """Run elsewhere, a relative spool.dir must not become a new, empty spool there."""
    etc, elsewhere = tmp_path / "etc", tmp_path / "elsewhere"
    etc.mkdir()
    elsewhere.mkdir()
    config = write_config(etc, spool_dir="../var/spool")
    assert_fails(elsewhere, ["queue", *command, "--config", config], 1, "spool_not_found",
                 f"no spool at {re.escape(str(tmp_path / 'var' / 'spool'))} "
                 f"\\(spool.dir of {re.escape(config)}\\); nothing was created")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["elsewhere", "etc", "relay.toml"]


def test_with_no_config_file_the_missing_spool_is_the_default_one_in_the_current_directory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LOGSPOOL_CONFIG"}
    proc = run_mta("queue", "list", cwd=tmp_path, env=env)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr == (f"mta: no spool at {tmp_path / 'var' / 'spool'} (the built-in default spool.dir, "
                           "relative to the current directory: no --config, $LOGSPOOL_CONFIG or ./logspool.toml); "
                           "nothing was created\n")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(name="locked_spool")
def locked_spool_fixture(tmp_path: Path) -> Iterator[Path]:
    """A spool whose lock this process holds, with no control socket: a relay that does not answer."""
    sp = Spool.open(str(tmp_path / "spool"), SpoolConfig())
    try:
        yield tmp_path / "spool"
    finally:
        sp.close()


def test_a_locked_spool_with_a_silent_socket_is_relay_not_answering(tmp_path: Path, locked_spool: Path) -> None:
    config = write_config(tmp_path)
    for command in (["count"], ["show", "1A"], ["flush"]):
        assert_fails(tmp_path, ["queue", *command, "--config", config], 1, "relay_not_answering",
                     f"the relay holds {re.escape(str(locked_spool))} but its control socket "
                     f"{re.escape(str(locked_spool / 'control.sock'))} does not answer")


def test_serve_on_a_locked_spool_is_one_line_and_exit_1(tmp_path: Path, locked_spool: Path) -> None:
    proc = run(tmp_path, "serve", "--config", write_config(tmp_path))
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last == f"mta: {locked_spool}: another process has this spool open (is another relay running on it?)"
    assert "Traceback" not in proc.stderr


def test_serve_misused_supervisor_option_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = run(tmp_path, "serve", "--shard", "1", "--config", write_config(tmp_path))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == "mta: --shard: is for the supervisor: it needs --shards (above the shard) and --supervisor\n"


USAGE = {
    "list: limit out of range": ["queue", "list", "--limit", "0"],
    "shape: top not a number": ["queue", "shape", "--top", "many"],
    "count: unknown option": ["queue", "count", "--bogus"],
    "hold: no id": ["queue", "hold"],
}


@pytest.mark.parametrize("args", list(USAGE.values()), ids=list(USAGE))
def test_a_usage_error_without_json_is_one_line(tmp_path: Path, args: list[str]) -> None:
    proc = run(tmp_path, *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    command = "mta " + " ".join(args[:2])
    assert re.fullmatch(f"{command}: [^\n]+ \\(see '{command} --help'\\)\n", proc.stderr), proc.stderr
    assert not (tmp_path / "spool").exists()


def test_usage_errors_before_any_command_are_one_line_too(tmp_path: Path) -> None:
    for args, expected in ((["--bogus"], "mta: No such option '--bogus'. (see 'mta --help')\n"),
                           (["queue", "lst"], "mta queue: No such command 'lst'. Did you mean 'list'? "
                                              "(see 'mta queue --help')\n")):
        proc = run(tmp_path, *args)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", expected)


@pytest.mark.parametrize("args", list(USAGE.values()), ids=list(USAGE))
def test_a_usage_error_with_json_is_the_same_shape(tmp_path: Path, args: list[str]) -> None:
    proc = run(tmp_path, *args, "--json")
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    error = json.loads(proc.stdout)
    assert set(error) == {"error", "code"} and error["code"] == "usage", error
    assert "\n" not in error["error"] and error["error"], error
    assert not (tmp_path / "spool").exists()  # refused before anything was opened


def test_a_change_that_fails_for_some_ids_prints_its_answer_and_exits_1(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    make_spool(tmp_path / "spool")
    human = run(tmp_path, "queue", "hold", "1A", "--config", config)
    assert human.returncode == 1
    assert human.stdout == "hold: 0 done\n" and human.stderr == "1A: no queued message with id 1A\n"
    as_json = run(tmp_path, "queue", "hold", "1A", "--config", config, "--json")
    assert as_json.returncode == 1 and as_json.stderr == ""
    assert json.loads(as_json.stdout) == {"ok": True, "done": [], "skipped": [],
                                          "errors": {"1A": "no queued message with id 1A"}}


# -- through a running relay's control socket ----------------------------------


def ask_raw(path: str, line: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(line)
        buf = bytearray()
        while chunk := s.recv(65536):
            buf += chunk
    answer: dict[str, object] = json.loads(buf)
    return answer


async def test_the_relays_error_answers_carry_a_code_that_the_cli_maps(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        path = write_config(tmp_path, route=f"smtp://127.0.0.1:{await hop.start(nursery)}")
        relay = await start_relay(nursery, parse_config(Path(path).read_text(), source=path,
                                                        base_dir=str(tmp_path)))
        sock = relay.config.server.control_socket
        bad = await trio.to_thread.run_sync(ask_raw, sock, b'{"op": "list", "limit": 0}\n')
        missing = await trio.to_thread.run_sync(ask_raw, sock, b'{"op": "show", "id": "1A"}\n')
        assert (bad["ok"], bad["code"]) == (False, "bad_request") and bad["code"] in ERROR_CODES
        assert (missing["ok"], missing["code"], missing["error"]) == (False, "not_found",
                                                                      "no queued message with id 1A")
        await trio.to_thread.run_sync(assert_fails, tmp_path, ["queue", "show", "1A", "--config", path], 1,
                                      "not_found", "no queued message with id 1A")
        nursery.cancel_scope.cancel()


class FakeRelay:
    """A control socket that answers every request with one fixed line: what no real relay says."""

    def __init__(self, path: Path, answer: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by the test
                return
            with conn:
                conn.settimeout(30)
                conn.recv(65536)
                conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=30)


ANSWERS = {
    "not JSON": (b"<html>\n", 1, "relay_not_answering",
                 r"control socket .*: no answer from the relay \(see its log\)"),
    "not an object": (b"[1, 2]\n", 1, "relay_not_answering",
                      r"control socket .*: the relay's answer is not a JSON object"),
    "an error without a code": (b'{"ok": false, "error": "disk on fire"}\n', 1, "failed", "disk on fire"),
    "a bad request": (b'{"ok": false, "error": "limit is wrong", "code": "bad_request"}\n', 2, "bad_request",
                      "limit is wrong"),
    "an error over two lines": (b'{"ok": false, "error": "one\\ntwo", "code": "internal"}\n', 1, "failed",
                                "one two"),
}


@pytest.mark.parametrize("case", list(ANSWERS.values()), ids=list(ANSWERS))
def test_what_the_control_socket_answers_becomes_one_line(tmp_path: Path,
                                                         case: tuple[bytes, int, str, str]) -> None:
    answer, status, code, pattern = case
    (tmp_path / "spool").mkdir(mode=0o700)
    fake = FakeRelay(tmp_path / "spool" / "control.sock", answer)
    try:
        assert_fails(tmp_path, ["queue", "count", "--config", write_config(tmp_path)], status, code, pattern)
    finally:
        fake.close()
