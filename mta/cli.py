"""The ``mta`` command: run the relay and administer its queue.

Every command takes ``--config FILE`` (default ``$LOGSPOOL_CONFIG``, then
``./logspool.toml``, then the embedded defaults). Commands raise; ``Mta``
turns what they raise into one line (``mta: ...`` on stderr, or
``{"error": ..., "code": ...}`` on stdout with ``--json``) and an exit status,
from the one table ``FAILURES``: never a traceback. click's usage errors are
one line too (``mta queue list: Invalid value for '--limit': ...``, exit 2),
not click's usage, hint and problem over four lines. docs/operations.md
lists the statuses.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from typing import Any, NoReturn

import attrs
import click

from mta.admin.cli import queue
from mta.admin.errors import (
    AdminError,
    BadRequest,
    NoSuchMessage,
    RelayNotAnswering,
    RequestFailed,
    SpoolNotFound,
    SpoolUnavailable,
)
from mta.archive.cli import archive
from mta.archive.errors import ArchiveError, UploadFailed
from mta.auth.cli import user
from mta.auth.users import UsersFileError
from mta.cli_common import EXIT_FAILURE, EXIT_USAGE, JSON_REQUESTED, config_option, takes_json
from mta.config import ConfigError, load_config, parse_listen_address
from mta.dkim.cli import dkim as dkim_command
from mta.events.cli import events
from mta.observe.logline import install as install_logging
from mta.process.config_cli import config as config_command
from mta.shaping.cli import shape
from spool import SpoolError, SpoolLocked

_ARGV = "mta.argv"

# What each failure is, for the operator and for a script: (exception, exit status, ``code`` in --json).
# The first class that matches wins, so a subclass comes before its base.
FAILURES: tuple[tuple[type[BaseException], int, str], ...] = (
    (ConfigError, EXIT_USAGE, "config"),
    (BadRequest, EXIT_USAGE, "bad_request"),
    (NoSuchMessage, EXIT_FAILURE, "not_found"),
    (RelayNotAnswering, EXIT_FAILURE, "relay_not_answering"),
    (SpoolNotFound, EXIT_FAILURE, "spool_not_found"),
    (SpoolUnavailable, EXIT_FAILURE, "spool_unavailable"),
    (RequestFailed, EXIT_FAILURE, "failed"),
    (UsersFileError, EXIT_FAILURE, "users_file"),
    (AdminError, EXIT_FAILURE, "failed"),  # a class added to mta/admin/errors.py and not to this table
    (UploadFailed, EXIT_FAILURE, "upload_failed"),
    (ArchiveError, EXIT_USAGE, "archive"),
    (SpoolLocked, EXIT_FAILURE, "spool_locked"),
    (SpoolError, EXIT_FAILURE, "spool"),
    (OSError, EXIT_FAILURE, "os"),
)


def message(exc: BaseException) -> str:
    """What the operator reads about ``exc``: one line."""
    text = str(exc)
    if isinstance(exc, SpoolLocked):
        text += " (is another relay running on it?)"
    return " ".join(text.splitlines()) or type(exc).__name__


def fail(ctx: click.Context, text: str, status: int, code: str, as_json: bool) -> NoReturn:
    """Show a failure in one line and end the command with ``status``."""
    if as_json:  # stdout holds one JSON object: the answer, or this
        click.echo(json.dumps({"error": text, "code": code}, sort_keys=True))
    else:
        click.echo(f"mta: {text}", err=True)
    ctx.exit(status)


def usage_error(ctx: click.Context, exc: click.UsageError) -> NoReturn:
    """A usage error as one line on stderr, ``COMMAND: PROBLEM (see 'COMMAND --help')``, and its exit status.

    ``mta`` alone (or ``mta queue``) is not an error to report in a line: click shows the help.
    """
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):
        raise exc
    where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
    problem = " ".join(exc.format_message().split())
    click.echo(f"{where}: {problem} (see '{where} --help')", err=True)
    ctx.exit(exc.exit_code)


class Mta(click.Group):
    """The ``mta`` group: the one place where an error becomes a line and an exit status."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_ARGV] = list(args)
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:  # ``mta --bogus``: before any command
            usage_error(ctx, exc)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            argv: list[str] = ctx.meta.get(_ARGV, [])
            asked = "--json" in (argv[: argv.index("--")] if "--" in argv else argv)
            if not (ctx.meta.get(JSON_REQUESTED) or asked) or not takes_json(exc.ctx and exc.ctx.command):
                usage_error(ctx, exc)
            fail(ctx, " ".join(exc.format_message().splitlines()), exc.exit_code, "usage", True)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
                raise  # click's: the reader of our output has gone
            for kind, status, code in FAILURES:
                if isinstance(exc, kind):
                    fail(ctx, message(exc), status, code, bool(ctx.meta.get(JSON_REQUESTED)))
            raise


