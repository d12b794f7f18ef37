"""Short of disk: refuse new mail with 452, keep what was accepted, resume by itself (docs/security.md).

The first test runs the spool on a real 8 MiB tmpfs (mounting needs root,
which the project's test environment has); where the mount is refused it
falls back to the injectable free-space function over a real ``statvfs``
shifted to look like the same small filesystem, and says so in its output.
The second test drives the injectable function directly.
"""

from __future__ import annotations

import contextlib
import os
import smtplib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import trio
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.app import Relay
from mta.server import SmtpServer, free_bytes
from mta.smtp_common import Reply
from spool.record import Status

FS_SIZE = 8 << 20
MINFREE = 4 << 20


@contextlib.contextmanager
def small_filesystem(path: Path) -> Iterator[bool]:
    """A tmpfs of FS_SIZE at ``path``; yields whether the mount happened."""
    path.mkdir(mode=0o700)
    try:
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE},mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
        mounted, why = run.returncode == 0, run.stderr.strip()
    except OSError as exc:
        mounted, why = False, str(exc)
    if not mounted:
        print(f"tmpfs mount refused ({why}); using the injectable free-space function")
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def mail(port: int, rcpt: str, subject: str) -> int:
    """The reply code to MAIL FROM, or to the end of DATA if MAIL was accepted."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo()
        code, _ = s.mail("a@example.org")
        if code != 250:
            return code
        s.rcpt(rcpt)
        return s.data(f"Subject: {subject}\r\n\r\nbody\r\n")[0]


async def extra_server(nursery: trio.Nursery, relay: Relay, free_space: Callable[[str], int]) -> int:
    """A second SMTP listener on the relay's spool with a free-space function of the test's choosing."""
    server = SmtpServer(relay.config, relay.aspool, relay.metrics, free_space=free_space)
    listeners = await nursery.start(server.serve)
    return int(listeners[0].socket.getsockname()[1])


async def test_below_queue_minfree_mail_gets_452_and_queued_mail_is_kept(tmp_path: Path) -> None:
    blocked = True

    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.3.0", "not yet") if blocked and stage == "rcpt" else None

    fs = tmp_path / "spool"  # the spool directory is the small filesystem's root
    with small_filesystem(fs) as mounted:
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            hop_port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"},
                               spool_extra=f'queue_minfree = {MINFREE}\nsegment_size = "256k"\n')
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            # Without a mount, pretend the filesystem is FS_SIZE big, from the real statvfs.
            offset = 0 if mounted else free_bytes(str(fs)) - FS_SIZE
            port = relay.ports[0] if mounted else await extra_server(
                nursery, relay, lambda p: free_bytes(p) - offset)

            assert await trio.to_thread.run_sync(mail, port, "kept@far.example", "accepted before") == 250
            await watch.wait_for(Status.DEFERRED, 1, recipient="kept@far.example")

            filler = fs / "filler"
            filler.write_bytes(b"\0" * (free_bytes(str(fs)) - offset - MINFREE // 2))
            assert free_bytes(str(fs)) - offset < MINFREE
            code = await trio.to_thread.run_sync(mail, port, "new@far.example", "while full")
            assert code == 452
            # The queued message is untouched: it is retried (and deferred again) while the disk is short.
            await watch.wait_for(Status.DEFERRED, 2, recipient="kept@far.example")

            filler.unlink()
            blocked = False
            assert await trio.to_thread.run_sync(mail, port, "new@far.example", "after space returned") == 250
            await watch.wait_for(Status.DELIVERED, 1, recipient="kept@far.example")
            await watch.wait_for(Status.DELIVERED, 1, recipient="new@far.example")
            msgs = await hop.wait_messages(2)
            assert sorted(m.recipients[0] for m in msgs) == ["kept@far.example", "new@far.example"]
            assert all(b"while full" not in m.data for m in msgs)
            nursery.cancel_scope.cancel()


async def test_disk_check_at_mail_and_at_end_of_data_with_injected_free_space(tmp_path: Path) -> None:
    free = {"bytes": 1 << 40}
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"localhost": "maildir:maildir"}))
        watch = DeliveryWatch(relay)
        port = await extra_server(nursery, relay, lambda p: free["bytes"])

        def session() -> list[int]:
            with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
                s.ehlo()
                codes = [s.mail("a@example.org")[0], s.rcpt("someone@localhost")[0]]
                free["bytes"] = 0  # the disk fills while the client is in the middle of a message
                codes.append(s.data(b"Subject: x\r\n\r\nbody\r\n")[0])
                codes.append(s.mail("a@example.org")[0])
                free["bytes"] = 1 << 40
                codes.append(s.mail("a@example.org")[0])
                codes.append(s.rcpt("someone@localhost")[0])
                codes.append(s.data(b"Subject: y\r\n\r\nbody\r\n")[0])
                return codes

        assert await trio.to_thread.run_sync(session) == [250, 250, 452, 452, 250, 250, 250]
        await watch.wait_for(Status.DELIVERED, 1)
        box = tmp_path / "maildir" / "someone" / "new"
        (name,) = os.listdir(box)
        assert b"Subject: y" in (box / name).read_bytes()
        nursery.cancel_scope.cancel()
