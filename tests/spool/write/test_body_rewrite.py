"""A body rewritten after its data (``BodyWriter.rewrite``: a mail filter's changes) and a message enqueued held.

The rewritten message keeps its id and its first record (the relay's
``Received:``); every reader sends the new bytes, from the body cache and
after a restart. A held enqueue (a filter's quarantine) is never due until
released.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.errors import SpoolError
from spool.read import listing as admin

RECEIVED = b"Received: from client by relay.test with ESMTP id X\r\n"
CLIENT = b"From: a@example.com\r\nSubject: s\r\n\r\n" + b"the client's line\r\n" * 40
FILTERED = b"X-Filter: yes\r\nFrom: a@example.com\r\nSubject: s\r\n\r\nthe filter's body\r\n"


def _config(body_cache: int = 4 << 20) -> SpoolConfig:
    return SpoolConfig(segment_size=4096, body_chunk=256, retry_intervals=(60.0,), body_cache=body_cache)


@pytest.mark.parametrize("body_cache", [4 << 20, 0], ids=["cached", "read-back"])
def test_a_rewritten_body_is_what_every_reader_sends(tmp_path: Path, body_cache: int) -> None:
    sp = Spool.open(str(tmp_path), _config(body_cache))
    try:
        body = sp.begin_body(first=lambda mid: RECEIVED)
        body.write(CLIENT)
        first = body.chunks[0]
        body.rewrite(FILTERED)
        assert body.chunks[0] == first and body.size == len(RECEIVED + FILTERED)
        mid = sp.enqueue("a@example.com", ["b@example.net"], body)
        sp.commit()
        assert mid == body.message_id
        msg = admin.find(sp, mid)
        assert b"".join(sp.read_body(msg.envelope)) == RECEIVED + FILTERED
        assert msg.envelope.body_size == len(RECEIVED + FILTERED)
        with pytest.raises(SpoolError):
            body.rewrite(b"too late")
    finally:
        sp.close()
    sp = Spool.open(str(tmp_path), _config(body_cache))
    try:
        (attempt,) = sp.poll_due()
        assert b"".join(sp.read_body(attempt.envelope)) == RECEIVED + FILTERED
    finally:
        sp.close()


def test_a_body_not_begun_cannot_be_rewritten(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), _config())
    try:
        body = sp.begin_body()
        body.write(CLIENT)
        with pytest.raises(SpoolError):
            body.rewrite(FILTERED)
    finally:
        sp.close()


def test_a_message_enqueued_held_is_not_due_until_released(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), _config())
    try:
        mid = sp.append_message("a@example.com", ["b@example.net"], CLIENT, held=True).message_id
        sp.commit()
        assert admin.find(sp, mid).held
        assert sp.poll_due() == []
        assert sp.change(mid, "release")
        assert [a.envelope.message_id for a in sp.poll_due()] == [mid]
    finally:
        sp.close()
