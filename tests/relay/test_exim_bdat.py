"""Exim (Debian's exim4-daemon-light) sending to the relay with BDAT (RFC 3030).

Exim is unpacked, never installed, into the repository's ``var/exim`` by
``tools/exim_unpack.sh`` (``make sysdeps``). Each message is handed to
``exim4 -C CONFIG -odf`` (foreground delivery), whose only route is a
``manualroute`` to the relay's port with ``hosts_try_chunking = *``; the
relay sends it on to the test's ``NextHop``. That Exim used BDAT is in its
own log: a delivery line with the ``K`` flag (CHUNKING used).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from relay_support import NextHop, relay_config, start_relay

EXIM = Path(__file__).resolve().parents[2] / "var" / "exim" / "usr" / "sbin" / "exim4"
CONFIG = """\
primary_hostname = exim.test
spool_directory = {dir}/spool
log_file_path = {dir}/%slog
exim_path = {exim}
begin routers
to_relay:
  driver = manualroute
  route_list = * 127.0.0.1
  transport = relay_smtp
  self = send
begin transports
relay_smtp:
  driver = smtp
  port = {port}
  hosts_try_chunking = *
  hosts_avoid_tls = *
  allow_localhost
"""


@pytest.fixture
def exim_dir() -> Iterator[Path]:
    """A directory Exim's own user may write (its spool and logs), outside pytest's 0700 tree; removed after."""
    assert EXIM.exists(), f"Exim is a peer of this test: run tools/exim_unpack.sh (make sysdeps); no {EXIM}"
    base = Path(tempfile.mkdtemp(prefix="logspool-exim-"))
    os.chmod(base, 0o755)
    shutil.chown(base, "Debian-exim", "Debian-exim")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def exim_send(directory: Path, port: int, sender: str, rcpt: str, message: bytes) -> None:
    config = directory / "exim.conf"
    config.write_text(CONFIG.format(dir=directory, exim=EXIM, port=port))
    done = subprocess.run([str(EXIM), "-C", str(config), "-odf", "-f", sender, rcpt], input=message,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")


async def test_exim_sends_to_the_relay_with_bdat(tmp_path: Path, exim_dir: Path) -> None:
    small = b"Subject: small\n\nhello from exim\n"
    big = b"Subject: big\n\n" + b"".join(b".%06d a line of a message too big for one chunk\n" % i for i in range(6000))
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            hop_port = await hop.start(nursery)
            relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"}))
            for message, rcpt in ((small, "one@far.example"), (big, "two@far.example")):
                await trio.to_thread.run_sync(exim_send, exim_dir, relay.ports[0], "sender@exim.test", rcpt, message)
            got = {m.recipients[0]: m for m in await hop.wait_messages(2)}
            nursery.cancel_scope.cancel()
    mainlog = (exim_dir / "mainlog").read_text(errors="replace")
    delivered = re.findall(r"=> (\S+) R=to_relay T=relay_smtp H=127\.0\.0\.1 \[127\.0\.0\.1\] (.*)", mainlog)
    assert sorted(rcpt for rcpt, _ in delivered) == ["one@far.example", "two@far.example"]
    assert all(re.search(r"(^| )K( |$)", flags) and 'C="250 2.0.0 Ok: queued as' in flags
               for _, flags in delivered), delivered
    assert got["one@far.example"].data.endswith(b"\r\n\r\nhello from exim\r\n")
    assert got["two@far.example"].data.endswith(big.split(b"\n\n", 1)[1].replace(b"\n", b"\r\n"))
    assert len(got["two@far.example"].data) > 300_000
