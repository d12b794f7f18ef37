"""Real daemons for tests (milters, OpenDKIM, rspamd): started on 127.0.0.1 with a config in a tmp dir, and stopped.

A daemon is ready when its port takes a connection: ``Daemon.start`` waits
for that (polling the port until a deadline, and failing at once with the
daemon's output if it exits), never for a fixed time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

# Milters and scanners run under the system Python and as Debian installed them.
SYSTEM_PYTHON = "/usr/bin/python3"
SUPPORT = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Daemon:
    """One daemon process; its output goes to ``log`` (read back when it fails to start)."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.argv = list(argv)
        self.log = log
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ports: Sequence[int | Path], timeout: float = 30.0) -> Daemon:
        """Start, and return once every port (a TCP port of 127.0.0.1, or a unix socket's path) takes a connection."""
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd,
                                         env={**os.environ, **(self.env or {})}, start_new_session=True)
        deadline = time.monotonic() + timeout
        for port in ports:
            while not _listening(port):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.argv[0]} exited {self.proc.returncode}: {self.output()}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.argv[0]} not listening on {port} after {timeout}s: {self.output()}")
                time.sleep(0.05)  # polling the port: the condition waited for is the connect above
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """Kill the daemon's own process group (it was started in a new session): its workers go with it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _listening(port: int | Path) -> bool:
    try:
        if isinstance(port, Path):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1)
                s.connect(str(port))
                return True
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
