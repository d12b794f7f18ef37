"""The users file of SMTP AUTH: one ``name:argon2-hash`` per line, read by the relay, written by ``mta user``.

Format (docs/operations.md, "Submission"): UTF-8 text; blank lines and lines
starting with ``#`` are ignored; every other line is a user name, a colon and
an Argon2 hash in its PHC string form (``$argon2id$v=19$m=...``), as
argon2-cffi writes it. A name is 1 to ``MAX_USERNAME`` characters with no
colon, no white space and no control character; names are compared exactly.
A line that breaks these rules makes the whole file unreadable (the relay
does not start; a running relay keeps the last good reading and logs why), and
the problem names the line, never its hash.

Writing: ``mta user add|passwd|del`` rewrite the file whole, into a temporary
file in the same directory (mode 0600, fsynced), renamed over the old one and
the directory fsynced, under an exclusive lock on ``FILE.lock``, so a reader
sees the old file or the new, never half of one, and two commands at once do
not lose each other's change.

Reading: ``UsersFile.verify`` is called in a worker thread (an Argon2
verification takes a third of a second of CPU and 64 MiB by design); it
rereads the file when its identity (inode, size, mtime) changed, so users added
while the relay runs can log in at once. A user the file does not name is
checked against a fixed hash all the same, so that the time taken does not
tell a prober which names exist.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Final

import argon2
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from mta.smtp.common import has_control
from mta.smtp.sasl import MAX_PASSWORD, MAX_USERNAME

__all__ = ["UsersFile", "UsersFileError", "add_user", "check_name", "check_private", "delete_user", "read_users",
           "set_password"]

_HASHER: Final = argon2.PasswordHasher()  # RFC 9106's second recommended profile: Argon2id, 64 MiB, t=3, p=4


class UsersFileError(ValueError):
    """The users file cannot be read as one, or a change to it cannot be made; one line for the operator."""


def check_name(name: str) -> str:
    """``name`` if it can be a user name, else ``UsersFileError`` saying why (escaped, never raw)."""
    if not name or len(name) > MAX_USERNAME:
        raise UsersFileError(f"a user name has 1 to {MAX_USERNAME} characters")
    if ":" in name or has_control(name) or any(c.isspace() for c in name):
        raise UsersFileError("a user name has no colon, white space or control character")
    return name


def check_password(password: str) -> str:
    if not password:
        raise UsersFileError("the password is empty")
    if len(password.encode("utf-8")) > MAX_PASSWORD:
        raise UsersFileError(f"the password is longer than {MAX_PASSWORD} bytes")
    if "\x00" in password:
        raise UsersFileError("the password holds a NUL, which AUTH PLAIN cannot carry")
    return password


def parse_users(text: str, path: str) -> dict[str, str]:
    """The users of a file's text, name to hash. Raises ``UsersFileError`` naming ``path`` and the line."""
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, colon, hashed = line.partition(":")
        try:
            if not colon:
                raise UsersFileError("no colon between the user name and the hash")
            check_name(name)
            if not hashed.startswith("$argon2"):
                raise UsersFileError("the hash is not an Argon2 hash ($argon2id$...)")
            if name in users:
                raise UsersFileError("the user is named twice")
        except UsersFileError as exc:
            raise UsersFileError(f"{path}: line {number}: {exc}") from None
        users[name] = hashed
    return users


def read_users(path: str) -> dict[str, str]:
    """The users in ``path``; raises ``UsersFileError`` (bad content) or ``OSError`` (cannot read)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsersFileError(f"{path}: not UTF-8 at byte {exc.start}") from None
    return parse_users(text, path)


def check_private(path: str) -> None:
    """Refuse a users file that others may read, or group or others may write (``UsersFileError``).

    Why: the hashes are slow to attack, not impossible; a writable file lets anyone add a user.
    """
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise UsersFileError(f"{path} is open to other users (mode {mode:04o}); chmod 600 it")


@functools.cache
def _dummy_hash() -> str:
    """What an unknown user's password is checked against: made on first need, in the worker thread that needs it.

    Not at import: a hash costs a third of a second and a 64 MiB peak, which every relay process (and every
    ``mta`` command) would pay whether it serves submission or not.
    """
    return _HASHER.hash("a password no user has")


class UsersFile:
    """The relay's view of the users file, reread when it changes. Safe to call from several threads.

    Raises at construction what ``read_users`` raises: a relay does not start with a bad file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._identity = self._stat()
        self._users: Mapping[str, str] = read_users(path)
        self.last_error: str | None = None  # why the last reread failed (the old users stay)

    def _stat(self) -> tuple[int, int, int, int]:
        st = os.stat(self.path)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def users(self) -> Mapping[str, str]:
        """The current users, rereading the file if it changed; a bad new file keeps the old users.

        Raises ``OSError`` when the file cannot be examined at all (gone, unreadable).
        """
        identity = self._stat()
        with self._lock:
            if identity != self._identity:
                try:
                    self._users = read_users(self.path)
                    self.last_error = None
                except UsersFileError as exc:
                    self.last_error = str(exc)
                self._identity = identity
            return self._users

    def verify(self, username: str, password: str) -> bool:
        """Whether ``password`` is ``username``'s. Slow on purpose: call it in a worker thread.

        Raises ``OSError`` when the file cannot be read (a temporary failure, not a wrong password).
        """
        hashed = self.users().get(username)
        try:
            return _HASHER.verify(hashed or _dummy_hash(), password) and hashed is not None
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return False


# ---------------------------------------------------------------- changes (mta user)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[dict[str, str]]:
    """The users of ``path`` (none if it does not exist), under an exclusive lock; what the block leaves is written."""
    directory = os.path.dirname(os.path.abspath(path))
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            users = read_users(path)
        except FileNotFoundError:
            users = {}
        yield users
        _write(path, directory, users)
    finally:
        os.close(fd)


def _write(path: str, directory: str, users: Mapping[str, str]) -> None:
    text = "# logspool SMTP AUTH users: name:argon2 hash (written by 'mta user'; docs/operations.md)\n"
    text += "".join(f"{name}:{hashed}\n" for name, hashed in users.items())
    fd, tmp = tempfile.mkstemp(prefix=".users.", dir=directory)  # mkstemp's mode is 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def add_user(path: str, name: str, password: str) -> None:
    """Add ``name``; ``UsersFileError`` if it exists already (``set_password`` changes a password)."""
    check_name(name)
    hashed = _HASHER.hash(check_password(password))
    with _locked(path) as users:
        if name in users:
            raise UsersFileError(f"user {name!r} exists already (mta user passwd changes a password)")
        users[name] = hashed


def set_password(path: str, name: str, password: str) -> None:
    """Give ``name`` a new password; ``UsersFileError`` if there is no such user."""
    hashed = _HASHER.hash(check_password(password))
    with _locked(path) as users:
        if name not in users:
            raise UsersFileError(f"no user {name!r} in {path}")
        users[name] = hashed


def delete_user(path: str, name: str) -> None:
    """Remove ``name``; ``UsersFileError`` if there is no such user."""
    with _locked(path) as users:
        if name not in users:
            raise UsersFileError(f"no user {name!r} in {path}")
        del users[name]
