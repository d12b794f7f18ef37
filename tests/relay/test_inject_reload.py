"""The HTTP API's tokens are read again on SIGHUP: a token taken out is refused from then on, a new one is
taken; a tokens file that cannot serve (open to other users) fails the reload and the old tokens stay.

The relay is its own process (``mta serve``), reloaded with a real SIGHUP.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio
from http_client import inject
from inject_support import TOKEN, ApiRelay, started, write_config

pytestmark = pytest.mark.slow

BASIC = {"envelope_sender": "noreply@example.com", "content": "Subject: hello\n\nHello there",
         "recipients": [{"email": "recipient@example.com"}]}


async def hup(relay: ApiRelay, what: str) -> None:
    """SIGHUP, and wait for the reload's own line (``what``: ``event=reload`` or ``event=reload_failed``)."""
    before = sum(what + " " in line for line in relay.lines)
    assert relay.proc is not None
    relay.proc.send_signal(signal.SIGHUP)
    await relay.wait_output(lambda: sum(what + " " in line for line in relay.lines) > before, 30, what)


async def test_a_reload_reads_the_tokens_again(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    async with trio.open_nursery() as nursery:
        relay = await started(nursery, config)
        port = relay.http_port
        assert (await inject(port, BASIC, token=TOKEN)).status == 200
        assert (await inject(port, BASIC, token="new-token")).status == 401

        tokens = tmp_path / "tokens"
        tokens.write_text("new-token\n")  # the old token revoked, a new one issued
        os.chmod(tokens, 0o600)
        await hup(relay, "event=reload")
        assert any("files_read_again=" in line and "http.tokens_file" in line for line in relay.lines)
        assert (await inject(port, BASIC, token=TOKEN)).status == 401
        assert (await inject(port, BASIC, token="new-token")).status == 200

        tokens.write_text("third-token\n")
        os.chmod(tokens, 0o644)  # others may read it: not taken, the relay serves on with what it had
        await hup(relay, "event=reload_failed")
        assert any("is open to other users" in line for line in relay.lines)
        assert (await inject(port, BASIC, token="third-token")).status == 401
        assert (await inject(port, BASIC, token="new-token")).status == 200
        nursery.cancel_scope.cancel()
