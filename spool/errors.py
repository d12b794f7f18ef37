"""The spool's exceptions.

One root, ``SpoolError``; each subclass also inherits the builtin it resembles
so callers that only know Python's exceptions still catch them sensibly.
"""

from __future__ import annotations

import errno


class SpoolError(Exception):
    """Root of every error the spool raises on purpose."""


class ConfigError(ValueError):
    """A setting's value cannot be used. ``file``, ``key`` (dotted) and ``problem`` say why.

    The message reads ``FILE: KEY: PROBLEM`` so an operator can go straight to
    it. One type for every setting, the engine's (``spool.config.engine``) and the
    relay's (``mta.config``, which re-exports it). Deliberately not a
    ``SpoolError``: it means "change the settings" (``mta`` exits 2), and it is
    raised before any spool is touched, so no handler of spool trouble should
    catch it.
    """

    def __init__(self, problem: str, file: str = "", key: str = "") -> None:
        self.file = file
        self.key = key
        self.problem = problem
        super().__init__(": ".join(part for part in (file, key, problem) if part))

    def at(self, key: str) -> ConfigError:
        """The same problem, placed under ``key``: ``key`` + an index (``[2]``) or a deeper key it already names."""
        if not self.key:
            inner = key
        elif self.key.startswith("["):
            inner = key + self.key
        else:
            inner = self.key
        return ConfigError(self.problem, self.file, inner)


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


class UnknownRecordType(CorruptRecord):
    """A frame passes its checksum but has a record type this version does not know.

    Apart from CorruptRecord because the checksum proves the frame was written
    whole: it is damage of that one record (a newer writer, or a bug), never a
    torn write, and the records after it are read.
    """


class CorruptSegment(CorruptRecord):
    """A segment header is wrong, or a bad record sits before the tail of the log."""


class DamagedBody(CorruptRecord):
    """A message's data cannot be read back (a DATA record is damaged or its segment is gone).

    The damage has been quarantined and named when this is raised; the caller
    decides the message's fate (the relay bounces or holds it).
    """


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


class MessageMoved(MessageBusy):
    """The envelope found is no longer the message's live one (a runner carried it forward or an attempt
    ended in between): looking it up again finds where it is now."""


class SyncFailed(SpoolError, OSError):
    """fsync failed. The process must not retry and carry on (fsyncgate): it crashes and recovers."""


# errno values that mean "no room": the disk (ENOSPC) or the user's quota (EDQUOT) is full.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def no_space(exc: BaseException) -> bool:
    """Is ``exc`` an OSError saying that the disk or the quota is full?"""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


class DiskFull(SpoolError, OSError):
    """A write found no room (ENOSPC or EDQUOT). Unlike a failed fsync this is not fatal.

    Nothing half-written is kept: the log cuts its files back to where the
    failed write began and writes the same bytes at the same positions once
    space returns (``LogWriter``), and a checkpoint that did not fit is simply
    not there (the previous one stands). Whoever waited for durability gets
    this exception and decides what to tell its peer (``452`` to an SMTP
    client; a delivery waits for space and tries again). ``errno`` is the
    original one.
    """


class CheckpointFailed(SpoolError, OSError):
    """A checkpoint could not be written (its temporary file failed). The previous one stands.

    A checkpoint is an optimisation: a stale one only costs recovery a longer
    scan. The caller logs this and tries again later.
    """
