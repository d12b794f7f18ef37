"""``mta config check`` and ``mta config show``: the config as the relay will read it, without starting it.

Exit statuses are ``mta serve``'s: 2 when the config must change, 1 when
something on this host is in the way, 0 when neither; every problem is one
line on stderr (``mta: FILE: KEY: problem``), never a traceback.
"""

from __future__ import annotations

import sys

import click

from mta.config.loader import base_dir_of, load_config, problems_of
from mta.config.model import Config
from mta.config.show import show_config
from mta.process.check import check_host
from spool import ConfigError

__all__ = ["config"]

EXIT_CONFIG = 2

config_file = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                           help="TOML config file (default: $LOGSPOOL_CONFIG, ./logspool.toml, built-ins)")


def _load(path: str | None) -> Config:
    """The config, or every problem of the file as one line each and exit 2."""
    try:
        return load_config(path)
    except ConfigError as exc:
        for problem in problems_of(exc):
            click.echo(f"mta: {problem}", err=True)
    except OSError as exc:
        click.echo(f"mta: cannot read config: {exc}", err=True)
    sys.exit(EXIT_CONFIG)


@click.group()
def config() -> None:
    """Check or show the configuration (nothing is started or changed)."""


@config.command(short_help="Check the config and this host as `mta serve` would.")
@config_file
def check(config_path: str | None) -> None:
    """Check the config file and what it needs of this host, as `mta serve` would, like `postfix check`.

    The file (every key and value), the TLS files, the control socket, the
    spool directory (ownership and permissions, or that it can be made), free
    disk against spool.queue_minfree, and the archive directory. Prints
    "config OK: FILE", or one line per problem and exits 2 (the config must
    change) or 1 (something on this host is in the way).
    """
    cfg = _load(config_path)
    findings = check_host(cfg)
    for finding in findings:
        click.echo(f"mta: {'warning: ' if finding.warning else ''}{finding.error}", err=True)
    status = max((finding.exit_code for finding in findings), default=0)
    if status:
        sys.exit(status)
    click.echo(f"config OK: {cfg.source}")


@config.command(short_help="Print the settings in effect, as TOML.")
@config_file
@click.option("-n", "only_changed", is_flag=True, help="Only the settings that differ from the defaults "
                                                       "(as postconf -n).")
def show(config_path: str | None, only_changed: bool) -> None:
    """Every setting in effect, as TOML that reads back as the same config (defaults and derived values included)."""
    cfg = _load(config_path)
    click.echo(show_config(cfg, only_changed=only_changed, base_dir=base_dir_of(cfg.source)), nl=False)
