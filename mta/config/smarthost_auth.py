"""``[smarthost_auth]``: the logins the relay uses at fixed next hops (a provider's submission service).

The secrets live in a file of their own, never in the config (which ``mta
config show`` prints and operators paste into tickets): a TOML table per
next hop, named as the route names it, ``"HOST:PORT"``::

    ["smtp.provider.example:587"]
    user = "relay@example.com"
    password = "..."
    mechanism = "PLAIN"   # optional: PLAIN or LOGIN; else PLAIN if offered, else LOGIN

The file must be the relay user's alone (mode 0600 or 0400): the config is
refused otherwise, in one line, as it is for any bad content; its passwords
never appear in a message (``Login.__repr__`` hides them). A login is used
only on ``smtp://`` routes (never for an MX: a secret sent to whatever host
DNS names is a secret given away), and only over TLS the route requires:
docs/operations.md, "Logging in to a smarthost".
"""

from __future__ import annotations

import os
import stat
import tomllib

import attrs

from mta.config.values import parse_listen_address, text_of
from spool import ConfigError, Kind, Optional, resolve_path, setting

__all__ = ["MECHANISMS", "Login", "SecretsFile", "SmarthostAuthSection", "read_logins"]

MECHANISMS = ("PLAIN", "LOGIN")
MAX_USER = 256
MAX_PASSWORD = 256


@attrs.frozen
class Login:
    """One next hop's credentials; ``mechanism`` empty: the best the server offers."""

    user: str
    password: str = attrs.field(repr=False)
    mechanism: str = ""


def _entry(name: str, table: object) -> tuple[tuple[str, int], Login]:
    where = f"[{name!r}]"
    try:
        address = parse_listen_address(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: not HOST:PORT ({exc.problem})") from None
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table with user and password")
    unknown = sorted(set(table) - {"user", "password", "mechanism"})
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}")
    user, password, mechanism = table.get("user"), table.get("password"), table.get("mechanism", "")
    if not isinstance(user, str) or not 0 < len(user) <= MAX_USER or any(ord(c) < 32 for c in user):
        raise ConfigError(f"{where}: user must be text of 1 to {MAX_USER} characters without control characters")
    if not isinstance(password, str) or not 0 < len(password) <= MAX_PASSWORD or "\0" in password:
        raise ConfigError(f"{where}: password must be text of 1 to {MAX_PASSWORD} characters without NUL")
    if not isinstance(mechanism, str) or mechanism.upper() not in ("", *MECHANISMS):
        raise ConfigError(f"{where}: mechanism must be PLAIN or LOGIN")
    return (address.host.lower(), address.port), Login(user, password, mechanism.upper())


def read_logins(path: str) -> dict[tuple[str, int], Login]:
    """The logins of ``path``, by (host in lower case, port).

    Raises:
        ConfigError: the file is open to other users, unreadable, not TOML, or an entry is bad (one line;
        never a password).
    """
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{path} is open to other users (mode {mode:04o}): chmod 600 it")
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        # The decoder's words name a line and column, never the text there.
        raise ConfigError(f"{path} is not TOML: {exc}") from None
    return dict(_entry(name, table) for name, table in data.items())


@attrs.frozen
class SecretsFile(Kind[str]):
    """A secrets file: private to its owner, and readable as logins when the config is read."""

    def what(self) -> str:
        return "path of a file (mode 0600)"

    def convert(self, raw: object, base_dir: str | None) -> str:
        path = resolve_path(text_of(raw), base_dir)
        read_logins(path)
        return path


@attrs.frozen(kw_only=True)
class SmarthostAuthSection:
    """``[smarthost_auth]``: docs/operations.md, "Logging in to a smarthost"."""

    secrets_file: str | None = setting(
        Optional(SecretsFile()), "logins for `smtp://` routes, one TOML table per `\"HOST:PORT\"` with `user`, "
        "`password` (and `mechanism`); mode 0600 or the relay refuses to start. Sent only over TLS the route "
        "requires; read again when it changes", None)
