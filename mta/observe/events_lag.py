"""The event consumers' lag, read at scrape time from their cursors and the durable horizon.

One series per named consumer (``GET /events?consumer=``, ``mta events
ship``); none while there is no consumer. Read from files, so a consumer in
another process (a shipper) is measured the same way as one the relay serves.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from spool import EventStream, OsFileIO, list_cursors


class ConsumerLag:
    """A collector for one spool's consumers."""

    def __init__(self, spool_dir: str, archive_dir: str | None) -> None:
        self.spool_dir = spool_dir
        self.stream = EventStream(spool_dir, archive_dir=archive_dir)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cursors = list_cursors(OsFileIO(), self.spool_dir)
        if not cursors:
            return
        behind = GaugeMetricFamily("logspool_events_consumer_lag_bytes",
                                   "bytes of durable log a named event consumer has not taken yet",
                                   labels=["consumer"])
        lagging = GaugeMetricFamily("logspool_events_consumer_lagging",
                                    "1 when a consumer's cursor points into a segment that has left the log (past "
                                    "[spool] cursor_pin_max): it reads from the archive, or has lost events",
                                    labels=["consumer"])
        for name, cursor in sorted(cursors.items()):
            if cursor is None:
                continue  # a damaged cursor file: the consumer starts over, and so does its lag
            size, gone = self.stream.lag(cursor)
            behind.add_metric([name], size)
            lagging.add_metric([name], 1 if gone else 0)
        yield behind
        yield lagging
