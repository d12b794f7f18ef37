"""A claim takes a new envelope from memory (spool.write.fresh), and gets exactly what decoding the log gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from spool_support import running_spool, spool_config

from fault_injection.workloads import FakeClock as Clock
from spool.engine.spool import Spool
from spool.format.record import Envelope, Outcome, RecordType, Status, decode_payload
from spool.write.fresh import FreshEnvelopes

EXTRAS: list[dict[str, Any] | None] = [
    None,
    {},
    {"client": "192.0.2.7"},
    {"client": "2001:db8::1", "auth": "alice", "params": {"BODY": "8BITMIME", "SMTPUTF8": True}},
    {"n": 2**70, "none": None, "flag": False, "neg": -5},
    {"tuple": ("a", "b")},  # comes back a list from CBOR: decoded, not kept
    {"f": 0.1},  # a float: decoded, not kept
    {"nested": {"deep": {"x": 1}}},  # decoded, not kept
]


def _decoded(sp: Spool, pos: int) -> Envelope:
    env = decode_payload(RecordType.ENVELOPE, sp.writer.read_frame(pos).payload)
    assert isinstance(env, Envelope)
    return env


@pytest.mark.parametrize("extra", EXTRAS)
def test_a_claimed_envelope_is_the_one_decoded_from_the_log(tmp_path: Path, extra: dict[str, Any] | None) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        hits = sp.fresh.hits
        sp.enqueue("s@src.example", ["r1@dest.example", "r2@dest.example"], b"body\r\n", extra=extra)
        sp.commit()
        (attempt,) = sp.poll_due()
        assert attempt.envelope == _decoded(sp, attempt.envelope_pos)
        assert attempt.envelope.extra == _decoded(sp, attempt.envelope_pos).extra
        kept = extra is None or all(not isinstance(v, (tuple, float)) and not (
            isinstance(v, dict) and any(isinstance(i, dict) for i in v.values())) for v in extra.values())
        assert sp.fresh.hits - hits == (1 if kept else 0)
        assert len(sp.fresh) == 0
    finally:
        sp.close()


def test_the_callers_dict_changed_after_the_append_does_not_reach_the_claim(tmp_path: Path) -> None:
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        extra: dict[str, Any] = {"client": "192.0.2.7", "params": {"BODY": "7BIT"}}
        sp.enqueue("s@src.example", ["r@dest.example"], b"body\r\n", extra=extra)
        extra["client"] = "198.51.100.1"
        extra["params"]["BODY"] = "8BITMIME"
        sp.commit()
        (attempt,) = sp.poll_due()
        assert attempt.envelope.extra == {"client": "192.0.2.7", "params": {"BODY": "7BIT"}}
        assert attempt.envelope == _decoded(sp, attempt.envelope_pos)
    finally:
        sp.close()


def test_other_bytes_at_the_position_are_decoded_not_taken_from_memory() -> None:
    fresh = FreshEnvelopes()
    fresh.add(100, b"payload-a", 1, "s@x", ("r@y",), (50,), 6, 1000, None)
    assert fresh.take(100, b"payload-b") is None
    assert fresh.take(100, b"payload-a") is None  # forgotten by the first take either way
    assert fresh.hits == 0


def test_memory_is_bounded_oldest_first() -> None:
    fresh = FreshEnvelopes(limit=3)
    for pos in range(5):
        fresh.add(pos, b"p%d" % pos, pos, "s@x", ("r@y",), (), 0, 0, None)
    assert len(fresh) == 3
    assert fresh.take(0, b"p0") is None and fresh.take(1, b"p1") is None
    env = fresh.take(4, b"p4")
    assert env is not None and env.message_id == 4


def test_after_a_restart_every_envelope_is_found_and_decoded_from_disk(tmp_path: Path) -> None:
    """Memory is lost with the process: the claims after it read everything from the log, as before."""
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock))
    ids = [sp.enqueue("s@src.example", [f"r{i}@dest.example"], b"body %d\r\n" % i, extra={"client": "192.0.2.7"})
           for i in range(20)]
    sp.commit()
    sp.close()  # no shutdown path: this only releases the descriptors and the lock
    sp = Spool.open(str(tmp_path), spool_config(clock))
    try:
        assert len(sp.fresh) == 0
        attempts = sp.poll_due()
        assert sorted(a.message_id for a in attempts) == sorted(ids)
        assert sp.fresh.hits == 0
        for a in attempts:
            assert a.envelope == _decoded(sp, a.envelope_pos)
            sp.record_delivery(a, [Outcome(a.envelope.recipients[0], Status.DELIVERED, 250)])
            sp.finish(a)
        sp.commit()
    finally:
        sp.close()


async def test_a_batch_without_an_envelope_does_not_wake_the_claimer(tmp_path: Path) -> None:
    """The committer signals after every batch; only one that made an envelope durable wakes ``next_due``."""
    clock = Clock()
    async with running_spool(tmp_path, spool_config(clock)) as aspool:
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"body\r\n")
        (attempt,) = await aspool.next_due()
        changed = aspool._changed
        await aspool.record_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])
        assert not changed.is_set(), "a DELIVERY commit woke the claimer for nothing"
        got: list[int] = []

        async def waiter() -> None:
            got.extend(a.message_id for a in await aspool.next_due())

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                mid = await aspool.enqueue("s@src.example", ["r2@dest.example"], b"body 2\r\n")
        assert got == [mid]
        assert changed.is_set()


def test_a_deferred_envelope_the_budget_kept_a_runner_from_reading_still_gives_a_wake_time(tmp_path: Path) -> None:
    """Once the claimer is woken only for new envelopes, ``next_wake`` must name the time of a runner that the
    budget did not let read the log past where it last looked: nothing else would wake the claimer for it."""
    clock = Clock()
    sp = Spool.open(str(tmp_path), spool_config(clock, retry_intervals=(1.0, 2.0)))
    try:
        assert sp.poll_due() == []  # every runner reads to the end of the (empty) log
        sp.enqueue("s@src.example", ["a@dest.example"], b"one\r\n")
        sp.commit()
        (first,) = sp.poll_due()
        sp.record_delivery(first, [Outcome("a@dest.example", Status.DEFERRED, 451)])
        assert sp.finish(first) is not None  # a replacement envelope in class 1
        sp.enqueue("s@src.example", ["b@dest.example"], b"two\r\n")
        sp.commit()
        (second,) = sp.poll_due()  # new mail flows: no deferred claim allowed yet, class 1 does not read
        assert second.envelope.recipients == ("b@dest.example",)
        wake = sp.next_wake()
        assert wake is not None, "the deferred message would wait for an unrelated commit"
        clock.advance(max(0.0, wake - clock()) + 1.0)  # past its interval and the budget's gate
        got = sp.poll_due()
        assert [a.envelope.recipients for a in got] == [("a@dest.example",)]
    finally:
        sp.close()


async def test_a_batch_that_reaches_a_new_segment_wakes_the_claimer_without_an_envelope(tmp_path: Path) -> None:
    """A segment is deleted only once every runner has passed it: bytes that hold no envelope (the body of a
    message refused at its end of data) must still move the runners when they fill segments, or a full disk
    stays full (tests/security/test_security_disk.py's 552 test hung so, now and then, under load)."""
    clock = Clock()
    async with running_spool(tmp_path, spool_config(clock, segment_size=64 * 1024, body_chunk=8192)) as aspool:
        await aspool.enqueue("s@src.example", ["r@dest.example"], b"body\r\n")
        (attempt,) = await aspool.next_due()
        await aspool.record_delivery(attempt, [Outcome("r@dest.example", Status.DELIVERED, 250)])
        changed = aspool._changed
        first_segment = aspool.core.writer.durable_end >> 32
        refused = aspool.begin_body()
        refused.write(b"x" * 100 * 1024)  # never enqueued: garbage once the runners pass it
        await aspool.commit()
        assert aspool.core.writer.durable_end >> 32 > first_segment
        assert changed.is_set(), "bytes that filled a segment left the runners asleep in front of them"
