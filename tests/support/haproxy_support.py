"""Debian's haproxy in front of a relay, in TCP mode, one frontend per PROXY version; started and stopped by a test.

``haproxy -f CONF -db`` (foreground, no daemon) with its config in the test's
directory; each frontend listens on a port of 127.0.0.1 chosen here and
passes connections to its backend with ``send-proxy`` (v1) or
``send-proxy-v2``. The context manager yields the frontend ports once haproxy
accepts on all of them.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import trio


def have_haproxy() -> bool:
    return shutil.which("haproxy") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(frontends: Mapping[str, tuple[int, int, str]]) -> str:
    lines = ["global", "  maxconn 200", "defaults", "  mode tcp", "  timeout connect 5s", "  timeout client 60s",
             "  timeout server 60s"]
    for name, (port, backend_port, option) in frontends.items():
        lines += [f"frontend fe_{name}", f"  bind 127.0.0.1:{port}", f"  default_backend be_{name}",
                  f"backend be_{name}", f"  server relay 127.0.0.1:{backend_port} {option}"]
    return "\n".join(lines) + "\n"


async def _accepting(port: int) -> bool:
    try:
        with trio.fail_after(1):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
    except (OSError, trio.TooSlowError):
        return False
    await stream.aclose()
    return True


@asynccontextmanager
async def haproxy(directory: Path, backends: Mapping[str, tuple[int, str]]) -> AsyncIterator[dict[str, int]]:
    """haproxy with a frontend per ``name: (relay port, server option)``; yields ``name: frontend port``."""
    directory.mkdir(parents=True, exist_ok=True)
    frontends = {name: (_free_port(), port, option) for name, (port, option) in backends.items()}
    conf = directory / "haproxy.cfg"
    conf.write_text(_config(frontends))
    log = (directory / "haproxy.log").open("wb")
    proc = subprocess.Popen(["haproxy", "-f", str(conf), "-db"], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        for _ in range(100):  # a bounded poll for a child process to listen; not a synchronisation by time
            if proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {(directory / 'haproxy.log').read_text()}")
            if all([await _accepting(port) for port, _, _ in frontends.values()]):
                break
            await trio.sleep(0.05)
        else:
            raise RuntimeError("haproxy did not listen")
        yield {name: port for name, (port, _, _) in frontends.items()}
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()
