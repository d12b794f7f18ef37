"""``mta report``: the click command; the relay's ``mta`` group registers it."""

from __future__ import annotations

import datetime as dt
import sys
import time

import click

from mta.report import ReportError


def parse_time(text: str) -> int:
    """Milliseconds since the epoch from ISO 8601 (UTC unless it says otherwise) or epoch seconds."""
    try:
        return int(float(text) * 1000)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"not a time: {text!r} (want 2024-05-01T12:00 or epoch seconds)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return int(t.timestamp() * 1000)


_STARTED = [time.monotonic()]


def _progress(message: str) -> None:
    """One line per step on stderr, with the time since the command began:
    Spark's own progress bar is off, since on a busy machine its redraws are
    most of what the terminal shows."""
    click.echo(f"report: [{time.monotonic() - _STARTED[0]:6.1f} s] {message}", err=True)


@click.command("report")
@click.option("--input", "inputs", multiple=True, required=True, metavar="PATH",
              help="Spool, log or archive directory, segment file, or a glob of them; repeatable.")
@click.option("--out", required=True, metavar="DIR", help="Where the Parquet tables and the report go.")
@click.option("--master", default="local[*]", show_default=True, help="Spark master URL.")
@click.option("--since", default=None, metavar="T", help="Only mail that arrived (and attempts made) from T on.")
@click.option("--until", default=None, metavar="T", help="Read the log as if it ended at T.")
@click.option("--relay", default=None, help="Relay name for every input (default: from the directory).")
def report(inputs: tuple[str, ...], out: str, master: str, since: str | None, until: str | None,
           relay: str | None) -> None:
    """Delivery report (pflogsumm-style) from spool segments, on Spark."""
    _STARTED[0] = time.monotonic()
    since_ms = parse_time(since) if since else None
    until_ms = parse_time(until) if until else None
    try:
        from mta.report import make_session, run_report
        from spool.spark_source import expand_paths

        if not expand_paths(inputs):
            raise ReportError(f"no segment files (*.seg) under: {', '.join(inputs)}")
        _progress(f"starting Spark ({master})")
        spark = make_session(master)
        figures = run_report(spark, inputs, out, since_ms=since_ms, until_ms=until_ms, relay=relay,
                             progress=_progress)
    except ReportError as exc:
        click.echo(f"mta report: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:  # e.g. --out not writable
        click.echo(f"mta report: {exc.filename or out}: {exc.strerror or exc}", err=True)
        sys.exit(2)
    for file, offset, what in figures.errors:
        click.echo(f"mta report: warning: {file} at offset {offset}: {what}", err=True)
    with open(f"{out}/report.txt", encoding="utf-8") as f:
        click.echo(f.read(), nl=False)
