"""``mta config check``: what ``mta serve`` would find wrong on this host, found without starting anything.

Theory of operation
-------------------
The file itself is checked by the loader (every value, every key, the rules
that span settings). What a file alone cannot tell is checked here, with the
same functions ``mta serve`` uses, in the same words, but nothing is created,
repaired, bound or opened for writing, so it is safe while the relay runs (as
``postfix check``):

- the TLS certificate and key (PEM, matching, the key private), the DKIM
  keys (private, readable, able to sign), and every
  shard's control socket path (``mta.process.startup``);
- the spool directory: if it exists, that no other user can change it
  (``mta.process.security``, without its repairs: entries others could only
  read are a warning, since ``mta serve`` makes them private and starts); if it
  does not, that it can be created (its nearest existing parent is a
  directory this user may write);
- free space where the spool is, against ``spool.queue_minfree``: below it the
  relay starts but answers every MAIL with 452, which an operator wants to
  know before, not after;
- ``spool.archive_dir``: creatable, and on the spool's filesystem (segments
  are moved there by rename, which cannot cross filesystems).

Each finding keeps the exception ``mta serve`` would raise: a ``ConfigError``
(the config must change, exit 2) or a ``StartError`` (something on this host
is in the way, exit 1).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import attrs

from mta.config.model import Config
from mta.errors import StartError
from mta.process.security import UnsafeFile, check_spool_dir
from mta.process.startup import (
    check_control_socket,
    check_dkim_keys,
    check_recipient_tables,
    check_shaping,
    check_tls,
    check_users_file,
)
from mta.shards import shard_config, shard_count
from spool import ConfigError

__all__ = ["Finding", "check_host"]


@attrs.frozen
class Finding:
    """One thing found: a problem that stops ``mta serve`` (or the mail), or a warning it survives."""

    error: ConfigError | StartError
    warning: bool = False

    @property
    def exit_code(self) -> int:
        return 0 if self.warning else 2 if isinstance(self.error, ConfigError) else 1


def check_host(config: Config) -> list[Finding]:
    """Every finding, in the order ``mta serve`` meets them; an empty list means it would start and take mail."""
    findings: list[Finding] = []
    for check in CHECKS:
        try:
            findings.extend(check(config))
        except (ConfigError, StartError) as exc:
            findings.append(Finding(_located(exc, config)))
        except OSError as exc:  # a directory this user cannot read, say: serve would stop on it too (exit 1)
            findings.append(Finding(StartError(str(exc), config.source)))
    return findings


def _located(exc: ConfigError | StartError, config: Config) -> ConfigError | StartError:
    if isinstance(exc, StartError):
        return exc.located(config.source)
    return exc if exc.file else ConfigError(exc.problem, config.source, exc.key)


def _tls(config: Config) -> Iterator[Finding]:
    """Raises what ``mta serve`` raises (``check_start``); finds nothing else."""
    check_tls(config)
    yield from ()


def _dkim_keys(config: Config) -> Iterator[Finding]:
    """Each DKIM key private, readable and able to sign (``check_start``); the first problem only, as serve."""
    check_dkim_keys(config)
    yield from ()


def _users_file(config: Config) -> Iterator[Finding]:
    """The submission users file, as ``mta serve`` checks it (``check_start``)."""
    check_users_file(config)
    yield from ()


def _recipient_tables(config: Config) -> Iterator[Finding]:
    """``[recipients] tables``, read as ``mta serve`` reads them (``check_start``)."""
    check_recipient_tables(config)
    yield from ()


def _shaping(config: Config) -> Iterator[Finding]:
    """The shaping table, read as ``mta serve`` reads it (``check_start``)."""
    check_shaping(config)
    yield from ()


def _control_sockets(config: Config) -> Iterator[Finding]:
    """Every shard's socket, as the supervisor checks them before it starts any (``check_start``)."""
    shards = shard_count(config)
    for k in range(shards):
        check_control_socket(shard_config(config, k, shards))
    yield from ()


def _existing_parent(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _creatable(path: str, key: str, config: Config) -> Iterator[Finding]:
    """``path`` is a directory, or can be made: its nearest existing parent is one this user may write into."""
    if os.path.isdir(path):
        return
    if os.path.lexists(path):
        yield Finding(StartError(f"{path} exists and is not a directory", config.source, key))
        return
    parent = _existing_parent(path)
    if not os.path.isdir(parent):
        yield Finding(StartError(f"cannot create {path}: {parent} is not a directory", config.source, key))
    elif not os.access(parent, os.W_OK | os.X_OK):
        yield Finding(StartError(f"cannot create {path}: this user (uid {os.geteuid()}) may not write in {parent}",
                                 config.source, key))


def _spool_dir(config: Config) -> Iterator[Finding]:
    path = config.spool.dir
    if not os.path.lexists(path):
        yield from _creatable(path, "spool.dir", config)
        return
    try:
        readable = check_spool_dir(path, repair=False)
    except UnsafeFile as exc:
        yield Finding(StartError(str(exc), config.source, "spool.dir"))
        return
    if readable:
        yield Finding(StartError(f"group or others can read {len(readable)} entr{'y' if len(readable) == 1 else 'ies'}"
                                 f" (the first: {readable[0]}); mta serve makes them private (directories 0700, "
                                 "files 0600)", config.source, "spool.dir"), warning=True)


def _free_space(config: Config) -> Iterator[Finding]:
    where = _existing_parent(config.spool.dir)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if st.f_blocks and free < config.spool.queue_minfree:  # no size (total 0) is not a full disk
        yield Finding(StartError(
            f"{free / (1 << 20):.1f} MiB free on the filesystem of {where}, less than spool.queue_minfree "
            f"({config.spool.queue_minfree / (1 << 20):.1f} MiB): the relay would start but refuse all mail with 452",
            config.source, "spool.queue_minfree"))


def _archive_dir(config: Config) -> Iterator[Finding]:
    archive = config.spool.archive_dir
    if archive is None:
        return
    found = list(_creatable(archive, "spool.archive_dir", config))
    yield from found
    if found:
        return
    spool_fs = os.stat(_existing_parent(config.spool.dir)).st_dev
    if os.stat(_existing_parent(archive)).st_dev != spool_fs:
        yield Finding(StartError(f"{archive} is on another filesystem than spool.dir {config.spool.dir}: segments "
                                 "are moved there by rename, which cannot cross filesystems", config.source,
                                 "spool.archive_dir"))


CHECKS: tuple[Callable[[Config], Iterator[Finding]], ...] = (_tls, _dkim_keys, _users_file, _recipient_tables,
                                                              _shaping, _control_sockets, _spool_dir, _free_space,
                                                              _archive_dir)
