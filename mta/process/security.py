"""Start-up checks that the relay's files are its own and private.

Why: the spool holds other people's mail and the relay trusts what it reads
back from it; the TLS key proves the relay's identity; the control socket
takes orders. Each check ends in one of two ways, chosen by what the problem
costs (docs/security.md, "Files and permissions"):

- **Refuse** (one line, no start) what could already have let another user
  *change* things: a spool entry that another user owns, that group or
  others may write, or that is a symlink (records could have been planted,
  a segment swapped); a TLS key that others may read or anyone but its owner
  may write (it is not the relay's file to fix, and it may be leaked
  already: the operator must replace or re-protect it); a control socket
  directory that others may write (they could put their own socket there).
- **Repair and log** what only let others *read* the spool: group or other
  permission bits on entries the relay owns are cleared (directories 0700,
  files 0600), with one warning line that says how many and names the first.
  Refusing would stop the mail for a mode bit the relay can set right by
  itself, with nothing lost (Postfix's ``postfix set-permissions`` does the
  same repair, by hand); what was read before cannot be unread either way.

The relay itself creates directories 0700 and files 0600, whatever the umask.
"""

from __future__ import annotations

import logging
import os
import stat

__all__ = ["UnsafeFile", "UnsafeSpool", "check_control_dir", "check_spool_dir", "check_tls_key"]

log = logging.getLogger("mta.security")
PRIVATE = stat.S_IRWXG | stat.S_IRWXO  # the bits that must be clear on the relay's own files
ROOT = 0


class UnsafeFile(PermissionError):
    """A file's ownership or permissions would let another user read or change what the relay trusts."""


class UnsafeSpool(UnsafeFile):
    """The spool's ownership or permissions would let another user change mail."""


def _problem(path: str, st: os.stat_result, owner: int) -> str | None:
    if st.st_uid != owner:
        return f"{path} is owned by uid {st.st_uid}, not by the relay's user (uid {owner})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_spool_dir(path: str, owner: int | None = None, *, repair: bool = True) -> list[str]:
    """Refuse a spool another user could change; make private what others could only read.

    Every entry is checked before any is repaired, so a refused spool is left
    as it was found. Returns the paths whose modes were tightened (with
    ``repair=False``, as ``mta config check`` asks: that would be, and nothing
    is changed).

    Raises:
        UnsafeSpool: the first problem found, as one line.
        OSError: the directory cannot be read, or a mode cannot be set.
    """
    owner = os.geteuid() if owner is None else owner
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSpool(f"spool {path} is not a directory")
    problem = _problem(path, st, owner)
    if problem:
        raise UnsafeSpool(f"unsafe spool: {problem}; refusing to start")
    readable: list[tuple[str, int]] = [(path, st.st_mode)] if st.st_mode & PRIVATE else []
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
            if est.st_mode & PRIVATE:
                readable.append((full, est.st_mode))
    return _make_private(path, readable) if repair else [full for full, _ in readable]


def _make_private(spool: str, entries: list[tuple[str, int]]) -> list[str]:
    """Clear group and other bits. Safe without O_NOFOLLOW: nobody else may write any directory here."""
    done: list[str] = []
    for full, mode in entries:
        try:
            os.chmod(full, stat.S_IMODE(mode) & ~PRIVATE)
        except FileNotFoundError:
            continue
        done.append(full)
    if done:
        first, mode = entries[0]
        log.warning("spool %s: group or others could read %d entr%s (the first: %s, mode %04o); made them private "
                    "(directories 0700, files 0600)", spool, len(done), "y" if len(done) == 1 else "ies", first,
                    stat.S_IMODE(mode))
    return done


def check_tls_key(path: str, owner: int | None = None) -> None:
    """Refuse a private key that others may read, or that anyone but its owner may change.

    A key owned by another user (root) may be readable by its group: that is
    how a distribution grants a service its key (Debian's ``ssl-cert`` group,
    mode 0640). A key the relay's own user owns needs no group and must be
    0600 or 0400, as OpenSSH asks of its keys.

    Raises:
        UnsafeFile: one line that names the file, its mode and the fix.
        OSError: the file cannot be examined.
    """
    owner = os.geteuid() if owner is None else owner
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IRWXO:
        who = "other users"
    elif mode & stat.S_IWGRP:
        who = "its group (it can change it)"
    elif mode & stat.S_IRGRP and st.st_uid == owner:
        who = "its group"
    else:
        return
    fix = "chmod 600" if st.st_uid == owner else "chmod o-rwx,g-w"
    raise UnsafeFile(f"{path} is open to {who} (mode {mode:04o}); {fix} it and consider the key exposed")


def check_control_dir(directory: str, owner: int | None = None) -> None:
    """Refuse a control socket directory that another user could write (and so replace the socket).

    A sticky directory (``/tmp``) is accepted: others cannot remove or
    rename what the relay puts there.

    Raises:
        UnsafeFile: one line naming the directory and its mode.
        OSError: the directory cannot be examined.
    """
    owner = os.geteuid() if owner is None else owner
    st = os.stat(directory)
    if st.st_uid not in (owner, ROOT):
        raise UnsafeFile(f"{directory} is owned by uid {st.st_uid}, not by the relay's user (uid {owner}) or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeFile(f"{directory} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
