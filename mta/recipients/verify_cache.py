"""The verification answers, shared by the relay's processes and kept across restarts: one append-only file.

Theory of operation
-------------------
``[recipients] verify_cache`` is a text file of answers, one a line::

    EXPIRES <TAB> CODE <TAB> ENHANCED <TAB> ADDRESS <TAB> TEXT <LF>

``EXPIRES`` is wall-clock seconds since the epoch (every process and every
start agrees on it), ``ADDRESS`` case-folded, ``ENHANCED`` ``-`` when the
next hop gave none. A process appends its answer with one ``write`` under
``flock(LOCK_EX)``, and before each lookup reads what the others appended
since it last looked (one ``fstat`` when nothing is new). The last line for
an address wins; an expired one counts as none.

Bounded: once the file holds more than ``2 * limit`` lines, the process that
notices rewrites it, under the lock, with the newest ``limit`` answers that
have not expired (temporary file, rename); the others see the new inode at
their next lookup and read it from the start.

Not durable, on purpose: never fsynced. A crash may lose the last answers or
tear the last line; a line that does not parse is skipped (a torn line and
the one appended after it cost two probes). A cache that cannot be read or
written is no reason to refuse mail: the process goes on with what it has in
memory, and the failure is logged once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

import attrs

from mta.observe.logline import event
from mta.smtp.common import Reply

__all__ = ["Answer", "VerifyCache"]

log = logging.getLogger("mta.recipients")
READ_SIZE = 1 << 20


@attrs.frozen
class Answer:
    reply: Reply  # the next hop's reply to RCPT: 2xx or 5xx (4xx answers are not kept)
    expires: float  # time.time() seconds


def _line(key: str, answer: Answer) -> bytes:
    r = answer.reply
    text = " ".join(line.strip() for line in r.lines).replace("\t", " ")
    fields = (f"{answer.expires:.0f}", str(r.code), r.enhanced or "-", key, text)
    return ("\t".join(fields).replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "surrogateescape")


def _parse(line: bytes) -> tuple[str, Answer] | None:
    try:
        expires, code, enhanced, key, text = line.decode("utf-8", "surrogateescape").split("\t")
        return key, Answer(Reply(int(code), None if enhanced == "-" else enhanced, text), float(expires))
    except ValueError:
        return None


class VerifyCache:
    """One process's view of the shared file. Opened at the first lookup; ``limit`` answers are kept."""

    def __init__(self, path: str, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.answers: dict[str, Answer] = {}
        self._fd = -1
        self._inode = 0
        self._offset = 0
        self._partial = b""
        self._lines = 0  # lines in the file as read (compaction once over 2 * limit)
        self._broken = False  # a failure was logged: the rest is kept in memory only

    def get(self, key: str) -> Answer | None:
        self._catch_up()
        answer = self.answers.get(key)
        if answer is None or answer.expires <= time.time():
            return None
        return answer

    def put(self, key: str, answer: Answer) -> None:
        self.answers.pop(key, None)
        self.answers[key] = answer
        if not self._open():
            self._trim()
            return
        try:
            for _ in range(3):  # another process may rename a compacted file in before the lock is ours
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    current = self._current()
                    if current:
                        os.write(self._fd, _line(key, answer))
                        self._lines += 1
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                if current or not self._open():
                    break
            if self._fd >= 0 and self._lines > 2 * self.limit:
                self._compact()
        except OSError as exc:
            self._failed(exc)
        self._trim()

    def _current(self) -> bool:
        """Whether the open file is still the one at ``path`` (not replaced by a compaction)."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _trim(self) -> None:
        while len(self.answers) > self.limit:
            del self.answers[next(iter(self.answers))]

    def _open(self) -> bool:
        """The file open and current (reopened when another process compacted it); False: memory only."""
        if self._broken:
            return False
        try:
            if self._fd >= 0:
                if self._current():
                    return True
                self.close()
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._inode = os.fstat(self._fd).st_ino
            self._offset, self._partial, self._lines = 0, b"", 0
            return True
        except OSError as exc:
            self._failed(exc)
            return False

    def _catch_up(self) -> None:
        """Read the lines appended since the last look (by any process)."""
        if not self._open():
            return
        try:
            size = os.fstat(self._fd).st_size
            while self._offset < size:
                data = os.pread(self._fd, min(READ_SIZE, size - self._offset), self._offset)
                if not data:
                    break
                self._offset += len(data)
                self._take(self._partial + data)
        except OSError as exc:
            self._failed(exc)
        self._trim()

    def _take(self, data: bytes) -> None:
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self._lines += 1
            parsed = _parse(line)
            if parsed is not None:
                key, answer = parsed
                self.answers.pop(key, None)
                self.answers[key] = answer

    def _compact(self) -> None:
        """Rewrite the file with the newest ``limit`` live answers; under the lock, so no append is lost."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if not self._current():
                return  # another process compacted it first
            size = os.fstat(self._fd).st_size
            while self._offset < size:
                data = os.pread(self._fd, min(READ_SIZE, size - self._offset), self._offset)
                self._offset += len(data)
                self._take(self._partial + data)
            now = time.time()
            live = [(k, a) for k, a in self.answers.items() if a.expires > now][-self.limit:]
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(b"".join(_line(k, a) for k, a in live))
            os.chmod(tmp, 0o600)
            os.rename(tmp, self.path)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self.answers = dict(live)
        self._open()  # the new file, read again from its start at the next lookup

    def _failed(self, exc: OSError) -> None:
        if not self._broken:
            event(log, "verify_cache_failed", level=logging.WARNING, path=self.path,
                  error=exc.strerror or str(exc), action="kept in memory only")
        self._broken = True
        self.close()
