"""The relay's recipient tables as the sessions use them: read at start, read again when a file changes.

Why checked on lookup and not watched: a lookup looks at the files' status
(inode, size, modification time in nanoseconds) at most once a second, so
an edit (or a new file moved into place, as a deploy does) is used within a
second of the first RCPT after it, with no watcher task and no restart;
SIGHUP (``mta reload``) reads them at once (``reread``). A table that no
longer reads (a typo in an edit) is logged once and the one read before
stays in use, so a bad edit never opens or closes the relay's doors.

At start a table that does not read stops the start in one line
(``load``, from ``mta.process.startup.check_start``).
"""

from __future__ import annotations

import logging
import os
import time

from mta.config import Config, ConfigError
from mta.observe.logline import event
from mta.recipients.table import Expanded, Refused, Table, TableError, parse, table_of

__all__ = ["CHECK_EVERY", "RecipientMaps", "load"]

log = logging.getLogger("mta.recipients")
CHECK_EVERY = 1.0  # seconds between looks at the files' status

_Stamp = tuple[tuple[int, int, int] | None, ...]


def _stamp(paths: tuple[str, ...]) -> _Stamp:
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def _read(paths: tuple[str, ...]) -> Table:
    """Raises TableError (a file that cannot be read is one too)."""
    entries: dict[str, tuple[str, ...]] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                parse(f, path, entries)
        except (OSError, UnicodeDecodeError) as exc:
            raise TableError(f"{path}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    return table_of(entries)


def load(config: Config) -> Table:
    """The tables ``config`` names, read now. Raises ConfigError naming ``recipients.tables``."""
    try:
        return _read(config.recipients.tables)
    except TableError as exc:
        raise ConfigError(str(exc), config.source, "recipients.tables") from None


class RecipientMaps:
    """The tables in use; ``resolve`` an RCPT against them. One per SMTP server, shared by its sessions."""

    def __init__(self, config: Config) -> None:
        self.paths = config.recipients.tables
        self.table = _read(self.paths) if self.paths else Table()
        self._stamp = _stamp(self.paths)
        self._checked = time.monotonic()
        self.reads = 1  # how many times the tables were read (tests)

    def resolve(self, config: Config, address: str) -> Expanded | Refused:
        """What ``address`` becomes in the envelope, or why it is refused, with the tables as they are now."""
        if config.recipients.tables != self.paths:  # a reload named other files
            self.paths = config.recipients.tables
            self.reread()
        elif self.paths and time.monotonic() - self._checked >= CHECK_EVERY:
            self._checked = time.monotonic()
            if _stamp(self.paths) != self._stamp:
                self.reread()
        r = config.recipients
        known = r.strict_local and config.is_local(address.rpartition("@")[2])
        return self.table.expand(address, depth=r.alias_depth, fanout=r.alias_fanout, known=known)

    def reread(self) -> None:
        """Read the tables again now; on failure keep the ones in use (one log line)."""
        stamp = _stamp(self.paths)
        self._checked = time.monotonic()
        try:
            table = _read(self.paths)
        except TableError as exc:
            if stamp != self._stamp:  # once per bad edit, not once a second
                event(log, "recipient_tables_failed", level=logging.ERROR, error=str(exc),
                      action="the tables read before stay in use")
            self._stamp = stamp
            return
        self.table, self._stamp = table, stamp
        self.reads += 1
        event(log, "recipient_tables", files=",".join(self.paths), addresses=len(table.entries),
              domains=len(table.domains))
