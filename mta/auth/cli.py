"""``mta user add|passwd|del USER``: manage the users file of SMTP AUTH (``[submission] users_file``).

The password is read from the terminal (asked twice, not echoed), or with
``--password-stdin`` from the first line of standard input, so that a script
never puts it on a command line (where ``ps`` shows it to every user). A
running relay sees the change at the next AUTH: it rereads the file when it
changes. Errors are one line and a status, as every ``mta`` command's
(``mta.cli.FAILURES``).
"""

from __future__ import annotations

import sys

import click

from mta.auth.users import add_user, check_password, delete_user, set_password
from mta.cli_common import config_option
from mta.config import ConfigError, load_config

__all__ = ["user"]

file_option = click.option("--file", "file_path", type=click.Path(dir_okay=False), default=None,
                           help="the users file (default: [submission] users_file of the config)")
stdin_option = click.option("--password-stdin", is_flag=True,
                            help="read the password from the first line of standard input, not a terminal")


def _users_file(config_path: str | None, file_path: str | None) -> str:
    if file_path is not None:
        return file_path
    config = load_config(config_path)
    if config.submission.users_file is None:
        raise ConfigError("not set: give it, or --file PATH", config.source, "submission.users_file")
    return config.submission.users_file


def _password(from_stdin: bool) -> str:
    if from_stdin:
        line = sys.stdin.readline()
        return check_password(line.removesuffix("\n").removesuffix("\r"))
    if not sys.stdin.isatty():
        raise click.UsageError("standard input is not a terminal: give --password-stdin to read the password there")
    return check_password(click.prompt("Password", hide_input=True, confirmation_prompt=True, err=True))


@click.group()
def user() -> None:
    """Users of SMTP AUTH on the submission ports (the users file of [submission])."""


@user.command("add")
@click.argument("name")
@config_option
@file_option
@stdin_option
def add(name: str, config_path: str | None, file_path: str | None, password_stdin: bool) -> None:
    """Add user NAME with a new password (the file is created, mode 0600, if it does not exist)."""
    path = _users_file(config_path, file_path)
    add_user(path, name, _password(password_stdin))
    click.echo(f"mta user: added {name} to {path}")


@user.command("passwd")
@click.argument("name")
@config_option
@file_option
@stdin_option
def passwd(name: str, config_path: str | None, file_path: str | None, password_stdin: bool) -> None:
    """Give user NAME a new password."""
    path = _users_file(config_path, file_path)
    set_password(path, name, _password(password_stdin))
    click.echo(f"mta user: changed the password of {name} in {path}")


@user.command("del")
@click.argument("name")
@config_option
@file_option
def delete(name: str, config_path: str | None, file_path: str | None) -> None:
    """Remove user NAME (its sessions already authenticated keep going; new AUTH fails)."""
    path = _users_file(config_path, file_path)
    delete_user(path, name)
    click.echo(f"mta user: removed {name} from {path}")
