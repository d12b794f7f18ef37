"""OpenDKIM as a signing milter on the real relay: what it signs verifies with dkimpy.

OpenDKIM (Debian's ``opendkim``) runs in signing mode on 127.0.0.1 with a key
made by ``opendkim-genkey`` in the module's tmp dir. dkimpy verifies each
delivered message against the TXT record genkey wrote; a message changed
after signing would fail, so this also proves that what the milter saw is
what the relay stored and delivered, byte for byte.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import dkim
import pytest
import trio
from daemon_support import Daemon, free_port
from milter_support import message, start_test_milter, transaction
from relay_support import NextHop, relay_config, start_relay


@pytest.fixture(scope="module")
def opendkim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, bytes]]:
    """OpenDKIM's port, and the DNS TXT record of its key."""
    where = tmp_path_factory.mktemp("opendkim")
    subprocess.run(["opendkim-genkey", "-D", str(where), "-d", "example.com", "-s", "s1", "-b", "1024"], check=True)
    record = "".join(re.findall(r'"([^"]*)"', (where / "s1.txt").read_text())).encode()
    port = free_port()
    conf = where / "opendkim.conf"
    conf.write_text(f"Syslog no\nMode s\nSocket inet:{port}@127.0.0.1\nDomain example.com\nSelector s1\n"
                    f"KeyFile {where / 's1.private'}\nCanonicalization relaxed/relaxed\nPidFile {where / 'pid'}\n"
                    "Background no\nRequireSafeKeys no\nSignatureAlgorithm rsa-sha256\n")
    daemon = Daemon(["opendkim", "-f", "-x", str(conf)], where / "opendkim.log").start([port])
    yield port, record
    daemon.stop()


@pytest.fixture(scope="module")
def test_milter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port, daemon = start_test_milter(tmp_path_factory.mktemp("milter"))
    yield port
    daemon.stop()


def _txt(record: bytes) -> Callable[..., bytes | None]:
    def txt(name: bytes, timeout: int = 5) -> bytes | None:
        return record if name == b"s1._domainkey.example.com." else None
    return txt


async def test_milters_in_order_the_second_signs_what_the_first_changed(tmp_path: Path, opendkim: tuple[int, bytes],
                                                                       test_milter: int) -> None:
    """The test milter rewrites the body and headers, then OpenDKIM signs: it saw the changed message."""
    port, record = opendkim
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        chain = f'["inet:{test_milter}@127.0.0.1", "inet:{port}@127.0.0.1"]'
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"},
                           extra=f"\n[filters]\nsmtp_milters = {chain}\n")
        relay = await start_relay(nursery, cfg)
        for subject in ("body", "headers"):
            got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], message(subject))
            assert got["data"][0] == 250
        replaced, headers = await hop.wait_messages(2)
        assert replaced.data.endswith(b"the body the milter wrote\r\nline two\r\n")
        assert b"X-Inserted: inserted first" in headers.data
        for m in (replaced, headers):
            assert dkim.verify(m.data, dnsfunc=_txt(record))
        nursery.cancel_scope.cancel()


async def test_mail_signed_by_opendkim_through_the_relay_verifies(tmp_path: Path,
                                                                  opendkim: tuple[int, bytes]) -> None:
    port, record = opendkim
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"},
                           extra=f'\n[filters]\nsmtp_milters = ["inet:{port}@127.0.0.1"]\n')
        relay = await start_relay(nursery, cfg)
        bodies = [message("signed small"), message("signed large", "Date: Thu, 26 Nov 2026 10:00:00 +0000\r\n",
                                                    body="a line of a larger message\r\n" * 20_000)]
        for data in bodies:
            got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"], data)
            assert got["data"][0] == 250
        delivered = await hop.wait_messages(2)

        txt = _txt(record)
        for m in delivered:
            assert b"DKIM-Signature:" in m.data and b"d=example.com" in m.data
            assert dkim.verify(m.data, dnsfunc=txt)
            assert not dkim.verify(m.data.replace(b"a line of", b"a line Of").replace(b"hello", b"jello"),
                                   dnsfunc=txt)
        nursery.cancel_scope.cancel()