@click.group(cls=Mta)
@click.version_option(package_name="logspool", prog_name="mta", message="%(prog)s (logspool) %(version)s")
def main() -> None:
    """logspool: a log-structured mail relay."""


def _interrupted(_signum: int, _frame: object) -> None:
    """SIGINT in ``mta serve``: one line and exit 130 at once (nothing to shut down: the next start recovers)."""
    os.write(2, b"mta: interrupted (SIGINT); nothing to shut down, the next start recovers\n")
    os._exit(130)


@main.command()
@config_option
@click.option("--shard", type=click.IntRange(0), default=None, hidden=True,
              help="(set by the supervisor) run only this spool shard")
@click.option("--shards", type=click.IntRange(1), default=None, hidden=True,
              help="(set by the supervisor) how many shards the relay runs")
@click.option("--supervisor", "supervisor_pid", type=int, default=None, hidden=True,
              help="(set by the supervisor) its pid: the shard exits when it dies")
@click.option("--listen", "listen", multiple=True, hidden=True,
              help="(set by the supervisor) the addresses, ports resolved")
def serve(config_path: str | None, shard: int | None, shards: int | None, supervisor_pid: int | None,
          listen: tuple[str, ...]) -> None:
    """Run the relay (crash-only: stop it with any signal; the next start recovers).

    With ``[server] processes`` above 1 (or shards on disk from an earlier
    run), this process supervises one child process per spool shard.
    """
    # Crash-only, Ctrl-C included: SIGINT ends the process at once, with no shutdown code and no
    # KeyboardInterrupt traceback. The process an operator started says so in one line and exits 130 (the
    # shell's code for Ctrl-C); a shard child (which gets the same SIGINT from the terminal) dies by the signal
    # silently, so the line is printed once. See docs/operations.md.
    signal.signal(signal.SIGINT, signal.SIG_DFL if shard is not None else _interrupted)
    # A SIGHUP (a reload) before the relay's handler is up (mta.process.lifecycle) must not end the process.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from mta.errors import StartError
    from mta.process.relay import serve as run
    from mta.process.relay import serve_shard
    from mta.process.supervisor import supervise
    from mta.shards import shard_count, spool_config

    config = load_config(config_path)
    if listen:
        try:
            addrs = tuple(parse_listen_address(a) for a in listen)
        except ConfigError as exc:
            raise ConfigError(str(exc), key="--listen") from None
        config = attrs.evolve(config, server=attrs.evolve(config.server, listen=addrs))
    if shard is not None and (shards is None or supervisor_pid is None or shard >= shards):
        raise ConfigError("is for the supervisor: it needs --shards (above the shard) and --supervisor",
                          key="--shard")
    count = shards if shards is not None else shard_count(config)
    try:
        spool_config(config)  # the engine's own checks, before any process or socket: one line, not a traceback
    except ValueError as exc:
        raise ConfigError(str(exc), config.source, "spool") from None
    # One line per event, each naming its process, as Postfix's do (mta.observe.logline).
    install_logging(config.log.level, config.log.format)
    try:
        if shard is not None:
            assert supervisor_pid is not None
            serve_shard(config, shard, count, supervisor_pid)
        elif count == 1:
            run(config)
        else:
            supervise(config)
    except ConfigError as exc:  # a check at start names the key; the file is the one we loaded
        raise (exc if exc.file else ConfigError(exc.problem, config.source, exc.key)) from None
    except StartError as exc:
        raise exc.located(config.source) from None


@main.command()
@config_option
def reload(config_path: str | None) -> None:
    """Make the running relay read its config again (as SIGHUP does; each shard's process with several).

    The relay logs one line: what changed, and what waits for a restart; an
    invalid config changes nothing (that line says why).
    """
    from mta.admin.client import ask_relay
    from mta.admin.control import socket_path
    from mta.shards import shard_config, shards_on_disk

    config = load_config(config_path)
    count = max(1, shards_on_disk(config.spool.dir))  # the running relay's shards, whatever the file says now
    for k in range(count):
        path = socket_path(shard_config(config, k, count))
        answer = ask_relay(path, {"op": "reload"})
        if answer is None:
            raise RelayNotAnswering(f"no relay answers on {path}: is it running?")
        click.echo(f"reload signalled to the relay (pid {answer['pid']}); its log says what changed")


main.add_command(queue)
main.add_command(archive)
main.add_command(user)


def _register_report() -> None:
    try:
        from mta.report.cli import report
    except ImportError:  # the Spark extra is not installed
        return
    main.add_command(report)


_register_report()
main.add_command(config_command)
main.add_command(dkim_command)
main.add_command(events)
main.add_command(shape)
