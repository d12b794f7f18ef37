"""The relay's configuration: one TOML file, validated up front into frozen records.

Every setting is defined once, with its type, default, limits and one line of
help: the engine's in ``spool.config.engine`` (so the engine needs nothing from
here), the relay's in ``mta.config.sections``. Everything else is made from
those definitions:

- ``values``: the kinds of value only the relay has (addresses, networks, ...);
  durations and sizes are read and written by ``spool.config.units``;
- ``routes``: the ``[routes]`` table, its transports and domain matching;
- ``sections``: the definitions, as the records the relay reads;
- ``model``: ``Config``, and the decisions that span sections (routing, relay control);
- ``loader``: file → ``Config``, every problem as ``FILE: KEY: problem``;
- ``show``: ``Config`` → TOML (``mta config show [-n]``);
- ``check``: what this host must offer the config (``mta config check``);
- ``doc``: the settings tables of docs/operations.md;
- ``cli``: the ``mta config`` commands.

The names below are the package's interface; import them from ``mta.config``.
"""

from mta.config.loader import (
    DEFAULT_FILE,
    ENV_VAR,
    ConfigProblems,
    base_dir_of,
    find_config_file,
    load_config,
    parse_config,
    problems_of,
)
from mta.config.model import DEFAULTS_SOURCE, Config
from mta.config.routes import (
    DEFAULT_ROUTES,
    DiscardRoute,
    LmtpRoute,
    MaildirRoute,
    MxRoute,
    NoRoute,
    Route,
    SmtpRoute,
    TlsMode,
    TlsPolicy,
    format_route,
    parse_route,
    parse_tls,
    tls_text,
)
from mta.config.sections import (
    LOG_FORMATS,
    LOG_LEVELS,
    DeliveryConfig,
    LogConfig,
    RelayConfig,
    ServerConfig,
    SpoolSection,
    SubmissionConfig,
)
from mta.config.values import IPAddress, IPNetwork, ListenAddress, parse_listen_address
from spool import ConfigError, parse_duration, parse_size

__all__ = [
    "DEFAULTS_SOURCE",
    "DEFAULT_FILE",
    "DEFAULT_ROUTES",
    "ENV_VAR",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "Config",
    "ConfigError",
    "ConfigProblems",
    "DeliveryConfig",
    "DiscardRoute",
    "IPAddress",
    "IPNetwork",
    "ListenAddress",
    "LmtpRoute",
    "LogConfig",
    "MaildirRoute",
    "MxRoute",
    "NoRoute",
    "RelayConfig",
    "Route",
    "ServerConfig",
    "SmtpRoute",
    "SpoolSection",
    "SubmissionConfig",
    "TlsMode",
    "TlsPolicy",
    "base_dir_of",
    "find_config_file",
    "format_route",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_listen_address",
    "parse_route",
    "parse_size",
    "parse_tls",
    "problems_of",
    "tls_text",
]
