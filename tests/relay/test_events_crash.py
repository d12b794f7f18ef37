"""kill -9 cycles of the relay while clients send and deliveries run: the events a follower received are
exactly the durable transitions that ``spoolctl dump`` shows, with the same ids.

The relay runs as a subprocess (``mta serve``), killed with SIGKILL three
times under load and started again; one ``mta events --follow --json`` process
reads the stream the whole time, across the crashes. The next hop delivers
some recipients, defers others and refuses some (bounces, and their DSNs).
At the end the spool's log is read with ``spoolctl dump --json`` up to the
durable horizon, and every record that is a transition is turned into the
ids it must have (here, independently of the code under test): an envelope
that is no replacement is ``received``; every outcome of a DELIVERY record
is one event at ``position/index`` of its status; every replacement
envelope, but a held one carried forward, is one event. The follower's ids
must equal that set: nothing missing, nothing shown that the log does not
hold (a record past the horizon that a crash took back and whose position
went to another record would show up as a phantom or a wrong kind), and
every id shown before a crash names the same transition after it.
"""

from __future__ import annotations

import json
import smtplib
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from process_support import MTA, RelayProcess
from relay_support import NextHop, write_relay_config

from mta.smtp.common import Reply
from spool import parse_pos
from spool.fileio import OsFileIO
from spool.format.horizon import read_horizon

pytestmark = pytest.mark.slow

SPOOLCTL = MTA.removesuffix("mta") + "spoolctl"
LIVES = 4  # three kills, then a last life that delivers what is left


def policy(stage: str, value: Any) -> Reply | None:
    if stage == "rcpt" and str(value).startswith("later"):
        return Reply(451, "4.3.0", "try again later")
    if stage == "rcpt" and str(value).startswith("nobody"):
        return Reply(550, "5.1.1", "no such user")
    return None


def send(port: int, first: int, count: int, accepted: list[int]) -> None:
    """Messages ``first..`` over one connection until the relay dies; every 250 recorded."""
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            for i in range(first, first + count):
                rcpts = [f"ok{i}@far.example"]
                if i % 3 == 0:
                    rcpts.append(f"later{i}@far.example")
                if i % 5 == 0:
                    rcpts.append(f"nobody{i}@far.example")
                s.sendmail("sender@example.org", rcpts, f"Subject: ev {i}\r\n\r\nbody {i}\r\n")
                accepted.append(i)
    except (smtplib.SMTPException, OSError):
        return


def expected_ids(spool: Path) -> dict[str, str]:
    """id -> kind of every durable transition in the log, from ``spoolctl dump --json``."""
    horizon = read_horizon(OsFileIO(), str(spool))
    assert horizon is not None
    out = subprocess.run([SPOOLCTL, "dump", "--json", str(spool)], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines()]
    envelopes = {r["position"]: r for r in records if r["type"] == "ENVELOPE"}
    ids: dict[str, str] = {}
    for r in records:
        if parse_pos(r["position"]) >= horizon:
            continue
        p = r.get("payload", {})
        if r["type"] == "ENVELOPE":
            old = envelopes.get(p["replaces"]) if p["replaces"] else None
            if p["replaces"] is None:
                ids[r["position"]] = "received"
            elif not (p["held"] and old is not None and old["payload"]["held"] and not p.get("in_doubt")):
                ids[r["position"]] = "replacement"
        elif r["type"] == "DELIVERY":
            for i, o in enumerate(p["outcomes"]):
                ids[f"{r['position']}/{i}"] = o["status"].lower()
    return ids


REPLACEMENT_KINDS = {"retry_scheduled", "held", "released", "requeued", "in_doubt"}


async def test_events_equal_the_durable_transitions_across_kill_9_cycles(tmp_path: Path) -> None:
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            await hop.start(nursery)
            config = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                        spool_extra='in_doubt = "redeliver"')
            relay = RelayProcess(config)
            seen: list[dict[str, Any]] = []
            changed = trio.Event()

            async def follow() -> None:
                nonlocal changed
                proc = await trio.lowlevel.open_process(
                    [MTA, "events", "--follow", "--json", "--config", str(config)], cwd=str(tmp_path),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
                assert proc.stdout is not None
                buf = b""
                try:
                    while chunk := await proc.stdout.receive_some(65536):
                        buf += chunk
                        *lines, buf = buf.split(b"\n")
                        seen.extend(json.loads(line) for line in lines)
                        changed.set()
                        changed = trio.Event()
                finally:
                    proc.kill()

            accepted: list[int] = []
            sent = 0
            for life in range(LIVES):
                await relay.start(nursery)
                if life == 0:
                    nursery.start_soon(follow)
                before = len(hop.messages)
                await trio.to_thread.run_sync(send, relay.port, sent, 15, accepted)
                sent += 15
                if life < LIVES - 1:
                    # Kill while the next hop is still taking this life's mail: deliveries in flight.
                    await hop.wait_messages(before + 3)
                    await relay.kill()
            # The last life: everything that can be delivered is (the deferred stay deferred).
            oks = {f"ok{i}@far.example" for i in accepted}
            with trio.fail_after(120):
                while not oks <= {r for m in hop.messages for r in m.recipients}:
                    await hop.wait_messages(len(hop.messages) + 1, timeout=120)
            await relay.kill()

            want = expected_ids(tmp_path / "spool")
            with trio.move_on_after(60):
                while not set(want) <= {e["id"] for e in seen}:
                    await changed.wait()
            got = {e["id"]: e["kind"] for e in seen}
            assert len(got) == len(seen), "an event was shown twice"
            missing = set(want) - set(got)
            phantom = set(got) - set(want)
            assert not missing and not phantom, (sorted(missing)[:10], sorted(phantom)[:10])
            for event_id, kind in want.items():
                assert got[event_id] == kind or (kind == "replacement" and got[event_id] in REPLACEMENT_KINDS), (
                    event_id, kind, got[event_id])
            assert len(want) >= 3 * len(accepted), "too few transitions for the test to mean much"
            kinds = set(got.values())
            assert {"received", "delivered", "deferred", "bounced", "retry_scheduled"} <= kinds, kinds
            # every received message's events carry its queue id; every accepted message was received
            assert len([e for e in seen if e["kind"] == "received" and "dsn_for" not in e]) >= len(accepted)
            nursery.cancel_scope.cancel()
