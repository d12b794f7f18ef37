"""Pieces the spool tests share: a small engine config, a running AsyncSpool, real files without fsync.

The manual clock they drive is ``fault_injection.workloads.FakeClock``, the
one the crash harnesses use: record times and due times follow ``clock.now``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from spool.aio.async_spool import AsyncSpool
from spool.config.engine import SpoolConfig
from spool.fileio import FileIO, OsFileIO


def spool_config(clock: Callable[[], float] | None = None, **overrides: Any) -> SpoolConfig:
    """Two deferred classes (60 s, 600 s) and no timed checkpoints (a test asks for them), then ``overrides``.

    ``clock``: the spool's clock (record and due times); None keeps the real time.
    """
    opts: dict[str, Any] = {"retry_intervals": (60.0, 600.0), "checkpoint_interval": math.inf}
    if clock is not None:
        opts["clock"] = clock
    opts.update(overrides)
    return SpoolConfig(**opts)


def tiny_config() -> SpoolConfig:
    """Segments of 4 KiB (rotations all the time) and one deferred class of a second, in real time."""
    return spool_config(segment_size=4096, retry_intervals=(1.0,))


@asynccontextmanager
async def running_spool(path: Path | str, cfg: SpoolConfig, io: FileIO | None = None) -> AsyncIterator[AsyncSpool]:
    """An AsyncSpool with its committer running. Leaving it is a crash: nothing is flushed."""
    aspool = await AsyncSpool.open(str(path), cfg, io)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(aspool.run)
            yield aspool
            nursery.cancel_scope.cancel()
    finally:
        aspool.core.close()


class NoSync(OsFileIO):
    """Real files without fsync: durability does not change the bytes a reader sees, and an fsync
    costs tens of milliseconds on a slow disk."""

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass
