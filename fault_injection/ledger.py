"""The ledger: what a workload promised, and the check of a recovered spool against it.

Workloads log events (``fault_injection.recording.Event``) as they go:

- ``enqueue(mid, recipients, body)`` when ``Spool.enqueue`` returned (appended, not durable);
- ``remote(mid, rcpt)`` when the simulated next hop said 250 (before our DELIVERY record);
- ``outcome(mid, rcpt, status)`` when ``record_delivery`` returned (appended, not durable);
- ``committed()`` when ``commit()`` returned: everything logged before it is durable;
- ``crash()`` between a crash and the recovery after it (recovery of recovery).

A message is *acknowledged* when its ``enqueue`` precedes a ``committed``; an
outcome is *recorded* likewise. The invariants after recovery from any crash:

1. every recipient of an acknowledged message is live, or a final outcome for
   it had at least been appended before the crash;
2. no recipient whose final outcome was recorded is live again;
3. every live message was enqueued, each has one live envelope, its recipients
   are its own, and its body reads back (checksums verified) as it was sent;
4. the runners can claim every live message (nothing is stranded behind them),
   once the messages recovery held in doubt (``in_doubt = "hold"``, the
   default) are released as the operator would; the workloads hold nothing
   themselves, so a held message without recipients in doubt is a violation.

A live recipient that the next hop had already accepted is a *duplicate*: it
will be delivered again. It is allowed (and counted) only while the DELIVERY
record was not yet durable; after that, rule 2 makes it a failure.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from fault_injection.recording import Event
from spool.engine.spool import Spool
from spool.format.record import Status
from spool.read import listing as admin

FAR_FUTURE = 4_000_000_000.0


@attrs.define
class Ledger:
    enqueued: dict[int, tuple[tuple[str, ...], bytes]] = attrs.field(factory=dict)
    acked: set[int] = attrs.field(factory=set)
    appended_final: set[tuple[int, str]] = attrs.field(factory=set)
    recorded_final: set[tuple[int, str]] = attrs.field(factory=set)
    remote: set[tuple[int, str]] = attrs.field(factory=set)

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> Ledger:
        led = cls()
        since_enq: list[int] = []
        since_out: list[tuple[int, str]] = []
        for ev in events:
            if ev.kind == "enqueue":
                mid, rcpts, body = ev.data
                led.enqueued[mid] = (tuple(rcpts), body)
                since_enq.append(mid)
            elif ev.kind == "remote":
                led.remote.add((ev.data[0], ev.data[1]))
            elif ev.kind == "outcome":
                mid, rcpt, status = ev.data
                if Status(status).final:
                    led.appended_final.add((mid, rcpt))
                    since_out.append((mid, rcpt))
            elif ev.kind == "crash":
                # what was appended but not committed before a crash was never promised
                since_enq.clear()
                since_out.clear()
            elif ev.kind == "committed":
                led.acked.update(since_enq)
                led.recorded_final.update(since_out)
                since_enq.clear()
                since_out.clear()
        return led


@attrs.define
class CheckResult:
    violations: list[str] = attrs.field(factory=list)
    duplicates: int = 0
    live_messages: int = 0
    # The acknowledged recipients that are neither live nor done (each is also a violation): for a harness
    # that damages the spool on purpose and must tell named losses from silent ones.
    lost: list[tuple[int, str]] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


Found = dict[int, list[tuple[tuple[str, ...], bytes]]]


def judge(found: Found, led: Ledger) -> CheckResult:
    """Compare live messages (id -> [(recipients, body)] per live envelope) with the ledger."""
    res = CheckResult()
    live: dict[int, set[str]] = {}
    for mid, envs in sorted(found.items()):
        res.live_messages += len(envs)
        if len(envs) > 1:
            res.violations.append(f"message {mid:X} has {len(envs)} live envelopes")
        sent = led.enqueued.get(mid)
        if sent is None:
            res.violations.append(f"live message {mid:X} was never enqueued")
            continue
        for rcpts, body in envs:
            live.setdefault(mid, set()).update(rcpts)
            extra = set(rcpts) - set(sent[0])
            if extra:
                res.violations.append(f"message {mid:X} has recipients it was not sent to: {sorted(extra)}")
            if body != sent[1]:
                res.violations.append(f"message {mid:X}: body differs ({len(body)} bytes, sent {len(sent[1])})")
        for r in live.get(mid, set()):
            if (mid, r) in led.recorded_final:
                res.violations.append(f"message {mid:X} recipient {r}: final outcome was recorded, live again")
            elif (mid, r) in led.remote:
                res.duplicates += 1
    for mid in sorted(led.acked):
        for r in led.enqueued[mid][0]:
            if r not in live.get(mid, set()) and (mid, r) not in led.appended_final:
                res.violations.append(f"acknowledged message {mid:X} recipient {r} was lost")
                res.lost.append((mid, r))
    return res


def listed(sp: Spool) -> Found:
    """Live messages as the admin listing sees them, bodies read back with checksums."""
    found: Found = {}
    for msg in admin.iter_live(sp):
        body = b"".join(sp.read_body(msg.envelope))
        found.setdefault(msg.envelope.message_id, []).append((msg.envelope.recipients, body))
    return found


def release_held_in_doubt(sp: Spool) -> list[str]:
    """Release what recovery held in doubt, as the operator does (``mta queue release``); what else is held is
    a violation (the workloads never hold)."""
    violations = []
    for msg in list(admin.iter_live(sp)):
        if not msg.held:
            continue
        mid = msg.envelope.message_id
        if not msg.envelope.in_doubt:
            violations.append(f"message {mid:X} is held with no recipient in doubt")
        sp.change(mid, "release")
    return violations


def claimed(sp: Spool) -> Found:
    """Live messages as the runners deliver them: claim everything (no commit), read every body."""
    found: Found = {}
    for _ in range(10_000):
        batch = sp.poll_due(now=FAR_FUTURE, limit=1000)
        if not batch:
            break
        for a in batch:
            body = b"".join(sp.read_body(a.envelope))
            found.setdefault(a.message_id, []).append((a.envelope.recipients, body))
    return found


def check(sp: Spool, led: Ledger, *, drain: bool = True) -> CheckResult:
    """Check a freshly recovered spool against the ledger; with ``drain``, also that runners find it all."""
    found = listed(sp)
    res = judge(found, led)
    if drain:
        res.violations += release_held_in_doubt(sp)
        got = claimed(sp)
        res.violations += [f"live message {mid:X} is never claimed by a runner (stranded)"
                           for mid in sorted(set(found) - set(got))]
        res.violations += [f"a runner claimed message {mid:X}, which is not listed live"
                           for mid in sorted(set(got) - set(found))]
    return res
