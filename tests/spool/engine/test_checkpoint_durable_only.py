"""A checkpoint of what is durable (``checkpoint_plan(durable_only=True)``) never names a runner past a message
whose claim is not durable.

Found while measuring fsyncs (docs/benchmarks.md, "Outcomes ride the next enqueue commit"): such a plan took
the runners' positions as they stood, and a runner has passed every envelope
it claimed, while the START of a fresh claim may still be only in memory (the
disk is full: the write of the claims waits for room). A crash then lost the
START, and recovery started the runner behind the envelope: an accepted
message never delivered. The plan now holds each runner at the envelope of
the oldest attempt whose START is not durable.
"""

from __future__ import annotations

from pathlib import Path

from spool_support import spool_config

from spool.engine.spool import Spool

CLOCK = 1_700_000_000.0


def test_a_checkpoint_of_what_is_durable_keeps_a_claim_that_is_not(tmp_path: Path) -> None:
    cfg = spool_config(lambda: CLOCK)
    sp = Spool.open(str(tmp_path), cfg)
    try:
        mid = sp.enqueue("s@src.example", ["r@dest.example"], b"accepted, then claimed")
        sp.commit()  # durable: the sender was answered 250
        (a,) = sp.poll_due()  # claimed: the START is appended, not written (as when the disk is full)
        assert sp.writer.durable_end <= a.start_pos
        plan = sp.checkpoint_plan(durable_only=True)
        assert all(pos <= a.envelope_pos for pos in plan.checkpoint.runners), "no runner past the claimed envelope"
        sp.checkpoint_write(plan)
    finally:
        sp.close()  # a crash: the START never reached the file
    sp = Spool.open(str(tmp_path), cfg)
    try:
        assert [x.message_id for x in sp.poll_due()] == [mid], "the accepted message is delivered after the crash"
    finally:
        sp.close()
