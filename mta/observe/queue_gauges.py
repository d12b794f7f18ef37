"""The relay's side of the queue gauges (``spool.engine.gauges``): seeded once at start, the oldest refreshed.

The counts are kept by the spool as it appends and claims. Only the oldest
message's age needs a walk, and only after that message has left the queue:
``refresh_oldest`` looks every ``REFRESH`` seconds whether it has, and if so
walks the live log once in a worker thread (constant memory).
"""

from __future__ import annotations

import trio

from spool import AsyncSpool, QueueGauges, oldest_live

REFRESH = 10.0  # seconds between looks at whether the oldest message has left (a walk only if it has)


async def keep_gauges(aspool: AsyncSpool) -> None:
    """Count the live log once (after recovery, before the relay serves), then keep the counts as it goes."""
    gauges = QueueGauges()
    await trio.to_thread.run_sync(gauges.seed, aspool.core)
    aspool.core.keep_gauges(gauges)


async def refresh_oldest(aspool: AsyncSpool) -> None:
    while True:
        await trio.sleep(REFRESH)
        gauges = aspool.core.gauges
        if gauges is not None and gauges.stale:
            gauges.stale = False  # a message that leaves during the walk marks it stale again
            gauges.refreshed(await trio.to_thread.run_sync(oldest_live, aspool.core))
