"""Power cuts around a FINISH that is written but not synced (docs/design.md, "The log").

A delivered message's FINISH gets no fsync of its own: the lazy committer only
writes it, and the next commit somebody needs syncs it. Every crash state the
order of writes and syncs allows (unsynced pages dropped in any combination,
a torn last write, the kill -9 state with everything written) is recovered
with the real engine, and in each: every message answered (the ``ack``
events) and not yet taken by the next hop is due; a message whose DELIVERY
record was committed is never due again (no duplicate).
This fails if the lazy pass dropped an acknowledged message's records, or if
a FINISH could survive without the DELIVERY before it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import trio
import trio.testing
from spool_support import running_spool, spool_config

from fault_injection import crashstates
from fault_injection.recording import RecordingFileIO
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status

EPOCH = 1_000_000.0


def clock() -> float:
    try:
        return EPOCH + trio.current_time()
    except RuntimeError:
        return EPOCH  # Spool.open, in a worker thread


async def _workload(path: Path, io: RecordingFileIO) -> None:
    async with running_spool(path, spool_config(clock, lazy_commit_delay=0.1), io) as aspool:
        first = await aspool.enqueue("s@src.example", ["r@dest.example"], b"one" * 300)
        io.event("ack", first)
        (a,) = await aspool.next_due()
        io.event("sent", first)  # the next hop answered 250: from here a redelivery is a duplicate
        await aspool.record_delivery(a, [Outcome("r@dest.example", Status.DELIVERED, 250)])
        io.event("recorded", first)  # the outcome is durable: from here it must never be due again
        aspool.finish(a)
        await trio.sleep(1)  # the lazy pass: the FINISH is written, not synced
        await aspool.write_through()  # (its thread may still be writing: the mock clock jumps)
        assert aspool.lazy_writes == 1 and aspool.core.writer.durable_end < aspool.core.writer.written_end
        io.event("finish-written", first)
        second = await aspool.enqueue("s@src.example", ["r@dest.example"], b"two" * 300)
        io.event("ack", second)
        third = await aspool.enqueue("s@src.example", ["r@dest.example"], b"three" * 300)
        io.event("ack", third)


def test_every_crash_state_around_an_unsynced_finish_keeps_the_answered_and_redelivers_nothing(
        tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    io = RecordingFileIO(str(spool_dir))
    trio.run(_workload, spool_dir, io, clock=trio.testing.MockClock(autojump_threshold=0))
    cands = crashstates.enumerate_states(io.rec, per_point=16, seed=0)
    assert len(cands) > 20
    saw_unsynced_finish = 0
    for n, (_recipe, state, events) in enumerate(crashstates.materialise(io.rec, [c.recipe for c in cands])):
        seen = io.rec.events()[:events]
        acked = {e.data[0] for e in seen if e.kind == "ack"}
        sent = {e.data[0] for e in seen if e.kind == "sent"}
        recorded = {e.data[0] for e in seen if e.kind == "recorded"}
        saw_unsynced_finish += any(e.kind == "finish-written" for e in seen)
        root = tmp_path / f"state-{n}"
        state.write_to(str(root))
        # a day later (every message is due), and in doubt (claimed, no outcome yet) delivered again, so
        # that "due" names every live message
        sp = Spool.open(str(root), spool_config(lambda: EPOCH + 1e6, in_doubt="redeliver"))
        try:
            due = {a.message_id for a in sp.poll_due()}
            assert not (due & recorded), f"state {n}: a message with a durable outcome is due again"
            assert acked - sent <= due, f"state {n}: answered {sorted(acked)}, due only {sorted(due)}"
        finally:
            sp.close()
            shutil.rmtree(root, ignore_errors=True)
    assert saw_unsynced_finish > 0, "no crash state fell after the FINISH was written"
