"""kill -9 of the relay in the middle of deliveries: every accepted message still arrives.

The relay runs as a subprocess (``mta serve``); the next hop runs in the test.
The next hop records each message when its data ends, the way a real MTA
commits it, and then may *hold* its ``250`` until the test opens a gate: a
held message has been taken by the next hop while the relay has no outcome
for it, which is exactly the window that makes a duplicate. The test kills
the relay while the next hop holds some messages, restarts it, and checks:

* every message the relay answered ``250`` to reaches the next hop;
* duplicates (the same Message-ID twice) happen only for recipients that
  recovery logged as in doubt, and ``mta queue list --in-doubt`` lists
  exactly the recipients recovery logged, held until ``mta queue release``;
* every message held at the kill is among them.

Readiness is the relay's "listening on" log line; every wait is on an event.
"""

from __future__ import annotations

import functools
import json
import signal
import smtplib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from process_support import RelayProcess, mta_json
from relay_support import GatedHop, write_relay_config

# Each test kills the relay's process and starts it again, several seconds on a loaded machine.
pytestmark = pytest.mark.slow


async def control(config: Path, request: dict[str, Any]) -> Any:
    """One request on the relay's control socket (what ``mta queue`` does, without starting a process)."""
    stream = await trio.open_unix_socket(str(config.parent / "spool" / "control.sock"))
    async with stream:
        await stream.send_all(json.dumps(request).encode() + b"\n")
        buf = b""
        with trio.fail_after(60):
            while not buf.endswith(b"\n"):
                chunk = await stream.receive_some(65536)
                assert chunk, "the control socket closed without an answer"
                buf += chunk
    answer = json.loads(buf)
    assert answer["ok"], answer
    return answer


def write_config(tmp_path: Path, hop_port: int) -> Path:
    return write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop_port}?tls=none",
                                         "barrier.test": "discard"})


def message(i: int) -> tuple[str, str]:
    mid = f"crash-{i}@test"
    return f"r{i}@far.example", f"Message-ID: <{mid}>\r\nSubject: crash {i}\r\n\r\nbody {i}\r\n"


def send_until_refused(port: int, first: int, count: int, accepted: list[str], stop: list[bool]) -> None:
    """Send messages ``first..first+count-1`` over one connection; record every 250 until the relay dies."""
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
            for i in range(first, first + count):
                if stop:
                    return
                rcpt, body = message(i)
                s.sendmail("sender@example.org", [rcpt], body)
                accepted.append(f"crash-{i}@test")
    except (smtplib.SMTPException, OSError):
        return


def send_barrier(port: int) -> None:
    """One message whose 250 means every record appended before it (STARTs included) is on disk."""
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.sendmail("sender@example.org", ["x@barrier.test"], "Subject: barrier\r\n\r\nb\r\n")


async def test_kill_9_during_deliveries_loses_nothing(tmp_path: Path) -> None:
    accept_first, hold_at_kill, total = 6, 4, 60
    with trio.fail_after(170):
        async with trio.open_nursery() as nursery:
            hop = GatedHop()
            await hop.start(nursery)
            hop.accept_first = accept_first
            config = write_config(tmp_path, hop.port)
            relay = RelayProcess(config)

            # Life 1: mail flows in while the next hop takes some and holds the rest.
            await relay.start(nursery)
            accepted: list[str] = []
            stop: list[bool] = []
            sender_done = trio.Event()

            async def sender() -> None:
                await trio.to_thread.run_sync(send_until_refused, relay.port, 0, total, accepted, stop)
                sender_done.set()

            nursery.start_soon(sender)
            await hop.wait_until(lambda: len(hop.held) >= hold_at_kill)
            await trio.to_thread.run_sync(send_barrier, relay.port)
            await relay.kill()
            stop.append(True)
            with trio.fail_after(60):
                await sender_done.wait()
            held_at_kill = set(hop.held)
            life1 = set(hop.ids(1))
            assert len(life1) >= accept_first + hold_at_kill
            assert accepted, "no message was accepted before the kill"

            # Life 2: recovery names the recipients in doubt; the next hop holds everything until we have looked.
            hop.new_life(accept_first=0)
            await relay.start(nursery)
            logged = relay.in_doubt_logged()
            assert any("recovered" in line for line in relay.lines)
            listing = await mta_json(config, "queue", "list", "--in-doubt", "--limit", "10000")
            listed = {(m["id"], r) for m in listing["messages"] for r in m["in_doubt"]}
            # Held at recovery (in_doubt = "hold"), every one of them (the barrier too, when the kill came
            # before its DELIVERY record was committed) stays queued until released.
            assert listed == logged
            assert {m["state"] for m in listing["messages"]} <= {"held"}
            doubt_rcpts = {r for _, r in logged}
            rcpt_of = {mid: r for _, mid, r in hop.received}
            assert {rcpt_of[mid] for mid in held_at_kill} <= doubt_rcpts
            # The operator releases them all (the next hop still holds everything until the gate opens).
            released = await mta_json(config, "queue", "release", *(m["id"] for m in listing["messages"]))
            assert sorted(released["done"]) == sorted(m["id"] for m in listing["messages"])

            queued = await control(config, {"op": "list", "domain": "far.example", "limit": 10000})
            to_deliver = {m["recipients"][0] for m in queued["messages"]}
            hop.gate.set()
            hop.accept_first = 1 << 30
            await hop.wait_until(lambda: {r for lf, _, r in hop.received if lf == 2} >= to_deliver)

            # Every accepted message arrived; duplicates only for recipients in doubt.
            arrived = Counter(hop.ids())
            assert set(accepted) <= set(arrived), sorted(set(accepted) - set(arrived))
            duplicates = {mid for mid, n in arrived.items() if n > 1}
            assert max(arrived.values()) <= 2
            assert held_at_kill <= duplicates
            assert {rcpt_of[mid] for mid in duplicates} <= doubt_rcpts
            assert len(duplicates) <= len(doubt_rcpts)
            print(f"accepted {len(accepted)}, next hop took {len(life1)} before the kill "
                  f"({len(held_at_kill)} held), {len(logged)} in doubt, {len(duplicates)} duplicates")

            await relay.kill()
            hop.gate.set()
            nursery.cancel_scope.cancel()


