"""A real small filesystem for the disk-space tests: a tmpfs mounted for the test, and a filler file.

Mounting needs root, which the project's test environment (and CI) has.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

FS_SIZE = 8 << 20
NEEDS_ROOT = "this test needs a real small filesystem: mount -t tmpfs was refused (run as root, as CI does)"


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def small_filesystem(path: Path, size: int = FS_SIZE) -> Iterator[bool]:
    """A tmpfs of ``size`` bytes at ``path``; yields whether the mount happened."""
    path.mkdir(mode=0o700)
    try:
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
        mounted, why = run.returncode == 0, run.stderr.strip()
    except OSError as exc:
        mounted, why = False, str(exc)
    if not mounted:
        print(f"tmpfs mount refused ({why})")
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(path: Path, leave: int = 0) -> int:
    """Another process's file that takes every free byte but ``leave`` (to the last block if 0); its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    written = 0
    try:
        for chunk in (1 << 20, 64 << 10, 4 << 10, 512, 1):
            block = b"\0" * chunk
            while free_bytes(str(path.parent)) - leave >= chunk:
                try:
                    n = os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += n
                if n < chunk:
                    break
        if not leave:
            while True:  # the last partial block, if any
                try:
                    written += os.write(fd, b"\0" * 512)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return written


