"""The event stream read from the log: what each record becomes, and that only durable records are shown.

Real spools on real files (the synchronous engine, a fixed clock); the
stream is read as another process would, from the files and the published
durable horizon alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from spool import (
    CursorError,
    EventStream,
    NotARecord,
    OsFileIO,
    Outcome,
    Spool,
    SpoolConfig,
    Status,
    format_id,
    format_pos,
    list_cursors,
    load_cursor,
    store_cursor,
)
from spool.format.horizon import decode_horizon, encode_horizon

NOW = 1_800_000_000.0


def config(**overrides: Any) -> SpoolConfig:
    opts: dict[str, Any] = {"retry_intervals": (60.0, 600.0), "checkpoint_interval": float("inf"),
                            "clock": lambda: NOW}
    opts.update(overrides)
    return SpoolConfig(**opts)


def kinds(stream: EventStream, after: int | None = None) -> list[tuple[str, str | None, str]]:
    return [(e.kind, e.queue_id, e.id) for e in stream.read(after).events]


def deliver(sp: Spool, outcomes: dict[str, Status]) -> None:
    for attempt in sp.poll_due(now=NOW + 1):
        sp.record_delivery(attempt, [Outcome(r, outcomes[r], 250 if s is Status.DELIVERED else 451, "", "r", "hop")
                                     for r, s in outcomes.items() if r in attempt.envelope.recipients])
        deferred = [r for r in attempt.envelope.recipients if outcomes.get(r) is Status.DEFERRED]
        sp.finish(attempt, next_class=1 if deferred else None)
    sp.commit()


def test_each_transition_is_an_event_whose_id_is_its_record_position(tmp_path: Path) -> None:
    sp = Spool.create(str(tmp_path), config())
    try:
        qid = sp.enqueue("a@src.example", ["ok@dst.example", "later@dst.example"], b"Subject: x\r\n\r\nbody\r\n")
        sp.commit()
        deliver(sp, {"ok@dst.example": Status.DELIVERED, "later@dst.example": Status.DEFERRED})
        stream = EventStream(str(tmp_path), retry_intervals=(60.0, 600.0))
        events = stream.read().events
        assert [e.kind for e in events] == ["received", "delivered", "deferred", "retry_scheduled"]
        assert {e.queue_id for e in events} == {format_id(qid)}
        received, delivered, deferred, retry = events
        assert received.id == format_pos(received.pos) and received.fields["recipients"] == [
            "ok@dst.example", "later@dst.example"]
        # one DELIVERY record, one event per recipient: the same position, the recipient's index
        assert delivered.pos == deferred.pos and (delivered.id, deferred.id) == (
            f"{format_pos(delivered.pos)}/0", f"{format_pos(delivered.pos)}/1")
        assert delivered.fields["recipient"] == "ok@dst.example" and delivered.fields["attempt"] == 1
        assert retry.fields["recipients"] == ["later@dst.example"] and retry.fields["retry_class"] == 1
        assert retry.fields["next_retry_ms"] == retry.time_ms + 60_000
        # the admin changes, each its own event
        for action in ("flush", "hold", "release", "delete"):
            assert sp.change(qid, action)
        later = stream.read(retry.pos).events
        assert [e.kind for e in later] == ["requeued", "held", "released", "deleted"]
        assert later[-1].fields["recipient"] == "later@dst.example"
        # a reader that begins anywhere gives each record the same kind and id
        for begin in later:
            assert [(e.id, e.kind) for e in EventStream(str(tmp_path)).read(since=begin.pos).events] == [
                (e.id, e.kind) for e in later if e.pos >= begin.pos]
    finally:
        sp.close()


def test_a_read_resumes_after_its_cursor_and_ids_are_the_same_after_a_reopen(tmp_path: Path) -> None:
    sp = Spool.create(str(tmp_path), config())
    for i in range(5):
        sp.enqueue("a@src.example", [f"r{i}@dst.example"], b"x\r\n")
    sp.commit()
    stream = EventStream(str(tmp_path))
    first = stream.read(max_records=2)
    rest = stream.read(first.after)
    assert len(first.events) == 2 and len(rest.events) == 3
    assert not {e.id for e in first.events} & {e.id for e in rest.events}
    assert stream.read(rest.after).events == []
    sp.close()  # a crash, for the engine: nothing happens at close
    sp = Spool.open(str(tmp_path), config())
    try:
        again = EventStream(str(tmp_path)).read()
        assert [e.id for e in again.events] == [e.id for e in first.events + rest.events]
    finally:
        sp.close()


def test_records_past_the_durable_horizon_are_not_shown(tmp_path: Path) -> None:
    sp = Spool.create(str(tmp_path), config())
    try:
        sp.enqueue("a@src.example", ["one@dst.example"], b"x\r\n")
        sp.commit()
        stream = EventStream(str(tmp_path))
        seen = stream.read()
        assert [e.kind for e in seen.events] == ["received"]
        w = sp.writer
        sp.enqueue("a@src.example", ["two@dst.example"], b"x\r\n")
        w.write_batch(w.take_batch(sync=False))  # on the file, not synced: a crash may take it back
        assert w.written_end > w.durable_end
        assert stream.read(seen.after).events == []
        assert stream.horizon() == w.durable_end
        w.write_batch(w.take_batch(sync=True))  # the next commit's fdatasync covers it
        assert [e.fields["recipients"] for e in stream.read(seen.after).events] == [["two@dst.example"]]
    finally:
        sp.close()


def test_the_horizon_file_is_checked_and_a_torn_one_shows_nothing_new(tmp_path: Path) -> None:
    data = encode_horizon((3 << 32) | 100)
    assert decode_horizon(data) == (3 << 32) | 100
    assert decode_horizon(data[:15]) is None
    assert decode_horizon(data[:4] + b"\xff" + data[5:]) is None
    sp = Spool.create(str(tmp_path), config())
    try:
        sp.enqueue("a@src.example", ["one@dst.example"], b"x\r\n")
        sp.commit()
        (tmp_path / "durable").write_bytes(data[:7])
        stream = EventStream(str(tmp_path))
        assert stream.read().events == [] and stream.horizon() is None
    finally:
        sp.close()


def test_a_position_where_no_record_begins_is_refused(tmp_path: Path) -> None:
    sp = Spool.create(str(tmp_path), config())
    try:
        qid = sp.enqueue("a@src.example", ["one@dst.example"], b"x\r\n")
        sp.commit()
        stream = EventStream(str(tmp_path))
        pos = stream.read().events[0].pos
        assert [e.queue_id for e in stream.read(since=pos).events] == [format_id(qid)]
        with pytest.raises(NotARecord, match="no record starts at position"):
            stream.read(since=pos + 1)
    finally:
        sp.close()


def test_a_lagging_reader_resumes_from_the_archive_and_is_told_when_even_that_is_gone(tmp_path: Path) -> None:
    spool_dir, archive = tmp_path / "spool", tmp_path / "archive"
    clock = [NOW]
    sp = Spool.create(str(spool_dir), config(segment_size=4096, archive_dir=str(archive), retry_intervals=(1.0,),
                                             clock=lambda: clock[0]))
    try:
        stream = EventStream(str(spool_dir), archive_dir=str(archive))
        first = sp.enqueue("a@src.example", ["first@dst.example"], b"x\r\n")
        sp.commit()
        cursor = stream.read().after
        assert cursor is not None
        sp.change(first, "delete")
        for i in range(60):
            clock[0] += 10
            sp.enqueue("a@src.example", [f"r{i}@dst.example"], b"y" * 200)
            sp.commit()
            for attempt in sp.poll_due(now=clock[0]):
                sp.record_delivery(attempt, [Outcome(attempt.envelope.recipients[0], Status.DELIVERED, 250)])
                sp.finish(attempt)
            sp.commit()
        sp.checkpoint()
        sp.checkpoint()
        archived = sorted(os.listdir(archive))
        assert archived, "nothing was reclaimed: the test would prove nothing"
        every = stream.read(cursor)
        assert not every.lagged
        got = [e.fields.get("recipients", [e.fields.get("recipient")])[0] for e in every.events]
        assert got[:3] == ["first@dst.example", "r0@dst.example", "r0@dst.example"]
        assert got[-1] == "r59@dst.example" and len(got) == 1 + 2 * 60
        # the archive emptied (uploaded and removed): the reader is told what it lost and goes on
        for name in archived:
            os.unlink(archive / name)
        lagging = EventStream(str(spool_dir), archive_dir=str(archive)).read(cursor)
        assert lagging.lagged and lagging.gap is not None and lagging.gap[0] == cursor
        assert lagging.events and all(e.pos >= lagging.gap[1] for e in lagging.events)
    finally:
        sp.close()


def _busy_spool(path: Path, **overrides: Any) -> tuple[Spool, list[float]]:
    clock = [NOW]
    sp = Spool.create(str(path), config(segment_size=4096, retry_intervals=(1.0,), clock=lambda: clock[0],
                                        **overrides))
    return sp, clock


def _traffic(sp: Spool, clock: list[float], n: int) -> None:
    """``n`` messages in and delivered, the clock moving: the log behind them becomes garbage."""
    for i in range(n):
        clock[0] += 10
        sp.enqueue("a@src.example", [f"r{i}@dst.example"], b"y" * 200)
        sp.commit()
        for attempt in sp.poll_due(now=clock[0]):
            sp.record_delivery(attempt, [Outcome(attempt.envelope.recipients[0], Status.DELIVERED, 250)])
            sp.finish(attempt)
        sp.commit()


def test_a_consumers_cursor_keeps_its_unread_segments_from_reclaim_up_to_the_cap(tmp_path: Path) -> None:
    sp, clock = _busy_spool(tmp_path / "pinned")
    try:
        first = sp.enqueue("a@src.example", ["first@dst.example"], b"x\r\n")
        sp.commit()
        store_cursor(sp.io, str(tmp_path / "pinned"), "crm", first)
        _traffic(sp, clock, 60)
        sp.checkpoint()
        sp.checkpoint()
        assert min(os.listdir(tmp_path / "pinned" / "log")) == "0000000000000001.seg", \
            "the segment the cursor is in was reclaimed"
        events = EventStream(str(tmp_path / "pinned")).read(first)
        assert not events.lagged and events.events[0].fields["recipients"] == ["r0@dst.example"]
        # the consumer reads on: its cursor moves, and the segments behind it go at the next checkpoint
        store_cursor(sp.io, str(tmp_path / "pinned"), "crm", events.after or 0)
        sp.checkpoint()
        assert min(os.listdir(tmp_path / "pinned" / "log")) != "0000000000000001.seg"
    finally:
        sp.close()
    sp, clock = _busy_spool(tmp_path / "capped", cursor_pin_max=3 * 4096)
    try:
        first = sp.enqueue("a@src.example", ["first@dst.example"], b"x\r\n")
        sp.commit()
        store_cursor(sp.io, str(tmp_path / "capped"), "crm", first)
        _traffic(sp, clock, 60)
        sp.checkpoint()
        sp.checkpoint()
        assert min(os.listdir(tmp_path / "capped" / "log")) != "0000000000000001.seg", \
            "past the cap the cursor's segments were kept"
        lagging = EventStream(str(tmp_path / "capped")).read(first)
        assert lagging.lagged and lagging.gap is not None and lagging.gap[0] == first
    finally:
        sp.close()
    assert load_cursor(OsFileIO(), str(tmp_path / "capped"), "crm") == first
    assert list_cursors(OsFileIO(), str(tmp_path / "capped")) == {"crm": first}
    with pytest.raises(CursorError, match="no consumer name"):
        store_cursor(OsFileIO(), str(tmp_path / "capped"), "../x", 1)
