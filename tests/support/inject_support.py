"""The relay process with its HTTP API for the injection tests: its config, its API's port, its Maildir."""

from __future__ import annotations

import email
import email.message
import email.policy
import os
import re
from pathlib import Path

import trio
from process_support import RelayProcess

TOKEN = "secret-token"
HTTP_LISTENING = re.compile(r"HTTP API listening on 127\.0\.0\.1:(\d+)")


def write_config(tmp: Path, *, spool_extra: str = "", http_extra: str = "", mode: int = 0o600) -> Path:
    (tmp / "tokens").write_text(f"# the API's clients\n{TOKEN}\nother-token  # a second client\n")
    os.chmod(tmp / "tokens", mode)
    config = tmp / "relay.toml"
    config.write_text(f"""
[server]
listen = ["127.0.0.1:0"]
hostname = "relay.test"
[spool]
dir = "spool"
{spool_extra}
[routes]
"*" = "maildir:mail"
[http]
listen = "127.0.0.1:0"
tokens_file = "tokens"
{http_extra}
""")
    return config


class ApiRelay(RelayProcess):
    """The relay process and the port its HTTP API was given."""

    http_port = 0

    async def start(self, nursery: trio.Nursery) -> None:
        await super().start(nursery)
        await self.wait_output(self._http, 30, "HTTP API listening")

    def _http(self) -> bool:
        for line in self.lines:
            if m := HTTP_LISTENING.search(line):
                self.http_port = int(m.group(1))
        return bool(self.http_port)


async def started(nursery: trio.Nursery, config: Path) -> ApiRelay:
    relay = ApiRelay(config)
    await relay.start(nursery)
    return relay


def delivered(tmp: Path) -> list[email.message.EmailMessage]:
    out = []
    for path in sorted((tmp / "mail").glob("*/new/*")):
        msg = email.message_from_bytes(path.read_bytes(), policy=email.policy.default)
        assert isinstance(msg, email.message.EmailMessage)
        out.append(msg)
    return out


async def wait_delivered(tmp: Path, n: int, timeout: float = 60) -> list[email.message.EmailMessage]:
    with trio.fail_after(timeout):
        while len(msgs := delivered(tmp)) < n:
            await trio.sleep(0.05)  # polled: the maildir is the relay's output, it has no event to wait on
    return msgs
