"""DSN requests (RFC 3461) through the whole relay: smtplib asks, the next hop or the sender's Maildir shows the result.

A real relay in this process on 127.0.0.1; the next hop is the project's
own SMTP server (``NextHop``, which offers DSN and records the parameters it
was given); the sender's domain is local, so every notice the relay sends
lands in its Maildir and is read back field by field. Postfix as the next
hop is in ``test_dsn_postfix.py``.
"""

from __future__ import annotations

import email
import email.message
import email.policy
import logging
import smtplib
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio
from logfmt import events
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.smtp.common import Reply
from spool.format.record import Status

SENDER = "alice@localhost"
BODY = b"Subject: dsn test\r\nMessage-ID: <dsn@client.test>\r\n\r\nthe body line that only RET=FULL returns\r\n"


def send(port: int, rcpts: Sequence[tuple[str, list[str]]], mail_options: list[str]) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.ehlo("client.test")
        assert s.has_extn("dsn")
        assert s.mail(SENDER, mail_options)[0] == 250
        for rcpt, options in rcpts:
            assert s.rcpt(rcpt, options)[0] == 250
        assert s.data(BODY)[0] == 250


def notices(tmp_path: Path) -> list[email.message.EmailMessage]:
    new = tmp_path / "maildir" / "alice" / "new"
    out = []
    for path in sorted(new.iterdir()) if new.exists() else []:
        message = email.message_from_bytes(path.read_bytes(), policy=email.policy.default)
        assert isinstance(message, email.message.EmailMessage)
        out.append(message)
    return out


def status_blocks(notice: email.message.EmailMessage) -> list[email.message.Message]:
    """The per-message block, then one per recipient, of a notice's message/delivery-status part."""
    blocks = list(notice.iter_parts())[1].get_payload()
    assert isinstance(blocks, list)
    return [b for b in blocks if isinstance(b, email.message.Message)]


def refuse_bounce(stage: str, value: object) -> Reply | None:
    return Reply(550, "5.1.1", "no such user") if stage == "rcpt" and str(value).startswith("gone") else None


async def test_the_parameters_go_on_to_a_next_hop_that_offers_dsn(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta.delivery")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{port}"})
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            rcpts = [("bob@far.example", ["NOTIFY=SUCCESS,DELAY", "ORCPT=rfc822;orig+2Bbob@far.example"]),
                     ("carol@far.example", ["NOTIFY=never"])]
            await trio.to_thread.run_sync(send, relay.ports[0], rcpts, ["RET=HDRS", "ENVID=id+2Bwith+3Dsigns"])
            (got,) = await hop.wait_messages(1)
            await watch.wait_for(Status.DELIVERED, 2)
            nursery.cancel_scope.cancel()
    assert got.mail_params["RET"] == "HDRS"
    assert got.mail_params["ENVID"] == "id+with=signs"  # the core decodes what the relay encoded again
    assert got.rcpt_params["bob@far.example"] == {"NOTIFY": "SUCCESS,DELAY", "ORCPT": "rfc822;orig+bob@far.example"}
    assert got.rcpt_params["carol@far.example"]["NOTIFY"] == "NEVER"
    # The next hop took the request for SUCCESS: the notice is its to send, not the relay's.
    assert events([r for r in caplog.records if r.name == "mta.delivery"], "success_notice") == []
    assert notices(tmp_path) == []
    lines = events([r for r in caplog.records if r.name == "mta.delivery"], "delivery")
    assert {line["tls"] for line in lines} == {"none"}  # the mark of a passed request stays out of the log


