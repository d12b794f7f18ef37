"""Recovery reads the delivery workers' own marks as it reads ``sending``: a marked recipient with no outcome is in
doubt, a claim without a mark is due again, a marks file that cannot be read whole makes every claim doubt, and a
checkpoint past a closed file's attempts deletes it."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import pytest
from spool_support import spool_config

from fault_injection.workloads import FakeClock as Clock
from spool.engine.spool import Spool
from spool.format.marks import marks_dir
from spool.read import listing as admin
from spool.write.marks import MarksWriter

config = functools.partial(spool_config, retry_intervals=(600.0, 3600.0))


def live(sp: Spool) -> dict[int, admin.LiveMessage]:
    return {m.message_id: m for m in admin.iter_live(sp)}


def two_claims(path: Path, clock: Clock) -> tuple[int, int, int]:
    """Two messages claimed, their STARTs durable, no outcome: the crash came mid-delivery. Returns both
    queue ids and the first attempt's START."""
    sp = Spool.open(str(path), config(clock))
    first = sp.enqueue("s@src.example", ["a@x.example", "b@x.example"], b"body one")
    second = sp.enqueue("s@src.example", ["c@y.example"], b"body two")
    sp.commit()
    attempts = {a.message_id: a for a in sp.poll_due()}
    sp.commit()
    sp.close()
    return first, second, attempts[first].start_pos


def test_a_marked_recipient_is_in_doubt_and_an_unmarked_claim_is_due_again(tmp_path: Path) -> None:
    clock = Clock()
    first, second, start = two_claims(tmp_path, clock)
    with MarksWriter(marks_dir(str(tmp_path)), "w0-1") as marks:
        marks.add(start, ["b@x.example"])
        marks.sync()  # the worker's mark is durable: its final dot may have gone

    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert (sp.recovery_stats.in_flight, sp.recovery_stats.in_doubt, sp.recovery_stats.held) == (2, 1, 1)
        messages = live(sp)
        assert messages[first].held and messages[first].envelope.in_doubt == ("b@x.example",)
        assert not messages[second].held and messages[second].envelope.in_doubt == ()
    finally:
        sp.close()


def test_a_damaged_marks_file_is_quarantined_and_every_claim_is_doubt(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    first, second, start = two_claims(tmp_path, clock)
    with MarksWriter(marks_dir(str(tmp_path)), "w0-1") as marks:
        marks.add(start, ["b@x.example"])
        marks.add(start + 1, ["nobody@x.example"])
        marks.sync()
        path = marks.path
    with open(path, "r+b") as f:  # a byte of the first record flipped: the second still follows it
        f.seek(16 + 9)
        byte = f.read(1)
        f.seek(16 + 9)
        f.write(bytes([byte[0] ^ 0xFF]))

    with caplog.at_level(logging.ERROR, logger="spool"):
        sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.held == 2
        messages = live(sp)
        assert messages[first].envelope.in_doubt == ("a@x.example", "b@x.example")
        assert messages[second].envelope.in_doubt == ("c@y.example",)
        assert not os.path.exists(path)
        assert any("damaged marks file" in r.getMessage() and os.path.basename(path) in r.getMessage()
                   for r in caplog.records)
        assert any(name.startswith("marks-") and name.endswith(".bin")
                   for name in os.listdir(tmp_path / "quarantine"))
    finally:
        sp.close()


def test_a_checkpoint_past_a_closed_files_attempts_deletes_it(tmp_path: Path) -> None:
    clock = Clock()
    _first, _second, start = two_claims(tmp_path, clock)
    with MarksWriter(marks_dir(str(tmp_path)), "w0-1") as marks:
        marks.add(start, ["b@x.example"])
        marks.sync()
        path = marks.path
    sp = Spool.open(str(tmp_path), config(clock))  # recovery ends both attempts, and checkpoints past them
    try:
        assert sp.recovery_stats.held == 1
        assert not os.path.exists(path)
    finally:
        sp.close()


def test_a_file_a_live_writer_holds_is_kept_by_the_collector(tmp_path: Path) -> None:
    clock = Clock()
    _first, _second, start = two_claims(tmp_path, clock)
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        with MarksWriter(marks_dir(str(tmp_path)), "w0-2") as marks:
            marks.add(start, ["b@x.example"])
            marks.sync()
            clock.advance(1.0)
            sp.enqueue("s@src.example", ["d@z.example"], b"body three")
            sp.commit()
            sp.checkpoint()
            assert os.path.exists(marks.path)  # its writer holds it: never deleted under it
    finally:
        sp.close()


def test_a_marks_file_that_cannot_be_read_does_not_stop_the_start(tmp_path: Path) -> None:
    """A name of a marks file that is a directory (the read fails with EISDIR): the start goes on, and since no one
    can tell which dots went, every claim in flight is held in doubt."""
    clock = Clock()
    _first, second, _start = two_claims(tmp_path, clock)
    os.makedirs(os.path.join(marks_dir(str(tmp_path)), "w0-1-1.marks"))
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.held == 2
        assert live(sp)[second].envelope.in_doubt == ("c@y.example",)
    finally:
        sp.close()


def test_a_marks_directory_that_cannot_be_listed_does_not_stop_the_start(tmp_path: Path) -> None:
    clock = Clock()
    first, _second, _start = two_claims(tmp_path, clock)
    Path(marks_dir(str(tmp_path))).write_bytes(b"not a directory")
    sp = Spool.open(str(tmp_path), config(clock))
    try:
        assert sp.recovery_stats.held == 2
        assert live(sp)[first].envelope.in_doubt == ("a@x.example", "b@x.example")
    finally:
        sp.close()
