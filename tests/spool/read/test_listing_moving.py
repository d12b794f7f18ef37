"""A listing of a spool that changes under it (a running relay's): every message live throughout is listed.

Real segment files, the sync Spool. A message's envelope rewritten while a
walk is under way (here an admin hold; on a relay, the oldest runner carrying
held messages forward after recovery) is garbage at its old place, and its
replacement lies past the durable end the walk began with: a walk that
stopped there missed it, so ``mta queue list --in-doubt`` could answer
nothing right after a crash while the messages sat held.
"""

from __future__ import annotations

from pathlib import Path

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.read import listing as admin

BIG = b"x" * (700 * 1024)  # two bodies apart put an envelope past the reader's first window


def test_a_message_rewritten_while_a_walk_is_under_way_is_still_listed(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), SpoolConfig(segment_size=64 * 1024 * 1024))
    try:
        ids = [sp.enqueue("a@example.org", [f"r{i}@far.example"], b"Subject: %d\r\n\r\n" % i + BIG)
               for i in range(3)]
        sp.commit()
        walk = admin.iter_live(sp)
        first = next(walk)
        assert first.message_id == ids[0]
        assert sp.change(ids[2], "hold"), "the last message's envelope is rewritten at the log's tail"
        rest = list(walk)
        assert {m.message_id for m in rest} == {ids[1], ids[2]}
        assert [m.held for m in rest if m.message_id == ids[2]] == [True]
    finally:
        sp.close()
