"""Reading the config file: TOML in, a validated ``Config`` out, or every problem as ``FILE: KEY: problem``.

Theory of operation
-------------------
A mistake in the config must stop the relay at start, with a message that
names the file, the key and what is wrong, never surface later as a strange
delivery failure. So every value is checked here, unknown keys are errors
(a misspelt key silently falling back to its default is the worst kind of
typo), and the rest of the relay only ever sees typed, validated values.

Nothing here names a setting. The loader walks the definitions
(``mta.config.sections``): for each section, each setting the file may set is
read with its kind; then the defaults the file left out are filled in, derived
ones from the values they follow (``server.reserved_sessions`` from
``server.max_sessions``, ``spool.queue_minfree`` from
``server.max_message_size`` ...); then the few rules that span settings are
checked. Problems are collected, not stopped at: ``ConfigError`` is the first
(what ``mta serve`` prints), ``problems`` holds them all (what ``mta config
check`` prints).

Where the file comes from (``find_config_file``): an explicit path, else
``$LOGSPOOL_CONFIG``, else ``./logspool.toml``, else no file at all; with no
file the embedded defaults make a working relay (listen on 127.0.0.1:2525,
deliver ``@localhost`` to ``var/maildir``, everything else by MX).

Relative paths (``spool.dir``, ``maildir:`` routes, TLS files, ...) in a
file, and the relative defaults of a config read from a file, resolve against
the file's directory (``base_dir_of``), as nginx and Postfix's ``main.cf``
users expect: the same file names the same spool whichever directory ``mta``
runs in. With no file, the embedded defaults resolve against the current
directory (``make run``'s ``./var/spool``). Either way they are made absolute
*when the config is loaded*, so a later ``chdir`` cannot move the spool.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from mta.config.dkim import DkimKey, parse_dkim_keys
from mta.config.model import DEFAULTS_SOURCE, Config
from mta.config.routes import DEFAULT_ROUTES, NoRoute, Route, TlsPolicy, check_domain, parse_route
from mta.config.sections import SECTIONS, file_settings
from mta.config.values import text_of
from spool import ConfigError, Setting, type_name

__all__ = [
    "DEFAULT_FILE",
    "ENV_VAR",
    "ConfigError",
    "ConfigProblems",
    "base_dir_of",
    "definitions",
    "find_config_file",
    "key_name",
    "load_config",
    "parse_config",
    "problems_of",
]

ENV_VAR = "LOGSPOOL_CONFIG"
# Tables inside a section that are not settings: read by their own parsers.
NESTED = {"dkim": ("key",)}
DEFAULT_FILE = "logspool.toml"


def find_config_file(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The file to load: ``path``, else ``$LOGSPOOL_CONFIG``, else ``./logspool.toml`` if it exists, else None.

    An explicit path or the environment variable must name an existing file
    (``load_config`` raises if not); only the implicit ``./logspool.toml``
    may be absent.
    """
    if path is not None:
        return os.fspath(path)
    environ = os.environ if environ is None else environ
    if environ.get(ENV_VAR):
        return environ[ENV_VAR]
    return DEFAULT_FILE if os.path.isfile(DEFAULT_FILE) else None


def base_dir_of(source: str) -> str | None:
    """Where the relative paths of a config loaded from ``source`` resolve: the file's directory.

    None for the embedded defaults (``DEFAULTS_SOURCE``): the current directory.
    """
    return None if source == DEFAULTS_SOURCE else os.path.dirname(os.path.abspath(source))


def load_config(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Find, read and validate the config (see ``find_config_file``); no file gives the defaults.

    Relative paths resolve against the file's directory (``base_dir_of``).

    Raises:
        ConfigError: unreadable file, TOML syntax error, or a bad value (``problems`` has every one).
    """
    file = find_config_file(path, environ)
    if file is None:
        return parse_config("", DEFAULTS_SOURCE)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e.strerror or e}", file) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 at byte {e.start}", file) from None
    return parse_config(text, file, base_dir_of(file))


def parse_config(text: str, source: str = "<string>", base_dir: str | None = None) -> Config:
    """Validate TOML text. Relative paths resolve against ``base_dir`` (default: the current directory).

    Raises:
        ConfigError: TOML syntax error, unknown key, or a bad value; the message names ``source`` and the key.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"TOML syntax error: {e}", source) from None
    return _Reader(source, base_dir).config(data)


class ConfigProblems(ConfigError):
    """Several problems: reads as the first; ``problems`` holds them all, in the order of the file's sections."""

    def __init__(self, problems: Iterable[ConfigError]) -> None:
        self.problems = tuple(problems)
        first = self.problems[0]
        super().__init__(first.problem, first.file, first.key)


def problems_of(error: ConfigError) -> tuple[ConfigError, ...]:
    """Every problem ``error`` stands for (one, unless the loader found several)."""
    return error.problems if isinstance(error, ConfigProblems) else (error,)


def key_name(key: str) -> str:
    """A key as TOML writes it: bare if it can be, else quoted."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def definitions() -> dict[str, Setting[Any]]:
    """Every setting the file may set, by dotted key."""
    return {f"{section}.{s.name}": s for section, cls in SECTIONS for s in file_settings(cls)}


class _Defaults:
    """The value of any setting: the file's, else its default (derived ones computed once, on demand)."""

    def __init__(self, explicit: Mapping[str, Any], base_dir: str | None) -> None:
        self.explicit = explicit
        self.base_dir = base_dir
        self.known = definitions()
        self.computed: dict[str, Any] = {}

    def __call__(self, key: str) -> Any:
        if key in self.explicit:
            return self.explicit[key]
        if key not in self.computed:
            self.computed[key] = self.known[key].default_for(self)
        return self.computed[key]


