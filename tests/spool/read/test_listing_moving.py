"""A listing of a spool that changes under it (a running relay's): every message live throughout is listed.

Real segment files, the sync Spool. A message's envelope rewritten while a
walk is under way (here an admin hold; on a relay, the oldest runner carrying
held messages forward after recovery) is garbage at its old place, and its
replacement lies past the durable end the walk began with: a walk that
stopped there missed it, so ``mta queue list --in-doubt`` could answer
nothing right after a crash while the messages sat held.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

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


class _Watched:
    """The writer as a walk sees it, telling the test when the walk waits for a commit."""

    def __init__(self, writer: object, waiting: threading.Event) -> None:
        self._writer = writer
        self._waiting = waiting

    def __getattr__(self, name: str) -> object:
        return getattr(self._writer, name)

    def wait_durable(self, pos: int, timeout: float) -> bool:
        self._waiting.set()
        return bool(self._writer.wait_durable(pos, timeout))  # type: ignore[attr-defined]


class _Moved:
    """The spool after a runner passed a held envelope and appended its replacement: live data begins past the
    old place (as ``live_start`` says once the sweeper moved on) and the replacement is not durable yet."""

    def __init__(self, sp: Spool, start: int, waiting: threading.Event) -> None:
        self._sp, self._start, self._source = sp, start, _Watched(sp.source(), waiting)

    def source(self) -> Any:
        return self._source

    def live_start(self) -> int:
        return self._start

    def active(self) -> Any:
        return self._sp.active()

    def damage_reporter(self) -> Any:
        return self._sp.damage_reporter()


def test_a_replacement_appended_before_the_walk_began_is_listed_once_durable(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), SpoolConfig(segment_size=64 * 1024 * 1024))
    try:
        mid = sp.enqueue("a@example.org", ["r@far.example"], b"Subject: held\r\n\r\nbody\r\n")
        sp.commit()
        past_it = sp.source().durable_end
        assert sp.apply_change(admin.find(sp, mid), "hold")  # appended, its commit still to come
        waiting = threading.Event()
        got: list[list[admin.LiveMessage]] = []
        walk = threading.Thread(target=lambda: got.append(list(admin.iter_live(_Moved(sp, past_it, waiting)))))
        walk.start()
        while walk.is_alive() and not waiting.wait(0.01):
            pass
        sp.commit()
        walk.join()
        assert [(m.message_id, m.held) for m in got[0]] == [(mid, True)]
    finally:
        sp.close()
