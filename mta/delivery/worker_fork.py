"""Delivery workers forked from the relay before its event loop starts, so they share its pages.

Why. A worker started as a new interpreter (``python -m
mta.delivery.worker_main``) imports trio, ssl, dnspython, cbor2 and the SMTP
client again: about 30 MB of its own, for a process that runs the code the
relay has already loaded. A process forked from the relay shares every page
of that code and of the imported modules with it until one of them writes
to the page. The relay cannot fork once it runs: by then it runs trio and
threads (the committer's), and a child forked from a threaded process may
inherit a lock another thread held. So ``prefork``, called by ``mta serve``
before the relay's trio loop starts, imports what a worker needs, freezes
the heap (``gc.freeze``: the collector then never writes to those objects,
so their pages stay shared, in the relay too) and forks the workers' first
lives; ``mta.delivery.workers`` adopts them.

A worker started again after a death is a new interpreter, as before: the
relay is threaded by then. A forker process kept for those restarts (forked
early, forking on request) was measured: it held 8 MB of its own, the pages
both the relay and the worker had written since, for an event that a
healthy relay never sees (docs/benchmarks.md, "Delivery workers").

A forked worker is the relay's child: the relay reaps it through a pidfd
(its return code as ``subprocess`` gives it, ``-9`` for SIGKILL) and kills it
through the same pidfd, never by a pid that may have been reused.

A relay run inside another program's trio loop (the tests, the benchmarks'
in-process relay) is threaded already and starts every worker as a new
interpreter.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import traceback
from typing import NoReturn

import trio

from mta.delivery import worker_main

log = logging.getLogger("mta.workers")


class Forked:
    """A worker forked by ``prefork``, as ``mta.delivery.workers`` drives a process: pid, kill, wait."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock: socket.socket | None = sock  # the relay's end; taken by the worker's first life
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def wait(self) -> int:
        if self.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)  # readable once the child has exited
            _, status = os.waitpid(self.pid, 0)  # noqa: ASYNC222 -- it has exited: waitpid only reaps it
            self.returncode = os.waitstatus_to_exitcode(status)
            os.close(self._pidfd)
        return self.returncode


def prefork(count: int) -> list[Forked]:
    """Fork ``count`` delivery workers; call before any thread or trio loop of this process is started."""
    import mta.delivery.smtp_transport  # noqa: F401  # imported before the fork, so the workers share it

    if count == 0:
        return []
    gc.collect()
    gc.freeze()  # what is alive now is code and config: kept, and its pages left alone by every collection
    workers: list[Forked] = []
    for index in range(count):
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = os.fork()
        except OSError as exc:  # out of processes or descriptors: the rest start later, as new interpreters
            log.warning("could not fork delivery worker %d before the event loop (%s): it starts as a new "
                        "interpreter", index, exc)
            break
        if pid == 0:  # pragma: no cover - the worker (covered through the relay's tests)
            ours.close()
            for earlier in workers:
                if earlier.sock is not None:
                    earlier.sock.close()
            _worker(theirs, index)
        theirs.close()
        try:
            workers.append(Forked(pid, ours))
        except OSError as exc:  # no pidfd (a kernel before 5.3): this one is not ours to reap; no more forks
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            ours.close()
            log.warning("could not watch forked delivery worker %d (%s): workers start as new interpreters",
                        index, exc)
            break
    return workers


def _worker(sock: socket.socket, index: int) -> NoReturn:
    """The forked worker's life: its loop on its socket, then out (never back into the relay's code)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the relay's Ctrl-C line is the relay's alone
        gc.enable()
        code = worker_main.serve(sock, index)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)
