"""spoolctl: look inside a spool, read-only, while the relay runs (and ``recover`` or ``salvage`` it offline).

Every command prints a table for people and, with ``--json``, JSON for programs
(``dump --json`` prints one JSON object per record, a line each). The analyses
live in ``spool.tools.inspection`` and ``spool.tools.verify``; this module only parses arguments and prints.

Exit status: 0 success (``verify``: clean; ``salvage``: every message saved);
1 the spool has problems (``verify`` found some, ``dump`` or ``segments`` met
damage, a corrupt record stopped a command, ``salvage`` lost something and
listed it); 2 bad arguments (``salvage``: a target that is not a new or empty
directory); 3 the spool could not be read (missing, not a spool, locked, I/O
error). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import click
from rich.console import Console
from rich.table import Table

from spool.config.engine import SpoolConfig
from spool.config.units import format_age, parse_size
from spool.errors import CorruptRecord, SpoolError
from spool.format.marks import marks_dir
from spool.format.record import RecordType, format_pos, parse_pos
from spool.read.anomaly import Anomaly
from spool.read.marks import describe_marks
from spool.tools import inspection
from spool.tools import salvage as salvager
from spool.tools import verify as verifier

F = TypeVar("F", bound=Callable[..., Any])
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_ERROR = 3


class _Group(click.Group):
    """Turns every error into one line on stderr and an exit status (see the module docstring)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        code = _run(lambda: super(_Group, self).main(args, prog_name or "spoolctl", complete_var,
                                                      standalone_mode=False, **extra))
        if standalone_mode:
            sys.exit(code)
        return code


def _run(call: Callable[[], Any]) -> int:
    try:
        rv = call()
        return rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        _say("aborted")
        return 130
    except click.UsageError as exc:
        _say(exc.format_message())
        return EXIT_USAGE
    except inspection.BadArgument as exc:
        _say(str(exc))
        return EXIT_USAGE
    except click.ClickException as exc:
        _say(exc.format_message())
        return exc.exit_code
    except BrokenPipeError:
        return 0  # `spoolctl dump DIR | head`
    except CorruptRecord as exc:
        _say(f"{exc}")
        return EXIT_PROBLEMS
    except (SpoolError, OSError, ValueError) as exc:
        _say(str(exc) or type(exc).__name__)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def _say(message: str) -> None:
    line = " ".join(message.split())
    click.echo(f"spoolctl: error: {line}", err=True)


def _console() -> Console:
    out = sys.stdout
    width = None if out.isatty() else 200
    return Console(file=out, width=width, markup=False, highlight=False, emoji=False, soft_wrap=False)


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return value.hex()
    if attrs.has(type(value)):
        return attrs.asdict(value)
    return str(value)


def _json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


_DIR = click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=str))


def _open(directory: str) -> inspection.LogFiles:
    return inspection.LogFiles.open(directory)


