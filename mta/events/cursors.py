"""Named consumers' cursors, per shard: each kept in its shard's spool (``spool.store_cursor``), where the
engine finds them and keeps the segments they have not read from reclaim."""

from __future__ import annotations

from mta.config import Config
from mta.shards import shard_config, shard_count
from spool import CursorError, OsFileIO, check_cursor_name, list_cursors, load_cursor, store_cursor

__all__ = ["CursorError", "Cursors", "check_name"]

check_name = check_cursor_name


class Cursors:
    """The cursors of ``config``'s relay. Blocking file I/O (store fsyncs): call from a worker thread."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.io = OsFileIO()

    def _dir(self, shard: int) -> str:
        return shard_config(self.config, shard, shard_count(self.config)).spool.dir

    def load(self, name: str, shard: int = 0) -> int | None:
        return load_cursor(self.io, self._dir(shard), name)

    def store(self, name: str, shard: int, position: int) -> None:
        store_cursor(self.io, self._dir(shard), name, position)

    def all(self, shard: int = 0) -> dict[str, int | None]:
        return list_cursors(self.io, self._dir(shard))
