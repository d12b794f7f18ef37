"""Message bodies: streamed into DATA records as they arrive, and kept a while for delivery.

A body is a run of DATA records written before its envelope (docs/design.md,
"Bodies: inline DATA records"). ``BodyWriter`` appends them chunk by chunk as
the client sends them, so a 50 MB message passes in bounded memory;
``BodyCache`` keeps the chunks of recently accepted small messages, so that a
delivery a moment later reads nothing back from disk. Reading bodies back, and
copying a deferred message's body forward, is the spool's
(``spool.engine.core.SpoolCore.read_body``, ``_localise``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from spool.config.engine import SpoolConfig
from spool.errors import SpoolError
from spool.format.record import RecordType


class BodySink(Protocol):
    """What a ``BodyWriter`` writes into: the spool (``spool.engine.core.SpoolCore``)."""

    config: SpoolConfig
    body_cache: BodyCache
    _open_bodies: dict[int, int]  # id(writer) -> position of its first DATA record, while it is written

    def _append(self, rtype: RecordType, payload: Any, klass: int = 0) -> int: ...

    def _next_position(self) -> int: ...

    def _maybe_flush(self) -> None: ...


class BodyCache:
    """Bodies of recently enqueued messages, by the position of their first DATA record.

    Why: most mail is delivered a moment after it is accepted; reading its body
    back from the log costs a read and, in the relay, a hop to a worker thread.
    Bounded in bytes. Under a backlog the oldest entries are the next to be
    delivered, so a full cache refuses newcomers rather than evicting them;
    only entries older than ``max_age`` (a message held or deleted before
    delivery, whose attempt never ends) make way. Entries leave when their
    message's attempt ends.
    """

    def __init__(self, limit: int, max_age: float = 60.0) -> None:
        self.limit = limit
        self.item_limit = limit // 4
        self.max_age = max_age
        self.bytes = 0
        self.hits = 0
        self._items: OrderedDict[int, tuple[float, tuple[bytes, ...], int]] = OrderedDict()

    def add(self, key: int, chunks: tuple[bytes, ...], size: int, now: float) -> None:
        if size > self.item_limit or key in self._items:
            return
        while self._items and self.bytes + size > self.limit:
            old_key, (added, _chunks, old_size) = next(iter(self._items.items()))
            if added > now - self.max_age:
                return
            del self._items[old_key]
            self.bytes -= old_size
        self._items[key] = (now, chunks, size)
        self.bytes += size

    def get(self, key: int) -> tuple[bytes, ...] | None:
        item = self._items.get(key)
        if item is None:
            return None
        self.hits += 1
        return item[1]

    def drop(self, key: int) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.bytes -= item[2]

    def __len__(self) -> int:
        return len(self._items)


class BodyWriter:
    """Streams a message body into DATA records as it arrives.

    Why: a 50 MB message must pass through in bounded memory. Chunks are
    appended (not synced) as they fill; the enqueue's commit makes them durable
    together with the envelope. A body small enough for the spool's body cache
    also keeps its chunks (references to bytes made anyway) for that cache.

    ``message_id``: set by ``begin``, the message's id decided as its body
    starts (docs/design.md, "Queue ids"); None until then, and then the
    enqueue gives the message its id.
    """

    def __init__(self, spool: BodySink) -> None:
        self._spool = spool
        self._buf = bytearray()
        self.chunks: list[int] = []
        self.size = 0
        self.closed = False
        self.discarding = False
        self.kept: list[bytes] | None = [] if spool.body_cache.item_limit > 0 else None
        self.message_id: int | None = None
        self._first_size = 0  # the bytes of the record ``begin`` wrote

    def begin(self, first: Callable[[int], bytes]) -> int:
        """Decide the message's id now and start the body with ``first(id)``, as a record of its own.

        Why: a receiver writes the id into the body's first bytes (the
        ``Received:`` header names the queue id), long before the envelope.
        The id is the log head as that first record is appended: the same
        rule as an enqueue's (the head as the envelope is appended), so ids
        stay unique and increasing, here in the order bodies began. The
        record is appended at once so that no other message can be given
        the same head.

        Raises SpoolError if anything was written to the body already.
        """
        if self.chunks or self._buf or self.closed or self.discarding:
            raise SpoolError("begin() must come before anything else is written to a body")
        mid = self._spool._next_position()
        data = first(mid)
        self.size += len(data)
        self._emit(data)
        self._first_size = len(data)
        self.message_id = mid
        return mid

    def rewrite(self, data: bytes) -> None:
        """Replace everything after the record ``begin`` wrote with ``data``: a filter changed the message.

        Why: what a mail filter (a milter) changed is what is stored and
        delivered, and the message keeps the id (and ``Received:`` header)
        it was given as its body began. The records written so far after the
        first become garbage with their segment; the first stays the body's
        oldest, as reclaim and the body cache need. Closes the body.

        Raises SpoolError if the body was not begun with ``begin``, or was aborted or given to its envelope.
        """
        if self.message_id is None or not self.chunks or self.discarding:
            raise SpoolError("rewrite() needs a body begun with begin() and not aborted")
        if self.closed and id(self) not in self._spool._open_bodies:
            raise SpoolError("rewrite() on a body already given to its envelope or aborted")
        self.close()
        del self.chunks[1:]
        self.size = self._first_size
        if self.kept is not None:
            del self.kept[1:]
        self.closed = False
        self.write(data)
        self.close()

    def add_header(self, data: bytes) -> None:
        """Add a header field known only once the whole message is (a DKIM-Signature), after the first record.

        Why here and so: the signature covers the client's data, so it can
        only be made after the last chunk was written, yet it must be sent
        before them. It is appended now as a DATA record of its own and listed
        second in the body, after the record ``begin`` wrote (the
        ``Received:`` header): the message reads ``Received:``, ``data``, then
        the client's bytes, which are never touched. The body's first record
        stays its oldest, which is what reclaim and the body cache rely on;
        the rest of the list is in message order, not log order
        (docs/format.md, ENVELOPE key 3). Closes the body.

        Raises SpoolError if the body was not begun with ``begin``, or was aborted.
        """
        if self.message_id is None or not self.chunks or self.discarding:
            raise SpoolError("add_header() needs a body begun with begin() and not aborted")
        if self.closed and id(self) not in self._spool._open_bodies:
            raise SpoolError("add_header() on a body already given to its envelope or aborted")
        self.close()
        self.size += len(data)
        pos = self._spool._append(RecordType.DATA, data)
        self.chunks.insert(1, pos)
        if self.kept is not None:
            if self.size > self._spool.body_cache.item_limit:
                self.kept = None
            else:
                self.kept.insert(1, data)
        self._spool._maybe_flush()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.discarding:
            self.size += len(data)
            return
        if self.closed:
            raise SpoolError("body already closed")
        self._buf += data
        self.size += len(data)
        limit = self._spool.config.body_chunk
        while len(self._buf) >= limit:
            with memoryview(self._buf) as view:
                chunk = bytes(view[:limit])  # one copy; a slice of the bytearray would make two
            del self._buf[:limit]
            self._emit(chunk)

    def _emit(self, chunk: bytes) -> None:
        if self.kept is not None:
            if self.size > self._spool.body_cache.item_limit:
                self.kept = None
            else:
                self.kept.append(chunk)
        pos = self._spool._append(RecordType.DATA, chunk)
        if not self.chunks:
            self._spool._open_bodies[id(self)] = pos
        self.chunks.append(pos)
        self._spool._maybe_flush()

    def close(self) -> tuple[int, ...]:
        if not self.closed:
            if self._buf or not self.chunks:
                self._emit(bytes(self._buf))
                self._buf.clear()
            self.closed = True
        return tuple(self.chunks)

    def abort(self) -> None:
        """Forget the body: its DATA records become garbage with their segment."""
        self.closed = True
        self._spool._open_bodies.pop(id(self), None)

    def discard(self) -> None:
        """Abort, and count (not store) whatever is still written: the sender's data goes on arriving.

        For a receiver that must refuse the message at its end (the disk
        filled up meanwhile) but has to read it to the end first.
        """
        self.abort()
        self.discarding = True
        self._buf.clear()
        self.kept = None
