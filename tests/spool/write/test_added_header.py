"""A header added once the whole body is written (``BodyWriter.add_header``: the relay's DKIM-Signature).

It is appended after the body but listed second, after the body's first
record: every reader sends the message in list order (Received:, the added
header, the client's data), from the body cache, after a restart, and after
a deferral copied the body forward; the client's records are never touched.
docs/format.md, ENVELOPE key 3; docs/design.md, "DKIM signing".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.errors import SpoolError
from spool.format.record import Outcome, Status, pos_segment
from spool.read import listing as admin

RECEIVED = b"Received: from client by relay.test with ESMTP id X\r\n"
SIGNATURE = b"DKIM-Signature: v=1; a=ed25519-sha256; d=example.com; s=s1; b=AAAA\r\n"
CLIENT = b"From: a@example.com\r\nSubject: s\r\n\r\n" + b"0123456789abcdef\r\n" * 40


def _config(body_cache: int = 4 << 20) -> SpoolConfig:
    return SpoolConfig(segment_size=4096, body_chunk=256, retry_intervals=(60.0,), body_cache=body_cache)


def _accept(sp: Spool) -> int:
    body = sp.begin_body(first=lambda mid: RECEIVED)
    body.write(CLIENT)
    client_records = list(body.chunks)
    body.add_header(SIGNATURE)
    assert body.chunks[0] == client_records[0] and body.chunks[1] > max(client_records), \
        "appended after the body, listed second"
    mid = sp.enqueue("a@example.com", ["b@example.net"], body)
    sp.commit()
    return mid


@pytest.mark.parametrize("body_cache", [4 << 20, 0], ids=["cached", "read-back"])
def test_the_added_header_is_sent_second_from_the_cache_and_after_a_restart(tmp_path: Path, body_cache: int) -> None:
    whole = RECEIVED + SIGNATURE + CLIENT
    sp = Spool.open(str(tmp_path), _config(body_cache))
    try:
        mid = _accept(sp)
        msg = admin.find(sp, mid)
        assert (sp.cached_body(msg.envelope) is not None) == (body_cache > 0)
        assert b"".join(sp.read_body(msg.envelope)) == whole
        assert msg.envelope.body_size == len(whole)
        assert sp.read_chunk(msg.envelope.body[0]) == RECEIVED  # the client's records are untouched
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), _config(body_cache))
    try:
        (attempt,) = sp.poll_due()
        assert b"".join(sp.read_body(attempt.envelope)) == whole
    finally:
        sp.close()


def test_a_body_copied_forward_at_a_retry_keeps_the_header_in_place(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), _config(0))
    try:
        mid = _accept(sp)
        (attempt,) = sp.poll_due()
        for i in range(80):  # push the head a few segments on: the replacement copies the body forward
            sp.enqueue(f"x{i}@example.com", (f"y{i}@example.org",), b"filler\r\n" * 80)
        sp.commit()
        sp.record_delivery(attempt, [Outcome("b@example.net", Status.DEFERRED, 451, "4.0.0", "later", "mx")])
        sp.finish(attempt)
        sp.commit()
        msg = admin.find(sp, mid)
        assert pos_segment(min(msg.envelope.body)) > pos_segment(max(attempt.envelope.body)), "not copied"
        assert b"".join(sp.read_body(msg.envelope)) == RECEIVED + SIGNATURE + CLIENT
    finally:
        sp.close()


def test_a_header_needs_a_begun_body_that_is_still_open(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), _config())
    try:
        plain = sp.begin_body()
        plain.write(b"x")
        with pytest.raises(SpoolError, match="begin"):
            plain.add_header(SIGNATURE)
        aborted = sp.begin_body(first=lambda mid: RECEIVED)
        aborted.abort()
        with pytest.raises(SpoolError):
            aborted.add_header(SIGNATURE)
    finally:
        sp.close()
