"""Local delivery into Maildirs, crash-safe in the order the Maildir spec requires.

Theory of operation
-------------------
A ``maildir:PATH`` route delivers each recipient to its own Maildir,
``PATH/<localpart>/`` (lower-cased local part, no extension handling:
``Bob+x@host`` goes to ``PATH/bob+x/``). The Maildir and its ``cur/ new/
tmp/`` are created (mode 0700) on first delivery.

A delivery is durable when ``deliver`` returns, and only then may the relay
write its delivery record:

1. write ``tmp/<unique>`` (created with O_EXCL, mode 0600), streaming the
   chunks, with ``Return-Path:`` and ``Delivered-To:`` lines in front;
2. fsync the file;
3. rename it to ``new/<unique>,S=<size>`` (the size lets IMAP servers skip a stat);
4. fsync ``new/``, so the rename itself survives a power cut.

A crash before step 4 leaves at most a file in ``tmp/`` (mail readers sweep
stale ones) or an un-fsynced rename: the spool has no delivery record, so the
message is delivered again, never lost.

The message is only as durable as the names that lead to it: ``new`` in the
Maildir, the Maildir in ``PATH``, ``PATH`` in its parent. A directory entry
survives a power cut only once its parent directory is fsynced, and a
directory that already exists may have been made by another thread or an
earlier life of the relay that never got that far. So before its first
delivery into a Maildir, a ``MaildirWriter`` makes what is missing (each new
directory fsynced into its parent, up to the first that existed) and fsyncs
the Maildir, ``PATH`` and ``PATH``'s parent whether it made them or not; it
remembers the Maildir and pays this once per process.

Every file operation goes through a ``spool.fileio.FileIO``, the interface
the spool's own files use, so the power-cut harness records local delivery
with the rest (``fault_injection.recording.RecordingFileIO``).

The unique name follows the Maildir convention, ``<sec>.M<usec>P<pid>Q<seq>.<host>``,
with ``/`` and ``:`` in the host name escaped as the spec asks.

Synchronous on purpose: the relay calls it through ``trio.to_thread``.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator

import attrs

from spool import FileIO, OsFileIO, write_all

__all__ = ["InvalidMailbox", "MaildirDelivery", "MaildirError", "MaildirWriter", "mailbox_name"]

_MAX_MAILBOX_BYTES = 200
_sequence = itertools.count(1)


class MaildirError(Exception):
    """Root of the errors this module raises on purpose. Disk errors stay ``OSError`` (temporary: retry)."""


class InvalidMailbox(MaildirError, ValueError):
    """The recipient's local part cannot name a Maildir safely: a permanent failure (550 5.1.1)."""

    code = 550
    status = "5.1.1"


@attrs.frozen
class MaildirDelivery:
    """Where a message landed and how many bytes were written (headers we added included)."""

    path: str
    size: int


def mailbox_name(recipient: str) -> str:
    """The directory name for a recipient: its local part, lower-cased, refused if it could escape ``PATH``.

    Raises:
        InvalidMailbox: empty, ``.``/``..``, a leading dot, ``/``, ``\\``, NUL or
            another control character, or too long for a file name.
    """
    local, at, _domain = recipient.rpartition("@")
    if not at:
        local = recipient
    if len(local) >= 2 and local[0] == local[-1] == '"':
        local = local[1:-1]  # a quoted local part names the same mailbox as its contents
    name = unicodedata.normalize("NFC", local).lower()
    if not name:
        raise InvalidMailbox(f"empty local part in {recipient!r}")
    if name.startswith("."):
        raise InvalidMailbox(f"local part of {recipient!r} starts with a dot")
    bad = [c for c in name if c in "/\\" or unicodedata.category(c) == "Cc"]
    if bad:
        raise InvalidMailbox(f"local part of {recipient!r} contains {bad[0]!r}")
    try:
        encoded = os.fsencode(name)
    except UnicodeEncodeError:
        raise InvalidMailbox(f"local part of {recipient!r} cannot be a file name") from None
    if len(encoded) > _MAX_MAILBOX_BYTES:
        raise InvalidMailbox(f"local part of {recipient!r} is too long for a mailbox name")
    return name