async def test_a_message_the_next_hop_took_before_a_kill_is_in_doubt(tmp_path: Path) -> None:
    """No barrier this time: the relay is killed the moment the next hop has the data.

    Regression: the claimed message's START used to sit in memory while the
    transport delivered it, so the kill lost it and recovery could not name
    the recipient in doubt. Claims are now committed before delivery begins.
    """
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            hop = GatedHop()
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port)
            relay = RelayProcess(config)
            await relay.start(nursery)
            rcpt, _ = message(0)
            assert relay.proc is not None
            hop.on_hold = functools.partial(relay.proc.send_signal, signal.SIGKILL)
            accepted: list[str] = []
            await trio.to_thread.run_sync(send_until_refused, relay.port, 0, 1, accepted, [])
            await hop.wait_until(lambda: len(hop.held) >= 1)
            hop.on_hold = None
            await relay.kill()
            hop.new_life(accept_first=1 << 30)
            await relay.start(nursery)
            logged = relay.in_doubt_logged()
            await relay.kill()
            nursery.cancel_scope.cancel()
    assert {r for _, r in logged} == {rcpt}


async def test_a_message_the_next_hop_took_earlier_in_the_batch_is_not_in_doubt_after_a_kill(tmp_path: Path) -> None:
    """Outcomes are appended as each message's reply arrives, not when the connection's batch ends.

    Regression: the scheduler appended a batch's DELIVERY records only after its
    last message, so a kill while the next hop held message C re-delivered B,
    which the next hop had taken (and answered 250) earlier on the same
    connection. One destination slot makes B and C one batch: A is held at the
    next hop while B and C are accepted and claimed, then A is let through.
    """
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            hop = GatedHop()
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port)
            config.write_text(config.read_text().replace("[routes]", "[delivery]\nper_destination = 1\n[routes]"))
            relay = RelayProcess(config)
            await relay.start(nursery)
            held_c = trio.Event()
            (rcpt_a, _), (rcpt_b, _), (rcpt_c, _) = message(0), message(1), message(2)

            accepted: list[str] = []
            await trio.to_thread.run_sync(send_until_refused, relay.port, 0, 1, accepted, [])
            await hop.wait_until(lambda: len(hop.held) == 1)  # A: the destination's one connection waits
            await trio.to_thread.run_sync(send_until_refused, relay.port, 1, 2, accepted, [])
            assert accepted == ["crash-0@test", "crash-1@test", "crash-2@test"]
            with trio.fail_after(30):  # bounded poll: a claim is visible only in the queue listing
                while True:
                    listed = await control(config, {"op": "list", "domain": "far.example", "limit": 10})
                    if sorted(m["recipients"][0] for m in listed["messages"] if m["state"] == "active") == \
                            [rcpt_a, rcpt_b, rcpt_c]:
                        break
                    await trio.sleep(0.02)

            first_gate = hop.gate
            hop.gate = trio.Event()
            hop.accept_first = 2  # B (the life's second message) passes; C is held
            hop.on_hold = held_c.set
            first_gate.set()
            await held_c.wait()
            assert hop.ids(1) == ["crash-0@test", "crash-1@test", "crash-2@test"]
            # Every request on the control socket begins with a commit: whatever was appended is now durable.
            await control(config, {"op": "count"})
            await relay.kill()

            hop.new_life(accept_first=1 << 30)
            await relay.start(nursery)
            in_doubt = {r for _, r in relay.in_doubt_logged()}
            for qid, _ in relay.in_doubt_logged():  # held at recovery: released, as the operator would
                await mta_json(config, "queue", "release", qid)
            await hop.wait_until(lambda: rcpt_c in {r for lf, _, r in hop.received if lf == 2})
            await relay.kill()
            nursery.cancel_scope.cancel()
    assert in_doubt == {rcpt_c}, f"in doubt after the kill: {sorted(in_doubt)}"
    assert Counter(hop.ids()) == {"crash-0@test": 1, "crash-1@test": 1, "crash-2@test": 2}
