"""Harnesses that prove the spool loses nothing: power loss, kill -9, disk faults, corruption."""

import os
import tempfile


def scratch_dir() -> str | None:
    """Where harnesses make their temporary spools: tmpfs when there is one.

    Why: a crash-state run recovers thousands of spools, each with a dozen
    fsyncs; on a busy disk one fsync costs 100 ms, on tmpfs microseconds. The
    calls are the same real syscalls either way. ``LOGSPOOL_FAULT_TMP``
    overrides it.
    """
    env = os.environ.get("LOGSPOOL_FAULT_TMP")
    if env:
        return env
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()
