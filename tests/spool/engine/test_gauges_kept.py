"""The queue gauges kept as the spool goes (``spool.engine.gauges``) equal a fresh count of the live log.

A random walk of enqueues, deliveries, deferrals, holds, releases, flushes and deletes, with
the gauges kept from an empty spool; after each step they are compared with a seed of the log
as it now is (the differential pattern: the kept state against the state read again).
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest

from fault_injection.workloads import FakeClock as Clock
from spool.config.engine import SpoolConfig
from spool.engine.gauges import QueueGauges
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status
from spool.read import listing as admin


def counts(g: QueueGauges) -> tuple[int, int, int, int, int]:
    return g.new, g.deferred, g.held, g.in_doubt, g.oldest_ms


@pytest.mark.parametrize("seed", range(5))
def test_kept_gauges_equal_a_fresh_count_after_every_step(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    clock = Clock(1000.0)
    sp = Spool.open(str(tmp_path), SpoolConfig(retry_intervals=(1.0, 2.0), clock=clock))
    try:
        gauges = QueueGauges()
        gauges.seed(sp)
        sp.keep_gauges(gauges)
        for step in range(120):
            choice = rnd.random()
            live = [m for m in admin.iter_live(sp) if m.state != "active"]
            if choice < 0.35 or not live:
                sp.enqueue("s@src.example", [f"r{step}@dest.example"], b"body", arrival_ms=int(clock.now * 1000))
                sp.commit()
            elif choice < 0.6:
                clock.now += rnd.choice((0.5, 3.0))
                for a in sp.poll_due():
                    status = rnd.choice((Status.DELIVERED, Status.DEFERRED))
                    sp.record_delivery(a, [Outcome(r, status, 250 if status is Status.DELIVERED else 451)
                                           for r in a.remaining])
                    sp.commit()
                    sp.finish(a)
                sp.commit()
            else:
                action = rnd.choice(("hold", "release", "flush", "delete"))
                sp.change_batch([rnd.choice(live)], action)
            fresh = QueueGauges()
            fresh.seed(sp)
            kept = sp.gauges
            assert kept is gauges
            if kept.stale:  # the oldest left: the relay refreshes it by one walk
                kept.refreshed(min((admin.arrival_key(m) for m in admin.iter_live(sp)), default=None))
            assert counts(kept) == counts(fresh), (step, attrs.asdict(kept), attrs.asdict(fresh))
    finally:
        sp.close()
