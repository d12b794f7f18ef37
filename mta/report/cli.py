"""``mta report``: the click command; the relay's ``mta`` group registers it."""

from __future__ import annotations

import datetime as dt
import glob
import os
import re
import sys
import time

import click

from mta.report.errors import ReportError
from mta.report.session import JAVA_MISSING, java_available, missing_libraries
from spool.export import remote
from spool.export.rows import expand_paths, same_named_relays


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


def _time_option(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    """Click callback: the error then names the option (``Invalid value for '--since'``)."""
    return None if value is None else parse_time(value)


# local, local[N], local[*], local[N,F], local[*,F]: Spark's own parser accepts
# only these; anything else starting with "local" would fail after the JVM has
# started (minutes on a busy machine) with a Java traceback.
_LOCAL_MASTER = re.compile(r"local(\[(\d+|\*)(,\d+)?\])?")


def _master_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if value.startswith("local") and not _LOCAL_MASTER.fullmatch(value):
        raise click.BadParameter(f"{value!r} (want local, local[N], local[*] or a cluster URL)")
    return value


def _conf_option(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    conf = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("spark."):
            raise click.BadParameter(f"{item!r} (want spark.KEY=VALUE)")
        conf[key] = value
    return conf


def check_arguments(inputs: tuple[str, ...], out: str, since_ms: int | None, until_ms: int | None,
                    relay: str | None = None) -> None:
    """Everything about the arguments that can be checked without Spark, so a
    mistake costs a second rather than a JVM start.

    Every ``--input`` must name segments: a typo among several inputs would
    otherwise leave a relay out of the report without a word. Two relays
    whose spool directories have the same name are refused (unless
    ``--relay`` names them all): their queue ids would be taken for one relay's.

    Raises ReportError (one line: also when Java or a library of the ``spark``
    extra is missing) or OSError
    (``--out`` cannot be made).
    """
    if since_ms is not None and until_ms is not None and since_ms >= until_ms:
        raise ReportError("--since must be before --until")
    for pattern in inputs:
        try:
            if expand_paths([pattern]):
                continue
            there = remote.Listing().matches(pattern) if remote.is_remote(pattern) else \
                glob.glob(os.path.expanduser(remote.local_path(pattern)))
        except remote.PlaceError as exc:
            raise ReportError(f"--input {exc}") from None
        except OSError as exc:
            raise ReportError(f"--input {pattern}: cannot list: {' '.join(str(exc).split())}") from None
        if not there:
            raise ReportError(f"--input {pattern}: no such file or directory")
        raise ReportError(f"no segment files (*.seg) under: {pattern}")
    _refuse_same_names(inputs, relay)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ReportError(f"--out {out}: exists and is not a directory")
    missing = missing_libraries()
    if missing:
        raise ReportError(f"not installed: {', '.join(missing)} (pip install 'logspool[spark]')")
    if not java_available():  # make_session says so too; here it comes before --out is made
        raise ReportError(JAVA_MISSING)
    os.makedirs(out, exist_ok=True)


def _refuse_same_names(inputs: tuple[str, ...], relay: str | None) -> None:
    """One line when two relay directories among ``inputs`` give the same relay name (``--relay`` names them
    all on purpose: not asked)."""
    if relay is not None:
        return
    for name, dirs in same_named_relays(expand_paths(inputs)).items():
        raise ReportError(f"--input: {' and '.join(dirs)} are two relays both named {name!r} (the spool "
                          "directory's name): their queue ids would be merged; report them separately or give "
                          "the directories distinct names")


_STARTED = [time.monotonic()]


def _progress(message: str) -> None:
    """One line per step on stderr, with the time since the command began:
    Spark's own progress bar is off, since on a busy machine its redraws are
    most of what the terminal shows."""
    click.echo(f"report: [{time.monotonic() - _STARTED[0]:6.1f} s] {message}", err=True)


@click.command("report")
@click.option("--input", "inputs", multiple=True, required=True, metavar="PATH",
              help="Spool, log or archive directory, segment file, or a glob of them, local or at a URL "
                   "(s3://bucket/prefix, hdfs://..., file://...); repeatable.")
@click.option("--out", required=True, metavar="DIR", help="Where the Parquet tables and the report go.")
@click.option("--master", default="local[*]", show_default=True, callback=_master_option,
              help="Spark master URL.")
@click.option("--since", "since_ms", default=None, metavar="T", callback=_time_option,
              help="Only mail that arrived (and attempts made) from T on: ISO 8601 (UTC by default) or epoch seconds.")
@click.option("--until", "until_ms", default=None, metavar="T", callback=_time_option,
              help="Read the log as if it ended at T.")
@click.option("--relay", default=None, help="Relay name for every input (default: from the directory).")
@click.option("--conf", "confs", multiple=True, metavar="KEY=VALUE", callback=_conf_option,
              help="A Spark setting (spark.executor.memory=4g ...), as spark-submit's --conf; repeatable.")
def report(inputs: tuple[str, ...], out: str, master: str, since_ms: int | None, until_ms: int | None,
           relay: str | None, confs: dict[str, str]) -> None:
    """Delivery report (pflogsumm-style) from spool segments, on Spark.

    Writes OUT/messages, OUT/attempts, OUT/queue (Parquet), OUT/report.txt
    (also printed) and OUT/report.html (with charts).
    """
    _STARTED[0] = time.monotonic()
    try:
        check_arguments(inputs, out, since_ms, until_ms, relay)
        from mta.report.job import run_report
        from mta.report.session import make_session

        _progress(f"starting Spark ({master})")
        spark = make_session(master, conf=confs)
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
