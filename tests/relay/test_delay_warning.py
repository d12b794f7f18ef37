"""``[delivery] delay_warning``: one delay notice (RFC 3464, ``Action: delayed``) to the sender, never for ``<>``.

A real relay in this process over TCP on 127.0.0.1: the next hop defers
every recipient, the retry interval is a second and ``delay_warning`` one
second, so the second attempt of each message finds it old enough. The
sender's notice lands in the relay's Maildir (its domain is local); the
message is tried again and again, and no second notice follows; the message
from the null sender gets none (issue 25: the setting was accepted and did
nothing).
"""

from __future__ import annotations

import email
import email.message
import email.policy
import logging
import smtplib
from pathlib import Path

import pytest
import trio
from logfmt import events
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.smtp.common import Reply
from spool.format.record import Status


def send(port: int, sender: str, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.mail(sender)[0] == 250
        assert s.rcpt(rcpt)[0] == 250
        assert s.data(f"Subject: slow\r\nMessage-ID: <{rcpt}>\r\n\r\nbody\r\n".encode())[0] == 250


async def test_a_delayed_message_gets_one_delay_notice_and_a_null_sender_none(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta.delivery")
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            hop = NextHop(lambda stage, value: Reply(451, "4.7.1", "greylisted") if stage == "rcpt" else None)
            port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{port}"},
                               retry='["1s"]', extra='[delivery]\ndelay_warning = "1s"\n')
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            await trio.to_thread.run_sync(send, relay.ports[0], "alice@localhost", "a@far.example")
            await trio.to_thread.run_sync(send, relay.ports[0], "", "b@far.example")
            await watch.wait_for(Status.DELIVERED, 1, recipient="alice@localhost")  # the notice
            await watch.wait_for(Status.DEFERRED, 4, recipient="a@far.example")
            await watch.wait_for(Status.DEFERRED, 4, recipient="b@far.example")
            nursery.cancel_scope.cancel()
    new = tmp_path / "maildir" / "alice" / "new"
    (name,) = [p.name for p in new.iterdir()]
    notice = email.message_from_bytes((new / name).read_bytes(), policy=email.policy.default)
    assert notice["Subject"] == "Delayed Mail (still being retried)"
    status = list(notice.iter_parts())[1].get_payload()
    assert isinstance(status, list)
    per_recipient = status[1]
    assert isinstance(per_recipient, email.message.Message)
    assert (per_recipient["Action"], per_recipient["Status"]) == ("delayed", "4.7.1")
    assert "a@far.example" in per_recipient["Final-Recipient"]
    assert watch.count(Status.DELIVERED) == 1  # one notice: none for the null sender, none a second time
    (logged,) = events([r for r in caplog.records if r.name == "mta.delivery"], "delay_notice")
    assert logged["to"] == "<alice@localhost>"
