"""The shared verification cache file: two views of one file, expiry, a torn line, the bound and compaction."""

from __future__ import annotations

import time
from pathlib import Path

from mta.recipients.verify_cache import Answer, VerifyCache
from mta.smtp.common import Reply

YES = Reply(250, "2.1.5", "Ok")
NO = Reply(550, "5.1.1", "No such user here")


def test_what_one_view_puts_the_other_gets_and_expired_answers_count_as_none(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    a, b = VerifyCache(path, 100), VerifyCache(path, 100)
    assert a.get("x@far.test") is None and b.get("x@far.test") is None
    a.put("x@far.test", Answer(NO, time.time() + 60))
    a.put("old@far.test", Answer(YES, time.time() - 1))
    got = b.get("x@far.test")
    assert got is not None and got.reply == NO
    assert b.get("old@far.test") is None
    b.put("x@far.test", Answer(YES, time.time() + 60))  # the last line for an address wins
    got = a.get("x@far.test")
    assert got is not None and got.reply == YES
    assert VerifyCache(path, 100).get("x@far.test") == got  # a fresh view: read from the file


def test_a_torn_line_is_skipped_and_the_file_is_compacted_to_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    path.write_bytes(b"9999999999\t550\t5.1.1\ttorn@far")  # a crash mid-line; the next append ends it
    a = VerifyCache(str(path), 10)
    for i in range(25):
        a.put(f"u{i}@far.test", Answer(YES, time.time() + 60))
    lines = path.read_bytes().splitlines()
    assert len(lines) <= 21 and b"u24@far.test" in lines[-1]  # rewritten once past 2 * 10 lines
    fresh = VerifyCache(str(path), 10)
    assert fresh.get("u24@far.test") is not None and fresh.get("u0@far.test") is None  # the newest 10 kept
    assert fresh.get("torn@far") is None
    b = VerifyCache(str(path), 10)
    b.get("u24@far.test")
    a.put("after@far.test", Answer(NO, time.time() + 60))  # a view that compacted goes on appending
    assert b.get("after@far.test") is not None
    assert len(a.answers) <= 10 and len(b.answers) <= 10


def test_a_cache_that_cannot_be_written_is_kept_in_memory(tmp_path: Path) -> None:
    cache = VerifyCache(str(tmp_path / "no-such-dir" / "cache"), 10)
    cache.put("x@far.test", Answer(YES, time.time() + 60))
    got = cache.get("x@far.test")
    assert got is not None and got.reply == YES
