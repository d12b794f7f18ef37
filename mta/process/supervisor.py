"""The ``mta serve`` parent when the relay runs several processes (see ``mta.shards``).

Theory of operation
-------------------
The parent only supervises: it creates the shard directories, reserves the
listening addresses, starts one child per shard (``python -P -m mta serve
--shard K ...``, an ordinary process that ``ps`` shows with its shard) and
starts again any child that dies, after a backoff that doubles from 0.5 s to
30 s while children keep dying young, logged each time. It runs no event
loop, no spool and no SMTP, so the one thing that can end it is a signal:
a crash of a shard (a failed fsync ends a relay, crash-only) costs that
shard's connections and nothing else, and all shards are alike.

Planned stops and reloads: SIGTERM and SIGHUP are passed on to every
running child (each drains or reloads, ``mta.process.lifecycle``); after a
SIGTERM no child is started again, and the parent exits 0 once all have
exited (each by its own drain deadline).

Crash-only both ways. Nothing depends on that: SIGINT (Ctrl-C) or
kill -9 of the parent ends it where it stands (on SIGINT ``mta serve`` writes
one line and exits 130 at once), and the children follow it at once: each child
asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), checks
right after asking that the parent is still the one that started it (it may
have died before the request), and only where that request failed polls
``getppid()`` once a second instead (an idle shard then never wakes: on the
project's VM each timer wake-up of an idle process cost it a measurable share
of a core). The next ``mta serve`` recovers every shard.

Why the children are started with ``subprocess.Popen`` from this (main)
thread and not through trio: ``PR_SET_PDEATHSIG`` fires when the *thread*
that forked the child ends, and trio forks from a worker thread that exits
when idle, which would kill healthy children. Children are waited for with
pidfds and ``select``, so the loop wakes on a death or on the next restart.

Addresses. The parent binds every listening address with SO_REUSEPORT and
keeps the socket (bound, never listening) for its whole life: a port taken
by another program is a one-line error at start, a port 0 becomes one real
port that every child then listens on, and no other program can take the
port while a child restarts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import NoReturn

import attrs

from mta.config import DEFAULTS_SOURCE, Config, ListenAddress
from mta.inbound.listen import bind_error
from mta.process.security import check_spool_dir
from mta.process.startup import check_start
from mta.shards import SHARDS_DIR, shard_config, shard_count, shard_dir

log = logging.getLogger("mta.supervisor")

BACKOFF_MIN = 0.5
BACKOFF_MAX = 30.0
YOUNG = 10.0  # a child that dies sooner than this after its start makes the next backoff longer
PR_SET_PDEATHSIG = 1
PARENT_POLL = 1.0


@attrs.define(eq=False)
class Child:
    shard: int
    popen: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    started: float = 0.0
    backoff: float = BACKOFF_MIN
    restart_at: float | None = 0.0  # monotonic time of the next start; None while running


def _mkdir_durable(path: str) -> None:
    """Create a private directory and make its name durable (fsync of the parent), if it is not there yet.

    Why the fsync: a shard accepts mail (fsynced inside it) right after this;
    a power cut that took the directory's own entry would take that mail too.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)  # whatever the umask
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_shard_dirs(spool_dir: str, shards: int) -> None:
    os.makedirs(os.path.dirname(spool_dir) or ".", exist_ok=True)
    _mkdir_durable(spool_dir)
    if shards > 1:
        _mkdir_durable(os.path.join(spool_dir, SHARDS_DIR))
    for k in range(1, shards):
        _mkdir_durable(shard_dir(spool_dir, k))