class MaildirWriter:
    """Delivers into Maildirs through ``io``; remembers which Maildirs it has made durable.

    One per relay process (the maildir transport holds it); its methods may be
    called from several threads at once.
    """

    def __init__(self, io: FileIO | None = None) -> None:
        self.io: FileIO = io or OsFileIO()
        self._durable: set[str] = set()  # Maildirs whose names, up to PATH's parent, this process has fsynced

    def deliver(self, root: str, recipient: str, return_path: str, chunks: Iterable[bytes], *,
                hostname: str | None = None, before_rename: Callable[[], None] | None = None) -> MaildirDelivery:
        """Deliver one message to ``root/<localpart>/new/`` and return only once it is durable.

        ``chunks`` is the message as stored (header, blank line, body), consumed
        once, never joined. The added header lines use the message's own line
        ending (CRLF unless its first line ends in a bare LF). ``return_path`` is
        the envelope sender; ``""`` (a bounce) is written as ``<>``.
        ``before_rename``: called once the file is durable in ``tmp/`` and
        before the rename that delivers it (the point of no return).

        Raises:
            InvalidMailbox: the local part is unsafe (permanent failure).
            OSError: the disk failed (temporary failure); no file is left in ``new/``.

        Resource handling: the tmp file is closed, and removed on any failure.
        """
        io = self.io
        maildir = os.path.join(os.path.abspath(root), mailbox_name(recipient))
        self._ensure_maildir(maildir)
        host = hostname if hostname is not None else socket.gethostname()
        unique = _unique_name(host)
        tmp_path = os.path.join(maildir, "tmp", unique)
        fd = io.create_new(tmp_path)
        try:
            try:
                size = _write_message(io, fd, recipient, return_path, chunks)
                io.fsync(fd)
            finally:
                io.close(fd)
            new_path = os.path.join(maildir, "new", f"{unique},S={size}")
            if before_rename is not None:
                before_rename()
            io.rename(tmp_path, new_path)
        except BaseException:
            try:
                io.unlink(tmp_path)
            except OSError:
                pass
            raise
        io.fsync_dir(os.path.join(maildir, "new"))
        return MaildirDelivery(new_path, size)

    def _ensure_maildir(self, maildir: str) -> None:
        """Make ``maildir`` and its ``cur new tmp`` (0700) if missing, and make the names durable (once)."""
        if maildir in self._durable:
            return
        root = os.path.dirname(maildir)
        for path in (root, maildir, *(os.path.join(maildir, sub) for sub in ("cur", "new", "tmp"))):
            self._make_dir(path)
        # Made here or found (by another thread, or an earlier life that crashed before its fsync): durable now.
        for path in (maildir, root, os.path.dirname(root)):
            self.io.fsync_dir(path)
        self._durable.add(maildir)

    def _make_dir(self, path: str) -> None:
        """Make ``path`` if missing, its missing parents first, each fsynced into its parent."""
        if self.io.exists(path):
            return
        self._make_dir(os.path.dirname(path))
        self.io.makedirs(path)  # one level: the parent exists; another thread may have just made it too
        self.io.fsync_dir(os.path.dirname(path))


def _unique_name(host: str) -> str:
    now = time.time()
    safe_host = host.replace("/", "\\057").replace(":", "\\072") or "localhost"
    return f"{int(now)}.M{int(now % 1 * 1_000_000)}P{os.getpid()}Q{next(_sequence)}.{safe_host}"


def _write_message(io: FileIO, fd: int, recipient: str, return_path: str, chunks: Iterable[bytes]) -> int:
    stream = iter(chunks)
    head, newline = _sniff_newline(stream)
    prefix = b"Return-Path: <%s>%sDelivered-To: %s%s" % (
        _header_safe(return_path),
        newline,
        _header_safe(recipient),
        newline,
    )
    size = 0
    for chunk in itertools.chain((prefix, head), stream):
        write_all(io, fd, chunk, size)
        size += len(chunk)
    return size


def _sniff_newline(stream: Iterator[bytes], limit: int = 64 * 1024) -> tuple[bytes, bytes]:
    """Read chunks until the first line ending is seen (or ``limit`` bytes); return them and the ending."""
    head = bytearray()
    for chunk in stream:
        head += chunk
        end = head.find(b"\n")
        if end >= 0:
            return bytes(head), b"\r\n" if end > 0 and head[end - 1] == 0x0D else b"\n"
        if len(head) >= limit:
            break
    return bytes(head), b"\r\n"


def _header_safe(text: str) -> bytes:
    """An address as header bytes: no line breaks, so a crafted address cannot add headers."""
    flat = "".join(" " if c in "\r\n\0" else c for c in text)
    try:
        return flat.encode("utf-8", "surrogateescape")  # undecodable bytes from the wire go back as they came
    except UnicodeEncodeError:
        return flat.encode("utf-8", "replace")
