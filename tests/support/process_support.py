"""The relay as a child process: ``mta serve`` with its log lines, and the ``mta`` admin commands.

For tests of what a process does (kill -9, restarts, shards, exit codes, the
console script itself); ``relay_support.start_relay`` runs the relay inside
the test where its sockets are enough. Readiness is the relay's "listening
on" log line; every wait is on the process's output or its exit, bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

# The console script beside this Python, not `python -m mta`: a test's cwd may hold a directory named spool.
MTA = os.path.join(os.path.dirname(sys.executable), "mta")
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+),")
IN_DOUBT = re.compile(r"in doubt: queue id (\S+) recipients? (\S+):")  # one line per message, recipients comma-joined


async def mta(config: Path | None, *args: str, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """``mta ARGS --config CONFIG`` in the config's directory (``config`` None: no ``--config``, in ``cwd``)."""
    if config is not None:
        args = (*args, "--config", str(config))
        cwd = cwd or config.parent
    return await trio.run_process([MTA, *args], capture_stdout=True, capture_stderr=True, check=False,
                                  cwd=str(cwd) if cwd is not None else None, env=env)


def run_mta(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``mta ARGS`` in ``cwd`` to its exit, with no stdin, output as text: for the tests that are not async."""
    return subprocess.run([MTA, *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=str(cwd),
                          stdin=subprocess.DEVNULL, env=env)


async def mta_json(config: Path, *args: str) -> Any:
    """``mta ARGS --json``, which must succeed; its answer."""
    proc = await mta(config, *args, "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


class ServeProcess:
    """``mta serve --config CONFIG`` as a child process; its stderr is collected line by line.

    Whatever way the test ends (a failed assertion included), no relay outlives
    it: the process is killed when the nursery it was launched in ends.
    """

    def __init__(self, config: Path) -> None:
        self.config = config
        self.lines: list[str] = []
        self.proc: trio.Process | None = None
        self._changed = trio.Event()

    async def launch(self, nursery: trio.Nursery) -> trio.Process:
        self.lines = []
        proc = self.proc = await trio.lowlevel.open_process(
            [MTA, "serve", "--config", str(self.config)], cwd=str(self.config.parent),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        nursery.start_soon(self._read_stderr, proc)
        nursery.start_soon(self._reap, proc)
        return proc

    async def wait_output(self, done: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
        """Until ``done()`` holds, re-asked at each new line; the process's exit or the bound fails the test.

        ``what`` names the awaited state in the failure's message (a callable: asked at the failure).
        """
        def said() -> str:
            return (what() if callable(what) else what) + ":\n" + "\n".join(self.lines)

        with trio.move_on_after(timeout):
            while not done():
                assert self.proc is not None and self.proc.returncode is None, f"the relay exited before {said()}"
                await self._changed.wait()
            return
        raise AssertionError(f"not in {timeout}s: {said()}")

    async def kill(self) -> None:
        """SIGKILL, and wait until the process is gone."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        with trio.fail_after(30):
            await self.proc.wait()

    async def _reap(self, proc: trio.Process) -> None:
        try:
            await trio.sleep_forever()
        finally:
            if proc.returncode is None:
                proc.kill()

    async def _read_stderr(self, proc: trio.Process) -> None:
        assert proc.stderr is not None
        buf = b""
        while True:
            chunk = await proc.stderr.receive_some(65536)
            if not chunk:
                break
            buf += chunk
            *complete, buf = buf.split(b"\n")
            self.lines += [line.decode("utf-8", "replace") for line in complete]
            self._changed.set()
            self._changed = trio.Event()
        await proc.wait()
        self._changed.set()


class RelayProcess(ServeProcess):
    """A single-process relay: ``start`` returns once it listens, and ``port`` is where."""

    def __init__(self, config: Path) -> None:
        super().__init__(config)
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> None:
        await self.launch(nursery)
        await self.wait_output(self._listening, 60, "listening")

    def _listening(self) -> bool:
        for line in self.lines:
            if m := LISTENING.search(line):
                self.port = int(m.group(1))
        return bool(self.port)

    async def kill(self) -> None:
        await super().kill()
        assert self.proc is not None and self.proc.returncode == -signal.SIGKILL
        self.port = 0

    def in_doubt_logged(self) -> set[tuple[str, str]]:
        """(queue id, recipient) of every recipient recovery logged as in doubt."""
        return {(m.group(1), r) for line in self.lines if (m := IN_DOUBT.search(line)) for r in m.group(2).split(",")}
