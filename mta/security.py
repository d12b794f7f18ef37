"""Start-up checks that the relay's files are its own.

Why: the spool holds other people's mail and the relay trusts what it reads
back from it. A spool directory that another user owns, or that group or
others may write, lets that user read mail, plant records that recovery will
replay, or swap a segment for a symlink. So the relay refuses to start on
one, with a one-line reason, rather than repair permissions behind the
operator's back (a wrong owner is a deployment mistake worth seeing).

What is checked: the spool directory itself (symlinks to it are followed, it
is the operator's choice), then every entry beneath it, which must not be a
symlink, must belong to the relay's user and must not be writable by group or
others. The relay itself creates directories 0700 and files 0600, whatever
the umask.
"""

from __future__ import annotations

import os
import stat

__all__ = ["UnsafeSpool", "check_spool_dir"]


class UnsafeSpool(PermissionError):
    """The spool's ownership or permissions would let another user read or change mail."""


def _problem(path: str, st: os.stat_result, owner: int) -> str | None:
    if st.st_uid != owner:
        return f"{path} is owned by uid {st.st_uid}, not by the relay's user (uid {owner})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_spool_dir(path: str, owner: int | None = None) -> None:
    """Refuse a spool that is not private to the user ``owner`` (default: the effective uid).

    Raises:
        UnsafeSpool: the first problem found, as one line.
        OSError: the directory cannot be read.
    """
    owner = os.geteuid() if owner is None else owner
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSpool(f"spool {path} is not a directory")
    problem = _problem(path, st, owner)
    if problem:
        raise UnsafeSpool(f"unsafe spool: {problem}; refusing to start")
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            try:
                est = os.lstat(full)
            except FileNotFoundError:
                continue  # removed since the walk listed it (another shard's process reclaimed a segment)
            if stat.S_ISLNK(est.st_mode):
                raise UnsafeSpool(f"unsafe spool: {full} is a symlink; refusing to start")
            problem = _problem(full, est, owner)
            if problem:
                raise UnsafeSpool(f"unsafe spool: {problem}; refusing to start")
