"""The shipper's batches: cut by count, size and age, never inside one record's events."""

from __future__ import annotations

from typing import Any

from mta.events.batching import Batcher


def ev(pos: int, index: int | None = None, pad: int = 0) -> dict[str, Any]:
    return {"id": f"{pos}" if index is None else f"{pos}/{index}", "pos": pos, "pad": "x" * pad}


def test_a_batch_is_due_when_full_or_old_and_keeps_a_records_events_together() -> None:
    b = Batcher(max_events=3, max_bytes=10_000, max_age=1.0)
    assert not b.due(0.0) and b.wait(0.0) == 1.0
    b.add([ev(1), ev(2)], now=10.0)
    assert not b.due(10.5) and b.wait(10.5) == 0.5
    assert b.due(11.0)  # old enough
    b.add([ev(3, 0), ev(3, 1), ev(3, 2)], now=10.6)
    assert b.due(10.6)  # full
    batch = b.take()
    assert [e["id"] for e in batch.events] == ["1", "2", "3/0", "3/1", "3/2"] and batch.cursor == 3
    b.acked(batch, now=12.0)
    assert b.waiting == 0 and not b.due(100.0)


def test_a_batch_is_cut_by_size_at_a_record_boundary() -> None:
    b = Batcher(max_events=100, max_bytes=300, max_age=1.0)
    b.add([ev(1, pad=100), ev(2, pad=100), ev(3, pad=100), ev(4, pad=100)], now=0.0)
    assert b.full()
    first = b.take()
    assert [e["pos"] for e in first.events] == [1, 2] and first.size <= 300
    b.acked(first, now=0.5)
    assert b.waiting == 2 and not b.due(0.5) and b.due(1.5)  # the rest waits its own age
    second = b.take()
    assert [e["pos"] for e in second.events] == [3, 4]


def test_one_record_larger_than_a_batch_still_goes_whole() -> None:
    b = Batcher(max_events=2, max_bytes=10_000, max_age=1.0)
    b.add([ev(7, i) for i in range(5)] + [ev(8)], now=0.0)
    batch = b.take()
    assert [e["id"] for e in batch.events] == [f"7/{i}" for i in range(5)]
