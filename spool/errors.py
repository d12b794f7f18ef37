"""The spool's exceptions.

One root, ``SpoolError``; each subclass also inherits the builtin it resembles
so callers that only know Python's exceptions still catch them sensibly.
"""

from __future__ import annotations


class SpoolError(Exception):
    """Root of every error the spool raises on purpose."""


class CorruptRecord(SpoolError, ValueError):
    """A frame failed its length or checksum test, or its payload is malformed.

    ``path`` and ``offset`` name where, so an operator can find the bytes.
    """

    def __init__(self, message: str, path: str = "", offset: int = -1) -> None:
        self.path = path
        self.offset = offset
        self.reason = message
        where = f"{path} at offset {offset}: " if path else (f"offset {offset}: " if offset >= 0 else "")
        super().__init__(where + message)


class CorruptSegment(CorruptRecord):
    """A segment header is wrong, or a bad record sits before the tail of the log."""


class FormatVersionError(SpoolError, ValueError):
    """A file was written by a newer (or unknown) format version: refuse, never guess."""


class SpoolLocked(SpoolError, BlockingIOError):
    """Another process holds the spool's lock: one writer per spool."""


class NotFound(SpoolError, KeyError):
    """No live message has that id."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want a sentence
        return str(self.args[0]) if self.args else "not found"


class MessageBusy(SpoolError, RuntimeError):
    """The message is being delivered right now; admin changes wait for the attempt to end."""


class SyncFailed(SpoolError, OSError):
    """fsync failed. The process must not retry and carry on (fsyncgate): it crashes and recovers."""
