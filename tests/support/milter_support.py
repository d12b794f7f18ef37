"""SMTP transactions for the filter tests, every reply kept by step (a refusal is an outcome, not an exception)."""

from __future__ import annotations

import smtplib
from pathlib import Path

import trio
from daemon_support import SUPPORT, SYSTEM_PYTHON, Daemon, free_port


def start_test_milter(where: Path) -> tuple[int, Daemon]:
    """The python3-milter test filter (``milter_filter.py``) on a free port of 127.0.0.1: its port and process."""
    port = free_port()
    argv = [SYSTEM_PYTHON, str(SUPPORT / "milter_filter.py"), f"inet:{port}@127.0.0.1"]
    return port, Daemon(argv, where / "milter.log").start([port])


def message(subject: str, extra: str = "", body: str = "hello\r\n") -> bytes:
    return (f"From: alice@example.com\r\nTo: bob@dest.test\r\nSubject: {subject}\r\n{extra}"
            f"Message-ID: <{subject.replace(' ', '-')}@example.com>\r\n\r\n{body}").encode()


def _transaction(port: int, sender: str, rcpts: list[str], data: bytes) -> dict[str, tuple[int, bytes]]:
    """One transaction, every reply kept by step (``rcpt:ADDRESS``, ``mail``, ``data``); stops at a refusal."""
    got: dict[str, tuple[int, bytes]] = {}
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.ehlo("client.test")
        got["mail"] = s.mail(sender)
        if got["mail"][0] != 250:
            return got
        for r in rcpts:
            got[f"rcpt:{r}"] = s.rcpt(r)
        if any(got[f"rcpt:{r}"][0] == 250 for r in rcpts):
            got["data"] = s.data(data)
    return got


async def transaction(port: int, sender: str, rcpts: list[str], data: bytes) -> dict[str, tuple[int, bytes]]:
    return await trio.to_thread.run_sync(_transaction, port, sender, rcpts, data)