def reserve_addresses(addrs: tuple[ListenAddress, ...]) -> tuple[list[socket.socket], list[ListenAddress]]:
    """Bind each address with SO_REUSEPORT (not listening); return the sockets and the addresses with real ports.

    Raises:
        ConfigError, StartError: an address cannot be bound, in one line (``mta.inbound.listen.bind_error``).
    """
    held: list[socket.socket] = []
    resolved: list[ListenAddress] = []
    for index, addr in enumerate(addrs):
        try:
            family, type_, proto, _, sockaddr = socket.getaddrinfo(
                addr.host, addr.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, type_, proto)
        except OSError as exc:
            for s in held:
                s.close()
            raise bind_error(addr, index, exc) from None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            sock.close()
            for s in held:
                s.close()
            raise bind_error(addr, index, exc) from None
        held.append(sock)
        resolved.append(attrs.evolve(addr, port=int(sock.getsockname()[1])))
    return held, resolved


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.shards = shard_count(config)
        self.children = [Child(k) for k in range(self.shards)]
        self.listen: list[ListenAddress] = []
        self._held: list[socket.socket] = []
        self.stopping = False  # a SIGTERM came: no child is started again, the parent exits with the last

    def _pass_on(self, signum: int, _frame: object) -> None:
        """SIGTERM or SIGHUP to the supervisor: the same signal to each running child (a signal handler)."""
        if signum == signal.SIGTERM:
            if self.stopping:
                return
            self.stopping = True
        for child in self.children:
            if child.popen is not None:
                try:
                    os.kill(child.popen.pid, signum)
                except ProcessLookupError:
                    pass  # it died a moment ago: _reap will see it

    def command(self, shard: int) -> list[str]:
        # -P: the working directory may hold a directory named like one of our packages (a spool called "spool").
        cmd = [sys.executable, "-P", "-m", "mta", "serve", "--shard", str(shard), "--shards", str(self.shards),
               "--supervisor", str(os.getpid())]
        if self.config.source != DEFAULTS_SOURCE:
            cmd += ["--config", os.path.abspath(self.config.source)]
        for addr in self.listen:
            cmd += ["--listen", str(addr)]
        return cmd

    def prepare(self) -> None:
        """Checks, directories and addresses, before any child: what is wrong here is a one-line error at start.

        Every shard's config is checked here (its control socket path is longer
        than shard 0's), so no child starts only to die of it and be restarted
        again and again.

        Raises:
            ConfigError: a setting must change (see ``mta.process.startup``, ``mta.inbound.listen.bind_error``).
            UnsafeSpool: the spool is not private.
            OSError: a directory cannot be made or an address bound.
        """
        for k in range(self.shards):
            check_start(shard_config(self.config, k, self.shards), listen=False)
        self._held, self.listen = reserve_addresses(self.config.server.listen)
        make_shard_dirs(self.config.spool.dir, self.shards)
        check_spool_dir(self.config.spool.dir)

    def _start(self, child: Child) -> None:
        child.popen = subprocess.Popen(self.command(child.shard), stdin=subprocess.DEVNULL)
        child.pidfd = os.pidfd_open(child.popen.pid)
        child.started = time.monotonic()
        child.restart_at = None
        log.info("shard %d started (pid %d)", child.shard, child.popen.pid)

    def _reap(self, child: Child) -> None:
        assert child.popen is not None
        status = child.popen.wait()
        os.close(child.pidfd)
        child.pidfd = -1
        lived = time.monotonic() - child.started
        child.backoff = min(child.backoff * 2, BACKOFF_MAX) if lived < YOUNG else BACKOFF_MIN
        child.restart_at = time.monotonic() + child.backoff
        how = f"signal {-status}" if status < 0 else f"status {status}"
        if self.stopping:
            child.restart_at = None
            log.info("shard %d (pid %d) ended with %s (stopping)", child.shard, child.popen.pid, how)
        else:
            log.warning("shard %d (pid %d) ended with %s after %.1fs; restarting in %.1fs",
                        child.shard, child.popen.pid, how, lived, child.backoff)
        child.popen = None

    def run(self) -> NoReturn:
        self.prepare()
        log.info("logspool supervisor (pid %d): %d processes, one per spool shard, listening on %s", os.getpid(),
                 self.shards, ", ".join(str(a) for a in self.listen))
        signal.signal(signal.SIGTERM, self._pass_on)
        signal.signal(signal.SIGHUP, self._pass_on)
        while True:
            if self.stopping and all(c.popen is None for c in self.children):
                log.info("logspool supervisor (pid %d): every shard has exited after SIGTERM; exiting", os.getpid())
                sys.exit(0)
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None and child.restart_at <= now and not self.stopping:
                    self._start(child)
            waits = [c.restart_at for c in self.children if c.restart_at is not None and not self.stopping]
            timeout = max(0.0, min(waits) - time.monotonic()) if waits else None
            running = {c.pidfd: c for c in self.children if c.popen is not None}
            ready, _, _ = select.select(list(running), [], [], timeout)
            for fd in ready:
                self._reap(running[fd])


def supervise(config: Config) -> NoReturn:
    Supervisor(config).run()


# -- the child's side -----------------------------------------------------------


def follow_parent(parent_pid: int) -> bool:
    """Die with the supervisor: ask for SIGKILL when the parent dies, then check it had not died already.

    Returns whether the kernel took the request. When it did not (no prctl:
    not Linux), the caller must run ``watch_parent``'s polling instead.
    """
    armed = False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        else:
            armed = True
    except (OSError, AttributeError):
        log.warning("no prctl here: a shard notices its supervisor's death by polling only")
    if os.getppid() != parent_pid:
        log.error("supervisor %d is gone; shard exits", parent_pid)
        os._exit(1)
    return armed


async def watch_parent(parent_pid: int) -> None:
    """The fallback for ``follow_parent``: poll ``getppid`` (it changes when the parent dies)."""
    import trio

    while True:
        await trio.sleep(PARENT_POLL)
        if os.getppid() != parent_pid:
            log.error("supervisor %d is gone; shard exits", parent_pid)
            os._exit(1)
