"""What every ``mta`` command shares: the ``--config`` and ``--json`` options and the exit statuses.

How an error becomes a line and a status is decided in one place,
``mta.cli.Mta``; this module only names the pieces so that commands defined
in other packages (``mta queue`` in ``mta.admin.cli``) use the same ones.
"""

from __future__ import annotations

from typing import Any

import click

EXIT_OK = 0
EXIT_FAILURE = 1  # the command could not do its work now: relay or spool trouble, no such message
EXIT_USAGE = 2  # the command can never work as given: bad arguments or a bad config (fix them first)
JSON_REQUESTED = "mta.json"  # ``click.Context.meta`` key: set when ``--json`` was given

config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                             help="TOML config file (default: $LOGSPOOL_CONFIG, ./logspool.toml, built-ins)")


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    """Leave the flag where the error handler finds it, whichever command raised."""
    if value:
        ctx.meta[JSON_REQUESTED] = True
    return value


# Eager, so the flag is known before the other options are converted (and perhaps refused).
json_option = click.option("--json", "as_json", is_flag=True, is_eager=True, callback=_remember_json,
                           help="machine-readable output (errors too: {\"error\": ..., \"code\": ...})")


def takes_json(command: Any) -> bool:
    """Does ``command`` have the ``--json`` option?"""
    return any(p.name == "as_json" for p in getattr(command, "params", ()))
