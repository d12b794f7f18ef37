"""Spools with history for the Spark data source and report tests.

``run_relay`` really runs the spool engine (``spool.engine.spool.Spool``) for a few
hours of simulated time (its clock is injected): mail arrives, runners take
due envelopes, the tests' own next hop answers per recipient domain
(delivered, greylisted, slow, unknown user, down), ``finish`` writes
replacement envelopes of the next class for deferred recipients, mail older
than the queue lifetime expires, checkpoints move finished segments to the
archive directory, and the end leaves mail queued and one message held.
"""

from __future__ import annotations

import os
import random

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status

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


def _answer(domain: str, attempts: int) -> tuple[Status, int, str, str]:
    answers = NEXT_HOP[domain]
    return answers[min(attempts, len(answers) - 1)]


def run_relay(directory: str, seed: int, messages: int = 120, hours: float = 3.0) -> None:
    """Simulate a relay for ``hours`` of mail into the spool at ``directory``
    (segments in ``log/`` and, once finished, in ``archive/``)."""
    rng = random.Random(seed)
    clock = [T0]
    config = SpoolConfig(segment_size=16384, retry_intervals=RETRY_INTERVALS, max_queue_lifetime=LIFETIME_S,
                         archive_dir=os.path.join(directory, "archive"), clock=lambda: clock[0])
    sp = Spool.open(directory, config)
    domains = list(DOMAIN_WEIGHTS)
    weights = list(DOMAIN_WEIGHTS.values())
    arrivals = sorted(T0 + rng.uniform(0, hours * 3600) for _ in range(messages))
    end = T0 + hours * 3600 + 600
    step = 30.0
    held = None
    steps = 0
    try:
        while clock[0] < end:
            while arrivals and arrivals[0] <= clock[0]:
                arrivals.pop(0)
                n = rng.choice([1, 1, 1, 2, 3])
                rcpts = [f"u{rng.randrange(50)}@{rng.choices(domains, weights)[0]}" for _ in range(n)]
                sender = f"s{rng.randrange(9)}@{rng.choice(SENDER_DOMAINS)}" if rng.random() > 0.05 else ""
                mid = sp.enqueue(sender, sorted(set(rcpts)), b"x" * rng.randrange(200, 3000))
                if held is None:  # an operator holds the first message before its first try
                    held = mid
                    sp.commit()
                    sp.change(held, "hold")
            sp.commit()
            for attempt in sp.poll_due(clock[0]):
                outcomes = []
                for r in attempt.remaining:
                    domain = r.rsplit("@", 1)[1]
                    if attempt.expired:
                        outcomes.append(Outcome(r, Status.EXPIRED, 0, "4.4.7", "message expired", ""))
                        continue
                    status, code, enh, reply = _answer(domain, attempt.envelope.attempts)
                    outcomes.append(Outcome(r, status, code, enh, reply, f"mx.{domain}"))
                # One commit per step rather than per delivery: durability is not what these tests are about.
                sp.record_delivery(attempt, outcomes, duration_ms=rng.randrange(5, 900))
                sp.finish(attempt)
            sp.commit()
            steps += 1
            if steps % 40 == 0:
                sp.checkpoint()
            clock[0] += step
        sp.commit()
    finally:
        sp.close()


def segment_dirs(directory: str) -> list[str]:
    """Where one relay's segments are: the live log and the archive."""
    return [d for d in (os.path.join(directory, "log"), os.path.join(directory, "archive")) if os.path.isdir(d)]
