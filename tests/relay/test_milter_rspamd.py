"""rspamd on the real relay, both ways in: its proxy worker as a milter, and its normal worker over HTTP.

The GTUBE message is refused with rspamd's own reply and nothing is stored;
a clean message is delivered with the headers rspamd asked for
(``X-Spamd-Result``, ``X-Rspamd-Server``), and rspamd's "rewrite subject"
and "add header" actions change what is delivered. One rspamd for the module
(``rspamd_support``): its start is the slow part.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from milter_support import message, transaction
from relay_support import NextHop, relay_config, start_relay
from rspamd_support import GTUBE, Rspamd, start_rspamd


@pytest.fixture(scope="module")
def rspamd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rspamd]:
    running = start_rspamd(tmp_path_factory.mktemp("rspamd"))
    yield running
    running.daemon.stop()


def way_in(rspamd: Rspamd, how: str) -> str:
    if how == "milter":
        return f'\n[filters]\nsmtp_milters = ["inet:{rspamd.milter_port}@127.0.0.1"]\n'
    return f'\n[filters]\nrspamd_url = "{rspamd.url}"\n'


@pytest.mark.parametrize("how", ["milter", "http"])
async def test_gtube_is_refused_with_rspamds_reply_and_clean_mail_gets_its_headers(tmp_path: Path, rspamd: Rspamd,
                                                                                   how: str) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"}, extra=way_in(rspamd, how))
        relay = await start_relay(nursery, cfg)
        spam = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"],
                                 message("spam", body=f"{GTUBE}\r\n"))
        code, text = spam["data"]
        assert code == 554 and text.startswith(b"5.7.1 ") and b"Gtube pattern" in text
        clean = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"],
                                  message("clean", "Date: Thu, 26 Nov 2026 10:00:00 +0000\r\n"))
        assert clean["data"][0] == 250
        (m,) = await hop.wait_messages(1)
        assert b"Subject: clean" in m.data and b"\r\nX-Spamd-Result: default: False [" in m.data
        assert b"\r\nX-Rspamd-Server: " in m.data
        nursery.cancel_scope.cancel()


DATE = "Date: Thu, 26 Nov 2026 10:00:00 +0000\r\n"


@pytest.mark.parametrize("how", ["http", "milter"])
async def test_rewrite_subject_and_add_header_are_what_is_delivered(tmp_path: Path, rspamd: Rspamd,
                                                                    how: str) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"}, extra=way_in(rspamd, how))
        relay = await start_relay(nursery, cfg)
        for subject, action in (("first words", "rewrite"), ("second words", "add"), ("third words", "none")):
            got = await transaction(relay.ports[0], "alice@example.com", ["bob@dest.test"],
                                    message(subject, DATE + f"X-Test-Action: {action}\r\n"))
            assert got["data"][0] == 250, got
        by_id = {m.data.split(b"Message-ID: <", 1)[1].split(b"@", 1)[0]: m for m in await hop.wait_messages(3)}
        rewritten, added, untouched = by_id[b"first-words"], by_id[b"second-words"], by_id[b"third-words"]
        assert b"\r\nSubject: [rspamd says] first words\r\n" in rewritten.data
        assert b"Subject: first words" not in rewritten.data
        assert b"\r\nX-Spam: Yes\r\n" in added.data and b"\r\nSubject: second words\r\n" in added.data
        assert b"X-Spam: Yes" not in untouched.data and b"\r\nSubject: third words\r\n" in untouched.data
        nursery.cancel_scope.cancel()
