"""Postfix 3.7 as the relay's next hop: DSN requests (a DSN-capable Postfix takes them, one without DSN gets a
"relayed" notice sent by the relay) and the body sent in BDAT chunks (RFC 3030).

A private Postfix instance (``tools/bench/postfix_instance.py``) listens on
two ports of 127.0.0.1: one as Postfix ships, one with ``-o
smtpd_discard_ehlo_keywords=dsn`` (a next hop that does not offer DSN). It
relays everything on to a ``NextHop`` of the test, which records the
parameters Postfix passed on: the proof that Postfix received them. That
the relay spoke BDAT is in Postfix's own log: smtpd counts the commands of a
session when it ends (``disconnect from ... bdat=2 ...``).
"""

from __future__ import annotations

import email
import email.message
import email.policy
import os
import re
import shutil
import smtplib
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from spool.format.record import Status

_BENCH = str(Path(__file__).resolve().parents[2] / "tools" / "bench")
if _BENCH not in sys.path:  # the benchmarks' Postfix instance, imported by name as its neighbours import it
    sys.path.insert(0, _BENCH)
from postfix_instance import SERVICES, PostfixInstance, check_installed  # noqa: E402

SENDER = "alice@localhost"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TwoPortPostfix(PostfixInstance):
    """The instance with a second smtpd listener that offers no DSN."""

    def __init__(self, base: str, port: int, no_dsn_port: int, sink_port: int) -> None:
        super().__init__(base, port, sink_port)
        self.no_dsn_port = no_dsn_port

    def write_config(self) -> None:
        super().write_config()
        with open(Path(self.config_dir) / "master.cf", "w") as f:
            f.write(SERVICES.format(listen=f"127.0.0.1:{self.port}"))
            f.write(f"127.0.0.1:{self.no_dsn_port} inet n - n - - smtpd -o smtpd_discard_ehlo_keywords=dsn\n")


@pytest.fixture
def postfix() -> Iterator[TwoPortPostfix]:
    """The instance, in a directory of its own outside pytest's (whose 0700 parents the postfix user cannot
    pass), removed after."""
    missing = check_installed()
    assert not missing, f"Postfix is a peer of this test (make sysdeps): missing {missing}"
    base = tempfile.mkdtemp(prefix="logspool-postfix-")
    os.chmod(base, 0o755)
    instance = TwoPortPostfix(os.path.join(base, "pf"), free_port(), free_port(), free_port())
    try:
        instance.start()
        yield instance
    finally:
        instance.stop()
        shutil.rmtree(base, ignore_errors=True)


def send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.mail(SENDER, ["RET=HDRS", "ENVID=pf+2Btest"])[0] == 250
        assert s.rcpt(rcpt, ["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;first@orig.example"])[0] == 250
        assert s.data(b"Subject: via postfix\r\n\r\nhello\r\n")[0] == 250


async def test_postfix_takes_the_request_or_the_relay_says_relayed(tmp_path: Path, postfix: TwoPortPostfix) -> None:
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            sink = NextHop()
            await sink.start(nursery, port=postfix.sink_port)
            routes = {"localhost": "maildir:maildir", "dsn.example": f"smtp://127.0.0.1:{postfix.port}",
                      "nodsn.example": f"smtp://127.0.0.1:{postfix.no_dsn_port}"}
            relay = await start_relay(nursery, relay_config(str(tmp_path), routes))
            watch = DeliveryWatch(relay)
            await trio.to_thread.run_sync(send, relay.ports[0], "bob@dsn.example")
            await trio.to_thread.run_sync(send, relay.ports[0], "carol@nodsn.example")
            got = await sink.wait_messages(2, timeout=60)
            await watch.wait_for(Status.DELIVERED, 1, recipient=SENDER)  # the one "relayed" notice
            nursery.cancel_scope.cancel()
    by_rcpt = {m.recipients[0]: m for m in got}
    through = by_rcpt["bob@dsn.example"]
    assert through.mail_params.get("RET") == "HDRS"
    assert through.mail_params.get("ENVID") == "pf+test"
    assert through.rcpt_params["bob@dsn.example"]["NOTIFY"] == "SUCCESS,FAILURE"
    assert through.rcpt_params["bob@dsn.example"]["ORCPT"] == "rfc822;first@orig.example"
    assert "NOTIFY" not in by_rcpt["carol@nodsn.example"].rcpt_params["carol@nodsn.example"]
    (name,) = list((tmp_path / "maildir" / "alice" / "new").iterdir())
    notice = email.message_from_bytes(name.read_bytes(), policy=email.policy.default)
    assert notice["Subject"] == "Successful Mail Delivery Report"
    assert isinstance(notice, email.message.EmailMessage)
    blocks = list(notice.iter_parts())[1].get_payload()
    assert isinstance(blocks, list)
    per_message, per_recipient = [b for b in blocks if isinstance(b, email.message.Message)]
    assert per_message["Original-Envelope-Id"] == "pf+test"
    assert "carol@nodsn.example" in per_recipient["Final-Recipient"]
    assert (per_recipient["Action"], per_recipient["Status"]) == ("relayed", "2.0.0")
    assert per_recipient["Original-Recipient"] == "rfc822; first@orig.example"
    assert per_recipient["Remote-MTA"] == "dns; 127.0.0.1"


async def test_the_body_goes_to_postfix_in_bdat_chunks(tmp_path: Path, postfix: TwoPortPostfix) -> None:
    body = b"Subject: big\r\n\r\n" + b"".join(b".line %05d of a body bigger than one chunk\r\n" % i
                                                 for i in range(2000))
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            sink = NextHop()
            await sink.start(nursery, port=postfix.sink_port)
            routes = {"*": f"smtp://127.0.0.1:{postfix.port}"}
            relay = await start_relay(nursery, relay_config(str(tmp_path), routes,
                                                            extra='[delivery]\nconnection_cache_time = "0s"\n'))

            def submit() -> None:
                with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                    s.sendmail("a@example.org", ["b@far.example"], body)

            await trio.to_thread.run_sync(submit)
            (got,) = await sink.wait_messages(1, timeout=60)
            maillog = Path(postfix.base) / "maillog"
            with trio.fail_after(30):  # Postfix writes the line once the relay has closed the connection
                while not re.search(r"disconnect from .*\bbdat=2\b", maillog.read_text(errors="replace")):
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert got.data.endswith(body.split(b"\r\n\r\n", 1)[1])  # every dot line as it was, through both