class _Reader:
    """One reading of one file: the values it sets, and every problem found on the way."""

    def __init__(self, source: str, base_dir: str | None) -> None:
        self.source = source
        self.base_dir = base_dir
        self.problems: list[ConfigError] = []

    def problem(self, error: ConfigError, key: str) -> None:
        located = error.at(key)
        self.problems.append(ConfigError(located.problem, self.source, located.key))

    def config(self, data: Mapping[str, Any]) -> Config:
        explicit: dict[str, Any] = {}
        for section, cls in SECTIONS:
            table = self.table(data, section)
            names = [s.name for s in file_settings(cls)] + list(NESTED.get(section, ()))
            for s in file_settings(cls):
                if s.name in table and not (s.blank_is_default and table[s.name] == ""):
                    try:
                        explicit[f"{section}.{s.name}"] = s.kind.read(table[s.name], self.base_dir)
                    except ConfigError as e:
                        self.problem(e, f"{section}.{s.name}")
            self.unknown(table, names, f"{section}.")
        routes = self.routes(data)
        dkim_keys = self.dkim_keys(data)
        self.unknown(data, [section for section, _ in SECTIONS] + ["routes"], "")
        if not self.problems:
            config = self.build(explicit, routes, dkim_keys)
            if not self.problems:
                return config
        raise ConfigProblems(self.problems)

    def table(self, data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
        table = data.get(name, {})
        if not isinstance(table, dict):
            self.problem(ConfigError(f"expected a table, got {type_name(table)} {table!r}"), name)
            return {}
        return table

    def unknown(self, table: Mapping[str, Any], known: list[str], prefix: str) -> None:
        for name in sorted(set(table) - set(known)):
            hint = difflib.get_close_matches(name, sorted(known), n=1)
            self.problem(ConfigError("unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")),
                         prefix + key_name(name))

    def routes(self, data: Mapping[str, Any]) -> dict[str, Route]:
        if "routes" not in data:
            return {domain: parse_route(value, self.base_dir) for domain, value in DEFAULT_ROUTES.items()}
        routes: dict[str, Route] = {}
        for name, value in self.table(data, "routes").items():
            key = f"routes.{key_name(name)}"
            try:
                domain = "*" if name == "*" else check_domain(name)
                if domain in routes:
                    raise ConfigError(f"names the same domain as another key ({domain!r})")
                routes[domain] = parse_route(text_of(value), self.base_dir)
            except ConfigError as e:
                self.problem(e, key)
        return routes

    def dkim_keys(self, data: Mapping[str, Any]) -> tuple[DkimKey, ...]:
        table = data.get("dkim", {})
        if not isinstance(table, dict) or "key" not in table:
            return ()
        keys, problems = parse_dkim_keys(table["key"], self.base_dir)
        for e in problems:
            self.problems.append(ConfigError(e.problem, self.source, f"dkim.{e.key}"))
        return keys

    def build(self, explicit: Mapping[str, Any], routes: Mapping[str, Route],
              dkim_keys: tuple[DkimKey, ...] = ()) -> Config:
        value = _Defaults(explicit, self.base_dir)
        sections = {section: cls(**{s.name: value(f"{section}.{s.name}") for s in file_settings(cls)})
                    for section, cls in SECTIONS}
        config = Config(**sections, routes=routes, source=self.source, dkim_keys=dkim_keys)
        self.rules(config, explicit)
        return config

    def rules(self, config: Config, explicit: Mapping[str, Any]) -> None:
        """What no single setting can check."""
        server, relay = config.server, config.relay
        for problem in config.egress.problems(shaping=config.shaping.enabled):
            self.problem(ConfigError(problem.problem), f"egress.{problem.key}")
        if (server.tls_cert is None) != (server.tls_key is None):
            self.problem(ConfigError("tls_cert and tls_key must be set together"),
                         "server.tls_key" if server.tls_cert else "server.tls_cert")
        if "server.reserved_sessions" in explicit and server.reserved_sessions >= server.max_sessions:
            self.problem(ConfigError(f"must be less than max_sessions ({server.max_sessions}), or clients outside "
                                     f"mynetworks could never connect; got {server.reserved_sessions}"),
                         "server.reserved_sessions")
        if relay.open_to_all() and not relay.allow_open_relay:
            self.problem(ConfigError("covers every address, which makes an open relay (anyone may send anywhere); "
                                     "set [relay] allow_open_relay = true if that is really meant"), "relay.mynetworks")
        submission = config.submission
        if submission.enabled and server.tls_cert is None:
            self.problem(ConfigError("a submission listener needs TLS: set [server] tls_cert and tls_key"),
                         "submission.listen" if submission.listen else "submission.implicit_tls_listen")
        if submission.enabled and submission.users_file is None:
            self.problem(ConfigError("a submission listener needs users to authenticate: set users_file"),
                         "submission.users_file")
        dane = [domain for domain, route in config.routes.items() if TlsPolicy.DANE in getattr(route, "policies", ())]
        if dane and config.delivery.resolver is None:
            self.problem(ConfigError(f"route {dane[0]!r} uses DANE, which needs a validating resolver named here "
                                     "(say unbound on 127.0.0.1): the system's may not check DNSSEC"),
                         "delivery.resolver")
        if isinstance(config.route_for_recipient(relay.postmaster), NoRoute):
            self.problem(ConfigError(f"no route delivers {relay.postmaster!r}: add a route for its domain"),
                         "relay.postmaster")