async def test_never_sends_no_bounce_and_hdrs_returns_the_headers(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta.delivery")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            hop = NextHop(refuse_bounce)
            port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{port}"})
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            rcpts = [("gone1@far.example", ["NOTIFY=NEVER"]),
                     ("gone2@far.example", ["NOTIFY=FAILURE", "ORCPT=rfc822;first@orig.example"]),
                     ("gone3@far.example", ["NOTIFY=SUCCESS"])]
            await trio.to_thread.run_sync(send, relay.ports[0], rcpts, ["RET=HDRS", "ENVID=E-1"])
            await watch.wait_for(Status.BOUNCED, 3)
            await watch.wait_for(Status.DELIVERED, 1, recipient=SENDER)  # the one bounce
            nursery.cancel_scope.cancel()
    (notice,) = notices(tmp_path)
    assert notice["Subject"] == "Undelivered Mail Returned to Sender"
    per_message, *per_recipient = status_blocks(notice)
    assert per_message["Original-Envelope-Id"] == "E-1"
    assert len(per_recipient) == 1  # NEVER and a NOTIFY without FAILURE get no bounce
    assert "gone2@far.example" in per_recipient[0]["Final-Recipient"]
    assert per_recipient[0]["Original-Recipient"] == "rfc822; first@orig.example"
    returned = list(notice.iter_parts())[2]
    assert returned.get_content_type() == "text/rfc822-headers"
    assert b"only RET=FULL" not in returned.as_bytes()
    (bounce,) = events([r for r in caplog.records if r.name == "mta.delivery"], "bounce")
    assert bounce["nrcpt"] == "1"


async def test_full_returns_the_whole_message(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            hop = NextHop(refuse_bounce)
            port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{port}"})
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            await trio.to_thread.run_sync(send, relay.ports[0], [("gone@far.example", [])], ["RET=FULL"])
            await watch.wait_for(Status.DELIVERED, 1, recipient=SENDER)
            nursery.cancel_scope.cancel()
    (notice,) = notices(tmp_path)
    returned = list(notice.iter_parts())[2]
    assert returned.get_content_type() == "message/rfc822"
    assert b"the body line that only RET=FULL returns" in returned.as_bytes()


async def test_success_to_a_mailbox_is_a_delivered_notice(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "local.test": "maildir:boxes"})
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            rcpts = [("dan@local.test", ["NOTIFY=SUCCESS", "ORCPT=rfc822;daniel@old.example"]),
                     ("eve@local.test", [])]
            await trio.to_thread.run_sync(send, relay.ports[0], rcpts, ["ENVID=batch-7"])
            await watch.wait_for(Status.DELIVERED, 1, recipient=SENDER)
            nursery.cancel_scope.cancel()
    (notice,) = notices(tmp_path)
    assert notice["Subject"] == "Successful Mail Delivery Report"
    per_message, *per_recipient = status_blocks(notice)
    assert per_message["Original-Envelope-Id"] == "batch-7"
    assert len(per_recipient) == 1  # eve asked for nothing: a success is never told unasked
    assert (per_recipient[0]["Action"], per_recipient[0]["Status"]) == ("delivered", "2.0.0")
    assert per_recipient[0]["Original-Recipient"] == "rfc822; daniel@old.example"


async def test_notify_delay_gets_a_delay_notice_and_failure_only_none(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            hop = NextHop(lambda stage, value: Reply(451, "4.7.1", "greylisted") if stage == "rcpt" else None)
            port = await hop.start(nursery)
            cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{port}"},
                               retry='["1s"]', extra='[delivery]\ndelay_warning = "1s"\n')
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            rcpts = [("slow@far.example", ["NOTIFY=DELAY,FAILURE"]), ("quiet@far.example", ["NOTIFY=FAILURE"])]
            await trio.to_thread.run_sync(send, relay.ports[0], rcpts, [])
            await watch.wait_for(Status.DELIVERED, 1, recipient=SENDER)
            await watch.wait_for(Status.DEFERRED, 3, recipient="quiet@far.example")
            nursery.cancel_scope.cancel()
    (notice,) = notices(tmp_path)
    assert notice["Subject"] == "Delayed Mail (still being retried)"
    _per_message, *per_recipient = status_blocks(notice)
    assert [(b["Action"], "slow@far.example" in b["Final-Recipient"]) for b in per_recipient] == [("delayed", True)]


@pytest.mark.parametrize(("command", "code"), [
    ("RCPT TO:<b@far.example> NOTIFY=SOMETIMES", "501 5.5.4"),
    ("RCPT TO:<b@far.example> NOTIFY=NEVER,SUCCESS", "501 5.5.4"),
    ("RCPT TO:<b@far.example> NOTIFY=SUCCESS,SUCCESS", "501 5.5.4"),
    ("RCPT TO:<b@far.example> ORCPT=b@far.example", "501 5.5.4"),
    ("RCPT TO:<b@far.example> ORCPT=rfc822;b+2g@far.example", "501 5.5.4"),
    ("RCPT TO:<b@far.example> NOTIFY", "501 5.5.4"),
    ("RCPT TO:<b@far.example> XNOTIFY=NEVER", "555 5.5.4"),
])
async def test_bad_dsn_values_get_501(tmp_path: Path, command: str, code: str) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            cfg = relay_config(str(tmp_path), {"*": "discard"})
            relay = await start_relay(nursery, cfg)

            def talk() -> tuple[int, bytes, int]:
                with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                    s.ehlo("client.test")
                    for bad_mail in ("RET=SOME", "ENVID=has=equals", "ENVID=" + "x" * 101):
                        assert s.docmd(f"MAIL FROM:<{SENDER}> {bad_mail}")[0] == 501
                    assert s.mail(SENDER)[0] == 250
                    answer = s.docmd(command)
                    return answer[0], answer[1], s.rcpt("ok@far.example", ["NOTIFY=SUCCESS,FAILURE"])[0]

            got, text, after = await trio.to_thread.run_sync(talk)
            nursery.cancel_scope.cancel()
    assert f"{got} {text.decode()[:5]}" == code
    assert after == 250  # the session goes on
