"""Bounce classes on the real relay: the next hop answers like Gmail, and the class is in the delivery line, the
metrics, the events (``class``) and ``mta queue show``, each derived from the reply the log recorded."""

from __future__ import annotations

import json
import logging
import smtplib
from pathlib import Path

import pytest
import trio
from logfmt import events
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.bounce_class import classifier_for
from mta.events.source import event_dict
from mta.smtp.common import Reply
from spool import EventStream, Status

MTA = "/work/main/.venv/bin/mta"
FULL = Reply(452, "4.2.2", "The email account that you tried to reach is over quota. - gsmtp")
GHOST = Reply(550, "5.1.1", "The email account that you tried to reach does not exist. - gsmtp")
# A 421 would end the whole session (every recipient deferred alike): the test's hop says it with a 451.
RATE = Reply(451, "4.7.28", "Our system has detected an unusual rate of unsolicited mail originating from your IP "
                            "address. - gsmtp")


def policy(stage: str, value: object) -> Reply | None:
    if stage == "rcpt":
        return {"full@far.example": FULL, "ghost@far.example": GHOST, "busy@far.example": RATE}.get(str(value))
    return None


def _send(port: int, rcpts: list[str]) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("a@localhost", rcpts, "Subject: classes\r\n\r\nbody\r\n")


async def test_each_outcome_carries_its_class_in_the_log_the_metrics_the_events_and_queue_show(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta.delivery")
    rules = tmp_path / "classes.toml"  # the operator's own rule, before the shipped ones
    rules.write_text('[[rule]]\nclass = "policy"\ntext = "unusual rate"\n')
    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        routes = {"localhost": "maildir:maildir", "*": f"smtp://127.0.0.1:{port}?tls=none"}
        extra_spool = f'retry_intervals = ["1h"]\n[bounce_classes]\nrules_file = "{rules}"\n'
        cfg = relay_config(str(tmp_path), routes, retry=None, spool_extra=extra_spool)
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        await trio.to_thread.run_sync(_send, relay.ports[0], ["full@far.example", "ghost@far.example",
                                                              "busy@far.example", "ok@far.example"])
        await watch.wait_for(Status.DEFERRED, 2)
        await watch.wait_for(Status.BOUNCED, 1)
        await watch.wait_for(Status.DELIVERED, 1, recipient="ok@far.example")
        qid = next(q for q, o in watch.outcomes if o.recipient == "full@far.example")

        lines = {e["to"]: e.get("class") for e in events(caplog.records, "delivery") if "far.example" in e["to"]}
        assert lines == {"<full@far.example>": "mailbox-full", "<ghost@far.example>": "bad-mailbox",
                         "<busy@far.example>": "policy", "<ok@far.example>": None}

        sample = relay.metrics.registry.get_sample_value
        assert sample("logspool_outcome_classes_total", {"status": "deferred", "class": "mailbox-full"}) == 1
        assert sample("logspool_outcome_classes_total", {"status": "bounced", "class": "bad-mailbox"}) == 1
        assert sample("logspool_outcome_classes_total", {"status": "deferred", "class": "policy"}) == 1

        (tmp_path / "relay.toml").write_text(
            f'[spool]\ndir = "spool"\n[bounce_classes]\nrules_file = "{rules}"\n[routes]\n"*" = "discard"\n')
        proc = await trio.run_process([MTA, "queue", "show", qid, "--json", "--config", str(tmp_path / "relay.toml")],
                                      capture_stdout=True, capture_stderr=True, check=False, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        shown = {r["recipient"]: r.get("class") for r in json.loads(proc.stdout)["recipient_status"]}
        assert shown == {"full@far.example": "mailbox-full", "busy@far.example": "policy",
                         "ghost@far.example": "bad-mailbox", "ok@far.example": None}
        text = await trio.run_process([MTA, "queue", "show", qid, "--config", str(tmp_path / "relay.toml")],
                                      capture_stdout=True, check=False, cwd=str(tmp_path))
        assert "  full@far.example: deferred [mailbox-full]: 452 4.2.2 The email account" in text.stdout.decode()
        nursery.cancel_scope.cancel()

    stream = EventStream(str(tmp_path / "spool"))
    mine = classifier_for(str(rules))
    got = {d["recipient"]: d.get("class") for d in (event_dict(e, 0, mine) for e in stream.read().events)
           if d["kind"] in ("deferred", "bounced", "delivered") and d["recipient"].endswith("@far.example")}
    assert got == {"full@far.example": "mailbox-full", "ghost@far.example": "bad-mailbox",
                   "busy@far.example": "policy", "ok@far.example": None}
    shipped = {d["recipient"]: d.get("class") for d in (event_dict(e) for e in stream.read().events)
               if d["kind"] == "deferred"}
    assert shipped["busy@far.example"] == "rate-limited"  # the shipped rules alone: Gmail's rate limit