def _pos(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_pos(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _intervals(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[float, ...]:
    if value is None:
        return SpoolConfig().retry_intervals
    try:
        return inspection.parse_intervals(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _types(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        return tuple(inspection.parse_type(part) for v in value for part in v.split(","))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_INTERVALS = click.option("--retry-intervals", callback=_intervals, metavar="LIST",
                          help="Deferred classes' retry intervals, e.g. 1m,5m,15m,30m,1h "
                               "(default: SpoolConfig's).")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Inspect a logspool spool directory (read-only; safe while the relay runs), or recover or salvage it
    (offline)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point: returns the exit status."""
    code: int = cli.main(argv, "spoolctl", standalone_mode=False)
    return code


# -- segments -------------------------------------------------------------------------


@cli.command()
@_DIR
@_json_option
def segments(directory: str, as_json: bool) -> int:
    """Each segment: size, records by type, live and garbage counts, first/last position, deletable."""
    files = _open(directory)
    cp, rows = inspection.segment_table(files)
    damaged = any(r.damage and not all(d.torn for d in r.damage) for r in rows)
    if as_json:
        _print_json({"garbage_end": None if cp is None else format_pos(cp.garbage_end),
                     "segments": [r.as_dict() for r in rows]})
        return EXIT_PROBLEMS if damaged else 0
    table = Table()
    for col in ("id", "size", "records", *(t.name for t in RecordType), "live", "garbage", "first", "last",
                "deletable", "damage"):
        table.add_column(col, justify="right" if col not in ("first", "last", "damage") else "left")
    for r in rows:
        table.add_row(str(r.segment), str(r.size), str(r.records),
                      *(str(r.by_type.get(t.name, 0)) for t in RecordType), str(r.live), str(r.garbage),
                      format_pos(r.first) if r.first is not None else "-",
                      format_pos(r.last) if r.last is not None else "-",
                      "yes" if r.deletable else "no",
                      "; ".join(("torn tail at " if d.torn else "damaged at ") + str(d.offset) for d in r.damage))
    console = _console()
    garbage = "" if cp is None else f"; garbage ends at {format_pos(cp.garbage_end)}"
    console.print(f"segments of {directory}{garbage}")
    console.print(table)
    if damaged:
        _say("damaged records found; run `spoolctl verify` for details")
    return EXIT_PROBLEMS if damaged else 0


# -- marks ---------------------------------------------------------------------------


@cli.command()
@_DIR
@_json_option
def marks(directory: str, as_json: bool) -> int:
    """The delivery workers' marks files: marks, the START positions they name, whether a worker writes it now."""
    _open(directory)  # not a spool: one line, as every command says it
    rows = describe_marks(marks_dir(directory))
    damaged = any(r.damage is not None for r in rows)
    if as_json:
        _print_json({"marks": [attrs.asdict(r) | {"first": None if r.first is None else format_pos(r.first),
                                                 "last": None if r.last is None else format_pos(r.last)}
                               for r in rows]})
        return EXIT_PROBLEMS if damaged else 0
    console = _console()
    if not rows:
        console.print(f"{directory}: no marks files (no delivery worker has marked a point of no return since "
                      "the last collection)")
        return 0
    table = Table()
    for col in ("file", "size", "marks", "first", "last", "writer", "damage"):
        table.add_column(col, justify="right" if col in ("size", "marks") else "left")
    for r in rows:
        table.add_row(r.name, str(r.size), str(r.marks), "-" if r.first is None else format_pos(r.first),
                      "-" if r.last is None else format_pos(r.last), "writing" if r.writing else "closed",
                      r.damage or "")
    console.print(f"marks files of {directory}")
    console.print(table)
    if damaged:
        _say("a damaged marks file: the next start quarantines it and holds every attempt in flight in doubt")
    return EXIT_PROBLEMS if damaged else 0


# -- checkpoint ----------------------------------------------------------------------


@cli.command()
@_DIR
@_INTERVALS
@_json_option
def checkpoint(directory: str, retry_intervals: tuple[float, ...], as_json: bool) -> int:
    """The restart positions and how far each lags the end of the log (records, bytes, seconds)."""
    files = _open(directory)
    report = inspection.checkpoint_report(files, retry_intervals)
    if as_json:
        _print_json(report.as_dict())
        return 0
    console = _console()
    cp = report.checkpoint
    if cp is None:
        console.print(f"{directory}: no checkpoint; the next open scans the log from its first segment. "
                      f"Log ends at {format_pos(report.log_end)}.")
        return 0
    console.print(f"checkpoint {cp.sequence} written {_time(cp.time_ms / 1000)}; "
                  f"log ends at {format_pos(report.log_end)}"
                  + (f", last record {_time(report.last_time)}" if report.last_time is not None else ""))
    table = Table()
    for col in ("position", "at", "interval", "lag records", "lag bytes", "lag seconds"):
        table.add_column(col, justify="left" if col in ("position", "at") else "right")
    for lag in report.lags:
        interval = "-" if lag.interval is None else (
            "new mail" if lag.name == "runner 0" else format_age(lag.interval))
        if lag.name.startswith("runner") and lag.interval is None:
            interval = "unknown"
        table.add_row(lag.name, format_pos(lag.pos) + (" (reclaimed)" if lag.reclaimed else ""), interval,
                      str(lag.records), str(lag.bytes), str(lag.seconds))
    console.print(table)
    return 0


def _time(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


# -- dump -----------------------------------------------------------------------------


@cli.command()
@_DIR
@click.option("--segment", "segment", type=click.IntRange(min=0), metavar="ID", help="Only this segment.")
@click.option("--from", "start", callback=_pos, metavar="POS", help="Start at this position (SEGMENT:OFFSET).")
@click.option("--type", "types", multiple=True, callback=_types, metavar="T",
              help="Only records of this type (ENVELOPE, START, DELIVERY, FINISH, DATA); repeatable.")
@click.option("--limit", type=click.IntRange(min=0), metavar="N", help="At most N records.")
@_json_option
def dump(directory: str, segment: int | None, start: int | None, types: tuple[int, ...] | None,
         limit: int | None, as_json: bool) -> int:
    """Decoded records, one per line (--json: one JSON object per line)."""
    files = _open(directory)
    damaged = False
    for item in inspection.dump(files, segment=segment, start=start, types=types, limit=limit):
        if isinstance(item, Anomaly):
            if as_json:
                _print_json({"damage": item.as_dict()})
            else:
                click.echo(f"{format_pos(item.pos):>14} !! {item.describe()}")
            damaged = damaged or not item.torn
            continue
        fields = inspection.frame_fields(item, files)
        damaged = damaged or "error" in fields
        if as_json:
            _print_json(fields)
        else:
            click.echo(inspection.frame_line(fields))
    return EXIT_PROBLEMS if damaged else 0


# -- verify ---------------------------------------------------------------------------


@cli.command()
@_DIR
@_json_option
def verify(directory: str, as_json: bool) -> int:
    """Every checksum and cross-reference, and what the relay will do with the damage at its next start;
    exit 0 only when clean, 1 when there are problems."""
    files = _open(directory)
    report = verifier.verify(files)
    bad_marks = [r for r in describe_marks(marks_dir(directory)) if r.damage is not None]
    code = 0 if report.clean and not bad_marks else EXIT_PROBLEMS
    if as_json:
        _print_json(report.as_dict() | {"marks_damage": [{"file": r.name, "damage": r.damage} for r in bad_marks]})
        return code
    for p in report.problems:
        click.echo(p.describe())
    for r in bad_marks:
        click.echo(f"marks file {r.name}: {r.damage} (the next start quarantines it and holds every attempt in "
                   "flight in doubt)")
    if report.problems_total > len(report.problems):
        click.echo(f"... and {report.problems_total - len(report.problems)} more problems")
    if report.torn_tail is not None:
        click.echo(f"torn tail  {report.torn_tail.describe()}")
    click.echo(f"checked {report.segments} segments, {report.records} records, {report.references} references "
               f"({report.reclaimed_references} into segments already reclaimed: fine); log ends at "
               f"{format_pos(report.log_end)}")
    if report.plan:
        click.echo("what the relay will do (on_damage = \"quarantine\", the default):")
        for action in report.plan:
            click.echo("  " + action.describe().replace("\n", "\n  "))
    if report.clean and not bad_marks:
        click.echo("clean")
    elif report.clean:
        click.echo(f"{len(bad_marks)} damaged marks files")
    else:
        click.echo(f"{report.problems_total} problems. The relay quarantines damage in {directory}/quarantine and "
                   f"starts; to copy every readable message into a fresh spool instead: spoolctl salvage "
                   f"{directory} --into NEWDIR (docs/operations.md, \"When the disk lies\").")
    return code


# -- stats ----------------------------------------------------------------------------


@cli.command()
@_DIR
@_json_option
def stats(directory: str, as_json: bool) -> int:
    """Live messages per runner class, held, in flight, oldest age, bytes on disk."""
    files = _open(directory)
    st = inspection.stats(files)
    if as_json:
        _print_json(st.as_dict())
        return 0
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("live messages", str(st.live))
    for k, n in sorted(st.by_class.items()):
        table.add_row(f"  queued, class {k}" + (" (new)" if k == 0 else ""), str(n))
    table.add_row("  held", str(st.held))
    table.add_row("  in flight", str(st.active))
    table.add_row("oldest message age",
                  "-" if st.oldest_age_s is None else format_age(round(st.oldest_age_s)))
    table.add_row("segments", str(st.segments))
    table.add_row("bytes on disk", str(st.bytes_on_disk))
    console = _console()
    console.print(f"stats of {directory}")
    console.print(table)
    return 0


# -- recover ---------------------------------------------------------------------------


@cli.command()
@_DIR
@_INTERVALS
@click.option("--in-doubt", "in_doubt", type=click.Choice(["hold", "redeliver"]), default="hold", show_default=True,
              help="a message with recipients in doubt: held for the operator, or due again (as the relay's "
                   "[spool] in_doubt)")
@_json_option
def recover(directory: str, retry_intervals: tuple[float, ...], in_doubt: str, as_json: bool) -> int:
    """Open the spool for writing (takes its lock; the relay must be stopped) and run recovery:
    cuts a torn tail, closes attempts that were in flight (holding those in doubt, by default), writes a
    checkpoint."""
    files = _open(directory)
    # Recovery's warnings (torn tail cut, recipients in doubt) are for the operator: show them.
    handler = _EchoHandler()
    engine_log = logging.getLogger("spool")
    engine_log.addHandler(handler)
    level = engine_log.level
    engine_log.setLevel(logging.WARNING)  # whatever the embedding process chose, recover shows these
    try:
        rs = inspection.recover(files, SpoolConfig(retry_intervals=retry_intervals, in_doubt=in_doubt))
    finally:
        engine_log.setLevel(level)
        engine_log.removeHandler(handler)
    fields = attrs.asdict(rs)
    if as_json:
        _print_json(fields)
        return 0
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, value in fields.items():
        table.add_row(name.replace("_", " "), f"{value:.3f}" if isinstance(value, float) else str(value))
    console = _console()
    console.print(f"recovered {directory}")
    console.print(table)
    return 0


class _EchoHandler(logging.Handler):
    """Engine warnings to stderr, one line each, prefixed like our errors."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"spoolctl: {record.levelname.lower()}: {record.getMessage()}", err=True)



# -- salvage ---------------------------------------------------------------------------


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command()
@_DIR
@click.option("--into", "into", required=True, metavar="NEWDIR", type=click.Path(path_type=str),
              help="The new spool: a directory that does not exist yet, or an empty one.")
@click.option("--segment-size", callback=_size, metavar="SIZE",
              help="The new spool's segment size, as the relay's [spool] segment_size (default 64m).")
@_INTERVALS
@_json_option
def salvage(directory: str, into: str, segment_size: int | None, retry_intervals: tuple[float, ...],
            as_json: bool) -> int:
    """Offline: copy every readable message of the spool DIR (damaged, say) into a new spool NEWDIR, with its
    queue id, class, due time, arrival, attempts and held state; list what could not be saved. DIR is never
    written; the relay must not be running on it. Exit 0: all saved; 1: something lost (listed)."""
    config = SpoolConfig(retry_intervals=retry_intervals)
    try:
        if segment_size is not None:
            config = attrs.evolve(config, segment_size=segment_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--segment-size'") from None
    report = salvager.salvage(directory, into, config)
    code = 0 if report.complete else EXIT_PROBLEMS
    if as_json:
        _print_json(report.as_dict())
        return code
    for line in report.lines():
        click.echo(line)
    return code
