"""The page of connected-client counts that a relay's shards share (``mta.process.presence``)."""

from __future__ import annotations

from pathlib import Path

from mta.config import parse_config
from mta.inbound.admission import Slot
from mta.process.presence import Presence, SharedSlots, presence_path
from mta.shards import shard_dir


def test_each_shard_writes_its_count_and_reads_the_sum(tmp_path: Path) -> None:
    spool = str(tmp_path / "q")
    path = presence_path(spool, 0)
    assert path == presence_path(shard_dir(spool, 1), 1) == str(tmp_path / "q" / "shards" / "sessions")
    (tmp_path / "q" / "shards").mkdir(parents=True)
    zero, one = Presence(path, 0, 2), Presence(path, 1, 2)
    assert zero.total() == one.total() == 0
    zero.publish(3)
    one.publish(2)
    assert zero.total() == one.total() == 5
    # A restarted shard starts from none of its own; the other's count stays.
    assert Presence(path, 0, 2).total() == 2 == one.total()


def test_the_servers_slots_publish_every_admission_and_release(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    config = parse_config("", base_dir=str(tmp_path))
    path = presence_path(str(tmp_path), 0)
    other = Presence(path, 1, 2)
    other.publish(1)
    slots = SharedSlots(config, Presence(path, 0, 2))
    first, second = slots.admit("192.0.2.1"), slots.admit("192.0.2.2")
    assert isinstance(first, Slot) and isinstance(second, Slot)
    assert other.total() == 3
    slots.release(first)
    assert other.total() == 2
    slots.release(second)
    assert other.total() == 1 and slots.total == 0
