"""Spools with history for the Spark data source and report tests.

``run_relay`` drives a simulated relay for a few hours of simulated time: mail
arrives, runners take due envelopes, the tests' own next hop answers per
recipient domain (delivered, greylisted, slow, unknown user, down), deferred
recipients go on in replacement envelopes of the next class, and mail older
than the queue lifetime expires. The end leaves some mail queued and one
message held.

TEMPORARY: the engine (``spool/spool.py``) is not in the tree yet, so
``HandBuiltSpoolTEMPORARY`` writes the records the way the engine's API is
specified to (enqueue: DATA + ENVELOPE; an attempt: START, DELIVERY, then a
replacement ENVELOPE for the deferred recipients and FINISH), with the spool's
own ``encode_frame``/``encode_segment_header``. Swap it for ``Spool`` when the
engine lands; ``run_relay`` only uses the engine-shaped methods.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import attrs

from spool.record import (
    HELD_CLASS,
    Delivery,
    Envelope,
    Finish,
    Outcome,
    RecordType,
    Start,
    Status,
    encode_frame,
    make_pos,
)
from spool.segment import SEGMENT_HEADER_SIZE, encode_segment_header, segment_path

RETRY_INTERVALS = (60.0, 300.0, 900.0)
LIFETIME_S = 2400.0
T0 = 1_700_000_000.0

# The tests' next hop: domain -> the answers of successive attempts (the last repeats).
NEXT_HOP: dict[str, list[tuple[Status, int, str, str]]] = {
    "ok.example": [(Status.DELIVERED, 250, "2.0.0", "OK queued")],
    "grey.example": [(Status.DEFERRED, 451, "4.7.1", "greylisted, try later"), (Status.DELIVERED, 250, "2.0.0", "OK")],
    "slow.example": [
        (Status.DEFERRED, 421, "4.4.2", "timeout reading banner"),
        (Status.DEFERRED, 421, "4.4.2", "timeout reading banner"),
        (Status.DELIVERED, 250, "2.0.0", "OK"),
    ],
    "bad.example": [(Status.BOUNCED, 550, "5.1.1", "user unknown")],
    "down.example": [(Status.DEFERRED, 0, "4.4.1", "connection refused")],
}
DOMAIN_WEIGHTS = {"ok.example": 6, "grey.example": 2, "slow.example": 1, "bad.example": 1, "down.example": 1}
SENDER_DOMAINS = ["shop.example", "news.example", "corp.example"]


@attrs.define
class Attempt:
    envelope: Envelope
    envelope_pos: int
    start_pos: int
    expired: bool


class HandBuiltSpoolTEMPORARY:
    """Writes engine-shaped records; stands in for ``spool.spool.Spool`` until it lands."""

    def __init__(self, directory: str, clock: list[float], segment_size: int = 16384) -> None:
        self.log_dir = os.path.join(directory, "log")
        os.makedirs(self.log_dir, exist_ok=True)
        self.clock = clock
        self.segment_size = segment_size
        self.seg_id = 0
        self.fh: Any = None
        self.off = 0
        self.live: dict[int, tuple[Envelope, float, int]] = {}  # pos -> (envelope, appended at, class)
        self._rotate()

    def _rotate(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.seg_id += 1
        self.fh = open(segment_path(self.log_dir, self.seg_id), "wb")  # noqa: SIM115 (closed on rotation)
        self.fh.write(encode_segment_header(self.seg_id, int(self.clock[0])))
        self.off = SEGMENT_HEADER_SIZE

    def _append(self, rtype: RecordType, payload: bytes, klass: int = 0) -> int:
        if self.off + 16 + len(payload) > self.segment_size:
            self._rotate()
        pos = make_pos(self.seg_id, self.off)
        frame = encode_frame(self.seg_id, rtype, payload, klass=klass, time=int(self.clock[0]))
        self.fh.write(frame)
        self.off += len(frame)
        return pos

    def _next_pos(self, size: int) -> int:
        if self.off + 16 + size > self.segment_size:
            self._rotate()
        return make_pos(self.seg_id, self.off)

    def enqueue(self, sender: str, recipients: list[str], body: bytes, held: bool = False) -> int:
        data = self._append(RecordType.DATA, body)
        now_ms = int(self.clock[0] * 1000)
        probe = Envelope(0, sender, tuple(recipients), (data,), len(body), now_ms, held=held)
        mid = self._next_pos(len(probe.to_payload()) + 8)
        env = attrs.evolve(probe, message_id=mid)
        klass = HELD_CLASS if held else 0
        pos = self._append(RecordType.ENVELOPE, env.to_payload(), klass)
        assert pos == mid
        self.live[pos] = (env, self.clock[0], klass)
        return mid

    def commit(self) -> None:
        self.fh.flush()

    def poll_due(self, now: float) -> list[Attempt]:
        due = []
        for pos, (env, at, klass) in sorted(self.live.items()):
            if klass == HELD_CLASS:
                continue
            if klass == 0 or now >= at + RETRY_INTERVALS[min(klass, len(RETRY_INTERVALS)) - 1]:
                del self.live[pos]
                start = self._append(RecordType.START, Start(pos, int(now * 1000)).to_payload())
                expired = now - env.arrival_ms / 1000 > LIFETIME_S
                due.append(Attempt(env, pos, start, expired))
        return due

    def record_delivery(self, attempt: Attempt, outcomes: list[Outcome], duration_ms: int) -> None:
        d = Delivery(attempt.start_pos, int(self.clock[0] * 1000), tuple(outcomes), duration_ms)
        self._append(RecordType.DELIVERY, d.to_payload())
        attempt.envelope = attrs.evolve(
            attempt.envelope,
            recipients=tuple(r for r in attempt.envelope.recipients
                             if r not in {o.recipient for o in outcomes if o.status.final}),
        )

    def finish(self, attempt: Attempt) -> None:
        env = attempt.envelope
        replacement = None
        if env.recipients:
            klass = min(env.attempts + 1, len(RETRY_INTERVALS))
            new = attrs.evolve(env, attempts=env.attempts + 1, replaces=attempt.envelope_pos)
            replacement = self._append(RecordType.ENVELOPE, new.to_payload(), klass)
            self.live[replacement] = (new, self.clock[0], klass)
        self._append(RecordType.FINISH, Finish(attempt.start_pos, int(self.clock[0] * 1000), replacement).to_payload())

    def close(self) -> None:
        self.fh.close()


def _answer(domain: str, attempts: int) -> tuple[Status, int, str, str]:
    answers = NEXT_HOP[domain]
    return answers[min(attempts, len(answers) - 1)]


def run_relay(directory: str, seed: int, messages: int = 120, hours: float = 3.0) -> None:
    """Simulate a relay for ``hours`` of mail into the spool at ``directory``."""
    rng = random.Random(seed)
    clock = [T0]
    sp = HandBuiltSpoolTEMPORARY(directory, clock)
    domains = list(DOMAIN_WEIGHTS)
    weights = list(DOMAIN_WEIGHTS.values())
    arrivals = sorted(T0 + rng.uniform(0, hours * 3600) for _ in range(messages))
    end = T0 + hours * 3600 + 600
    step = 30.0
    while clock[0] < end:
        while arrivals and arrivals[0] <= clock[0]:
            arrivals.pop(0)
            n = rng.choice([1, 1, 1, 2, 3])
            rcpts = [f"u{rng.randrange(50)}@{rng.choices(domains, weights)[0]}" for _ in range(n)]
            sender = f"s{rng.randrange(9)}@{rng.choice(SENDER_DOMAINS)}" if rng.random() > 0.05 else ""
            sp.enqueue(sender, sorted(set(rcpts)), b"x" * rng.randrange(200, 3000))
        sp.commit()
        for attempt in sp.poll_due(clock[0]):
            outcomes = []
            for r in attempt.envelope.recipients:
                domain = r.rsplit("@", 1)[1]
                if attempt.expired:
                    outcomes.append(Outcome(r, Status.EXPIRED, 0, "4.4.7", "message expired", ""))
                    continue
                status, code, enh, reply = _answer(domain, attempt.envelope.attempts)
                outcomes.append(Outcome(r, status, code, enh, reply, f"mx.{domain}"))
            sp.record_delivery(attempt, outcomes, duration_ms=rng.randrange(5, 900))
            sp.finish(attempt)
        clock[0] += step
    sp.enqueue("admin@corp.example", ["hold@ok.example"], b"held", held=True)
    sp.close()


# -- pytest fixtures shared by the Spark tests (import them into the test module) --

import pytest  # noqa: E402


@pytest.fixture(scope="session", name="spark")
def spark_session_fixture() -> Iterator[Any]:
    """One local SparkSession for every Spark test (it takes seconds to start)."""
    from mta.report import make_session

    session = make_session("local[2]", app="logspool-tests",
                           conf={"spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()


@pytest.fixture(scope="session", name="fleet")
def fleet_fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two relays' spools, ``mx1`` and ``mx2``, with deferrals, bounces, expiry and a queue left over."""
    root = tmp_path_factory.mktemp("fleet")
    dirs = {}
    for seed, relay in enumerate(("mx1", "mx2"), start=1):
        d = str(root / relay)
        run_relay(d, seed)
        dirs[relay] = d
    return dirs
