"""The shared counter table: limits per window, the sliding estimate, eviction when full, and two processes
counting on one file (real processes, real flock)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from mta.limits.table import BUCKET, HEADER, SLOT, Counter, RateTable

NOW = 1_800_000_000.0  # a window start for windows of 60 s and 3600 s


def test_a_counter_takes_up_to_its_limit_and_a_refusal_counts_nothing(tmp_path: Path) -> None:
    table = RateTable(str(tmp_path / "t"), 64)
    c = Counter("client:192.0.2.1:messages", 3, 60)
    assert [table.take([c], NOW + i) for i in range(3)] == [None, None, None]
    assert table.take([c], NOW + 3) == c
    assert table.count(c, NOW + 3) == 3
    other = Counter("client:192.0.2.2:messages", 3, 60)
    assert table.take([other], NOW + 3) is None


def test_several_counters_are_taken_together_or_not_at_all(tmp_path: Path) -> None:
    table = RateTable(str(tmp_path / "t"), 64)
    client = Counter("client:192.0.2.1:messages", 10, 60)
    sender = Counter("sender:a@b:messages", 1, 60)
    assert table.take([client, sender], NOW) is None
    assert table.take([client, sender], NOW) == sender
    assert table.count(client, NOW) == 1  # the refused take did not count on the client either


def test_the_window_slides_over_the_previous_ones_count(tmp_path: Path) -> None:
    table = RateTable(str(tmp_path / "t"), 64)
    c = Counter("x", 4, 60)
    for _ in range(4):
        assert table.take([c], NOW + 50) is None
    assert table.take([c], NOW + 61) == c  # the next window: 4 × (59/60) still counts
    assert table.count(c, NOW + 90) == pytest.approx(2.0)  # half of the previous window is still inside
    assert table.take([c], NOW + 90) is None and table.take([c], NOW + 90) is None
    assert table.take([c], NOW + 90) == c
    assert table.count(c, NOW + 300) == 0  # two windows on: nothing


def test_a_full_bucket_forgets_its_stalest_counter(tmp_path: Path) -> None:
    table = RateTable(str(tmp_path / "t"), BUCKET)  # one bucket: every counter competes for its slots
    old = Counter("old", 1, 60)
    assert table.take([old], NOW) is None
    fresh = [Counter(f"fresh{i}", 1, 60) for i in range(BUCKET - 1)]
    for c in fresh:
        assert table.take([c], NOW + 200) is None
    newcomer = Counter("newcomer", 1, 60)
    assert table.take([newcomer], NOW + 200) is None  # took the slot of "old", whose windows had passed
    assert all(table.count(c, NOW + 200) == 1 for c in fresh)
    assert table.take([old], NOW + 200) is None  # forgotten: it starts again


def test_a_file_of_another_shape_is_reset(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_bytes(b"garbage" * 10)
    table = RateTable(str(path), 64)
    assert path.stat().st_size == HEADER + 64 * SLOT
    c = Counter("x", 1, 60)
    assert table.take([c], NOW) is None
    table.close()
    assert RateTable(str(path), 64).take([c], NOW) == c  # same shape: the counts stay
    assert RateTable(str(path), 128).take([c], NOW) is None  # another size: reset


def _take_many(path: str, n: int, results: multiprocessing.Queue[int]) -> None:
    table = RateTable(path, 64)
    c = Counter("shared", 700, 3600)
    results.put(sum(table.take([c], NOW) is None for _ in range(n)))


def test_two_processes_count_on_one_file(tmp_path: Path) -> None:
    """Each process tries 500 takes of a counter limited to 700: exactly 700 succeed in all."""
    path = str(tmp_path / "t")
    ctx = multiprocessing.get_context("fork")
    results: multiprocessing.Queue[int] = ctx.Queue()
    procs = [ctx.Process(target=_take_many, args=(path, 500, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sum(got) == 700 and min(got) > 0
