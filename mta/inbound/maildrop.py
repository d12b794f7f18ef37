"""The drop directory: messages ``sendmail`` could not hand to a running relay, each one file until taken in.

Layout (as a Maildir's, for the same reason): ``tmp/`` for files being
written, ``new/`` for whole ones. A file is written into ``tmp/``, fsynced,
renamed into ``new/`` and the directory fsynced: only then does ``sendmail``
exit 0, and a crash at any point leaves either nothing in ``new/`` or the
whole file. The relay reads only ``new/``.

A file is one JSON line, the envelope (``{"v": 1, "sender": ..., "recipients":
[...], "user": ...}``), then the message as it is to be stored (CRLF line
ends, no dot-stuffing). ``DropFileError`` names a file that is not one.
"""

from __future__ import annotations

import json
import os
import secrets
import time

import attrs

VERSION = 1
MAX_ENVELOPE = 1 << 20  # the JSON line: a million bytes of recipients is no local submission


class DropFileError(ValueError):
    """A file in ``new/`` is no drop file (why, in words)."""


@attrs.frozen
class Dropped:
    sender: str
    recipients: tuple[str, ...]
    user: str
    message: bytes


def encode(dropped: Dropped) -> bytes:
    head = {"v": VERSION, "sender": dropped.sender, "recipients": list(dropped.recipients), "user": dropped.user}
    return json.dumps(head, sort_keys=True).encode() + b"\n" + dropped.message


def decode(data: bytes) -> Dropped:
    """Raises: DropFileError."""
    line, nl, message = data.partition(b"\n")
    if not nl or len(line) > MAX_ENVELOPE:
        raise DropFileError("no envelope line")
    try:
        head = json.loads(line)
    except ValueError as exc:
        raise DropFileError(f"the envelope line is not JSON: {exc}") from None
    if not isinstance(head, dict) or head.get("v") != VERSION:
        raise DropFileError(f"not a version {VERSION} drop file")
    sender, recipients, user = head.get("sender"), head.get("recipients"), head.get("user", "")
    if not isinstance(sender, str) or not isinstance(user, str) or not isinstance(recipients, list) \
            or not recipients or not all(isinstance(r, str) and r for r in recipients):
        raise DropFileError("the envelope needs a sender and at least one recipient")
    return Dropped(sender, tuple(recipients), user, message)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(drop_dir: str, dropped: Dropped) -> str:
    """The file written durably into ``new/``: its path.

    Raises: OSError (the directory cannot be made or written, the disk is full, the fsync failed).
    """
    tmp, new = os.path.join(drop_dir, "tmp"), os.path.join(drop_dir, "new")
    for d in (drop_dir, tmp, new):
        os.makedirs(d, mode=0o700, exist_ok=True)
    name = f"{time.time_ns()}.{os.getpid()}.{secrets.token_hex(4)}"
    path = os.path.join(tmp, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode(dropped))
            f.flush()
            os.fsync(f.fileno())
        final = os.path.join(new, name)
        os.rename(path, final)
        _fsync_dir(new)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return final
