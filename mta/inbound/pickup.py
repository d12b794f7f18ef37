"""The relay's side of the drop directory: messages ``sendmail`` left there are taken into the spool.

At start, and every ``[sendmail] pickup_interval`` after, each whole file in
``<drop_dir>/new/`` (``mta.inbound.maildrop``) is read, enqueued (the same
group commit as mail over SMTP: durable when ``enqueue`` returns) and only
then removed. A crash between the two takes the file in again at the next
start: a message is never lost, and at worst queued twice in that one window
(Postfix's pickup has the same). A file that is no drop file is moved to
``<drop_dir>/bad/`` with a WARNING and never read again; a full disk leaves
the rest for the next pass. Local submission is trusted as a client in
``mynetworks`` is: its recipients are not checked against relay control.
Only shard 0 takes mail in, so shards never take the same file.
"""

from __future__ import annotations

import email.utils
import logging
import os
import re

import trio

from mta.config import Config
from mta.inbound.maildrop import DropFileError, decode
from mta.observe.logline import event
from spool import AsyncSpool, DiskFull

log = logging.getLogger("mta.pickup")

_UNSAFE = re.compile(r"[^!-'*-~]")  # what may stand in a header comment: printable ASCII but the parentheses


def _received(by: str, user: str, queue_id: str) -> bytes:
    who = _UNSAFE.sub("?", user)[:64] or "unknown"
    return (f"Received: by {by} (logspool, from local user {who})\r\n\tid {queue_id}; "
            f"{email.utils.formatdate(localtime=True)}\r\n").encode()


class Pickup:
    def __init__(self, aspool: AsyncSpool, config: Config) -> None:
        self.aspool = aspool
        self.config = config
        self.drop_dir = config.sendmail.drop_dir
        self.taken = 0  # messages taken in since start (tests read it)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take in what is there, report started, then look again every ``pickup_interval``."""
        await self.take_in()
        task_status.started()
        while True:
            await trio.sleep(self.config.sendmail.pickup_interval)
            await self.take_in()

    async def take_in(self) -> int:
        """One pass over ``new/``: the number of messages taken in."""
        new = os.path.join(self.drop_dir, "new")
        try:
            names = sorted(await trio.to_thread.run_sync(os.listdir, new))
        except FileNotFoundError:
            return 0
        except OSError as exc:
            event(log, "pickup_failed", level=logging.ERROR, dir=new, error=exc.strerror or str(exc))
            return 0
        taken = 0
        for name in names:
            path = os.path.join(new, name)
            try:
                if not await self._one(path):
                    break
            except OSError as exc:  # one unreadable file: the others still go in
                event(log, "pickup_failed", level=logging.ERROR, file=path, error=exc.strerror or str(exc))
                continue
            taken += 1
        self.taken += taken
        return taken

    async def _one(self, path: str) -> bool:
        """Enqueue one file, then remove it; False: the disk is full, stop this pass."""
        data = await trio.to_thread.run_sync(_read, path)
        try:
            dropped = decode(data)
        except DropFileError as exc:
            bad = os.path.join(self.drop_dir, "bad")
            os.makedirs(bad, mode=0o700, exist_ok=True)
            os.rename(path, os.path.join(bad, os.path.basename(path)))
            event(log, "pickup_bad_file", level=logging.WARNING, file=path, moved_to=bad, error=str(exc))
            return True
        core = self.aspool.core
        body = self.aspool.begin_body(first=lambda mid: _received(self.config.server.hostname, dropped.user,
                                                                  core.queue_id(mid)))
        body.write(dropped.message)
        try:
            mid = await self.aspool.enqueue(dropped.sender, dropped.recipients, body,
                                            extra={"client": "local", "local_user": dropped.user})
        except DiskFull as exc:
            event(log, "pickup_deferred", level=logging.WARNING, file=path, error=str(exc))
            return False
        os.unlink(path)  # after the commit: a crash before it takes the file in again (module docstring)
        event(log, "pickup", core.queue_id(mid), from_=f"<{dropped.sender}>", user=dropped.user,
              nrcpt=len(dropped.recipients), size=len(dropped.message))
        return True


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
