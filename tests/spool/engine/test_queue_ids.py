"""Queue ids decided as a body begins (``BodyWriter.begin``): unique, increasing, and kept by the enqueue.

docs/design.md, "Queue ids, decided as DATA begins"; docs/format.md, "Positions and queue ids".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.errors import SpoolError
from spool.read import listing as admin


def _config() -> SpoolConfig:
    return SpoolConfig(segment_size=4096, body_chunk=256, retry_intervals=(60.0,))


def test_an_id_taken_as_the_body_begins_is_the_messages_id_and_its_first_record_names_it(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), _config())
    try:
        head = sp.writer.head
        body = sp.begin_body(first=lambda mid: f"Received: id {sp.queue_id(mid)}\r\n".encode())
        assert body.message_id == head and body.chunks == [head]  # appended at once, as a record of its own
        body.write(b"Subject: x\r\n\r\n" + b"y" * 1000)
        mid = sp.enqueue("s@x.example", ["r@y.example"], body)
        sp.commit()
        assert mid == head
        (msg,) = admin.iter_live(sp)
        assert msg.message_id == head
        data = b"".join(sp.read_body(msg.envelope))
        assert data.startswith(f"Received: id {sp.queue_id(head)}\r\nSubject: x".encode())
        assert msg.envelope.body_size == len(data)
    finally:
        sp.close()


def test_ids_are_unique_and_increase_in_the_order_bodies_began_across_restarts_and_rotation(tmp_path: Path) -> None:
    """Interleaved bodies, some aborted, some enqueued whole, past several segments; then a restart."""
    seen: list[int] = []
    for _life in range(2):
        sp = Spool.open(str(tmp_path), _config())
        try:
            for i in range(40):
                a = sp.begin_body(first=lambda mid: b"Received: a\r\n" * 20)
                b = sp.begin_body(first=lambda mid: b"Received: b\r\n")
                assert a.message_id is not None and b.message_id is not None
                seen += [a.message_id, b.message_id]
                b.write(b"body b " * 50)
                a.write(b"body a " * 50)
                if i % 3 == 0:
                    a.abort()  # an aborted message leaves its id unused, never given again
                else:
                    assert sp.enqueue("s@x.example", ["r@y.example"], a) == a.message_id
                assert sp.enqueue("s@x.example", ["r@y.example"], b) == b.message_id
                seen.append(sp.enqueue("s@x.example", ["r@y.example"], b"whole"))  # the old rule: the envelope's
                sp.commit()
        finally:
            sp.close()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert len({s >> 32 for s in seen}) > 2  # several segments: rotation was crossed


def test_begin_after_data_is_refused(tmp_path: Path) -> None:
    sp = Spool.open(str(tmp_path), _config())
    try:
        body = sp.begin_body()
        body.write(b"x" * 300)  # a chunk went out
        with pytest.raises(SpoolError, match="before anything else"):
            body.begin(lambda mid: b"late")
    finally:
        sp.close()
