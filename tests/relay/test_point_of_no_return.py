"""In doubt means in doubt (issue 25 §1): only a message whose final dot reached the next hop is held.

The relay runs as ``mta serve``; the next hop runs in the test
(``GatedHop``): it records each message by Message-ID when its final dot
arrives and holds every ``250`` until the test opens its gate. The relay may
send at most ``PER_HOP`` messages at once (``per_destination``), so of the
``TOTAL`` messages it accepted and claimed, only ``PER_HOP`` reach their
final dot; the rest wait, claimed (their START on disk: a barrier message's
``250`` proves it) and never sent. Then:

* the relay is killed with SIGKILL and started again: the messages held in
  doubt are exactly those whose final dot the next hop recorded, none that it
  never saw, and the others are delivered after the restart with no command;
* the delivery worker is killed with SIGKILL (the relay lives on): the same
  rule, decided by the relay itself.

Every wait is on an event, a log line or the next hop's state.
"""

from __future__ import annotations

import os
import re
import signal
import smtplib
from pathlib import Path

import pytest
import trio
from process_support import RelayProcess, mta_json
from relay_support import GatedHop, write_relay_config

pytestmark = pytest.mark.slow  # each test starts the relay's process (and kills it), seconds on a loaded machine

PER_HOP = 3
TOTAL = 12
RECOVERED = re.compile(r"(\d+) in flight, (\d+) in doubt")
WORKER_PID = re.compile(r"worker_started.*worker_pid=(\d+)")


def write_config(tmp_path: Path, hop_port: int, processes: int) -> Path:
    delivery = (f"\n[delivery]\nprocesses = {processes}\nconcurrency = 8\nper_destination = {PER_HOP}\n"
                "max_messages_per_connection = 4\n")
    return write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop_port}?tls=none",
                                         "barrier.test": "discard"}, extra=delivery)


def send_all(port: int) -> dict[str, str]:
    """``TOTAL`` messages over one connection, then a barrier: its ``250`` means every record appended before
    it (the STARTs of the claims included) is on disk. Returns recipient -> Message-ID."""
    sent = {}
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        for i in range(TOTAL):
            rcpt, mid = f"r{i}@far.example", f"dot-{i}@test"
            s.sendmail("sender@example.org", [rcpt], f"Message-ID: <{mid}>\r\nSubject: {i}\r\n\r\nbody {i}\r\n")
            sent[rcpt] = mid
    return sent


def barrier(port: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.sendmail("sender@example.org", ["x@barrier.test"], "Subject: barrier\r\n\r\nb\r\n")


async def fill_the_hop(hop: GatedHop, relay: RelayProcess) -> dict[str, str]:
    """Every message accepted and claimed; the next hop holds ``PER_HOP`` of them at their final dot."""
    sent = await trio.to_thread.run_sync(send_all, relay.port)
    await hop.wait_until(lambda: len(hop.held) >= PER_HOP)
    listing = await mta_json(relay.config, "queue", "list", "--limit", "1000")
    active = [m for m in listing["messages"] if m["state"] == "active"]
    assert len(active) == TOTAL, listing  # all claimed: STARTs appended, PER_HOP of them sent
    await trio.to_thread.run_sync(barrier, relay.port)
    return sent


async def after_the_kill(hop: GatedHop) -> set[str]:
    """Once every connection of the life that ended is closed or holding a message (a final dot still in the
    kernel's buffers at the kill reaches the next hop and is recorded): the Message-IDs whose dot arrived."""
    await hop.wait_until(lambda: hop.closed + len(hop.held) >= hop.connections)
    return set(hop.held)


async def held_in_doubt(config: Path) -> dict[str, str]:
    """Recipient -> state of every message ``mta queue list --in-doubt`` lists."""
    listing = await mta_json(config, "queue", "list", "--in-doubt", "--limit", "1000")
    return {r: m["state"] for m in listing["messages"] for r in m["in_doubt"]}


async def test_kill_9_holds_exactly_the_messages_whose_final_dot_reached_the_next_hop(tmp_path: Path) -> None:
    with trio.fail_after(200):
        async with trio.open_nursery() as nursery:
            hop = GatedHop()
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port, processes=0)
            relay = RelayProcess(config)
            await relay.start(nursery)
            sent = await fill_the_hop(hop, relay)
            await relay.kill()
            dotted = await after_the_kill(hop)
            assert len(dotted) == PER_HOP, dotted

            hop.new_life(accept_first=1 << 30)
            await relay.start(nursery)
            mid_of = dict(sent.items())
            doubt = await held_in_doubt(config)
            assert {mid_of[r] for r in doubt} == dotted, (doubt, dotted)  # none held that it never saw
            assert set(doubt.values()) == {"held"}
            assert {mid_of[r] for _, r in relay.in_doubt_logged()} == dotted
            (counts,) = [(int(m.group(1)), int(m.group(2))) for x in relay.lines if (m := RECOVERED.search(x))]
            assert counts[0] >= TOTAL and counts[1] == PER_HOP, counts  # every claim in flight, PER_HOP in doubt
            # The claimed messages that never reached their final dot are simply due again: delivered now.
            others = set(sent.values()) - dotted
            await hop.wait_until(lambda: set(hop.ids(2)) >= others)
            assert not set(hop.ids(2)) & dotted  # held: not sent again until released
            await relay.kill()
            nursery.cancel_scope.cancel()


async def test_a_killed_delivery_worker_follows_the_same_rule(tmp_path: Path) -> None:
    with trio.fail_after(200):
        async with trio.open_nursery() as nursery:
            hop = GatedHop()
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port, processes=1)
            relay = RelayProcess(config)
            await relay.start(nursery)
            await relay.wait_output(lambda: any(WORKER_PID.search(x) for x in relay.lines), 60, "worker_started")
            (pid,) = {int(m.group(1)) for x in relay.lines if (m := WORKER_PID.search(x))}
            sent = await fill_the_hop(hop, relay)
            os.kill(pid, signal.SIGKILL)
            dotted = await after_the_kill(hop)
            assert len(dotted) == PER_HOP, dotted
            hop.new_life(accept_first=1 << 30)

            # The relay lives on: the worker's jobs past their final dot are held in doubt, the others go again.
            others = set(sent.values()) - dotted
            await hop.wait_until(lambda: set(hop.ids(2)) >= others)
            mid_of = dict(sent.items())
            await relay.wait_output(lambda: sum("event=in_doubt" in x for x in relay.lines) >= PER_HOP, 60,
                                    "the in-doubt lines")
            doubt = await held_in_doubt(config)
            assert {mid_of[r] for r in doubt} == dotted, (doubt, dotted)
            assert set(doubt.values()) == {"held"}
            assert not set(hop.ids(2)) & dotted
            await relay.kill()
            nursery.cancel_scope.cancel()
