"""The relay's configuration: one TOML file, validated up front into frozen records.

Theory of operation
-------------------
A mistake in the config must stop the relay at start, with a message that
names the file, the key and what is wrong, never surface later as a strange
delivery failure. So every value is checked here, unknown keys are errors
(a misspelt key silently falling back to its default is the worst kind of
typo), and the rest of the relay only ever sees typed, validated values.

Where the file comes from (``find_config_file``): an explicit path, else
``$LOGSPOOL_CONFIG``, else ``./logspool.toml``, else no file at all; with no
file the embedded defaults make a working relay (listen on 127.0.0.1:2525,
deliver ``@localhost`` to ``var/maildir``, everything else by MX).

Relative paths (``spool.dir``, ``maildir:`` routes, TLS files, ...) are
resolved against the current directory *when the config is loaded*, so a
later ``chdir`` cannot move the spool.

Values
------
Durations: ``"30s"``, ``"5m"``, ``"2h"``, ``"5d"``, ``"1w"``, ``"250ms"``, or
a plain number of seconds. Sizes: ``"10MB"``, ``"10M"``, ``"512k"``,
``"1GiB"``, or a plain number of bytes; the multipliers are binary (k = 1024)
as in Exim and Postfix's documentation of message_size_limit's neighbours.

Routes map a recipient domain to a transport::

    [routes]
    "localhost" = "maildir:var/maildir"   # local delivery, one Maildir per local part
    "example.com" = "smtp://10.0.0.5:25"  # static next hop (exact domain only)
    ".example.com" = "smtp://[::1]:2526?tls=require"  # any subdomain of example.com
    "bench.test" = "discard"
    "*" = "mx"                             # everything else, by MX lookup

A ``[routes]`` table replaces the default routes entirely (so a config can
leave out ``"*"``); with no ``"*"`` route, a domain that matches nothing gets
``NoRoute``, which the relay answers with ``550 5.1.2``.
"""

from __future__ import annotations

import difflib
import enum
import functools
import ipaddress
import math
import os
import re
import socket
import tomllib
import types
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from mta.smtp.common import parse_mailbox
from spool.config import MAX_SEGMENT_SIZE, MIN_SEGMENT_SIZE

__all__ = [
    "Config",
    "ConfigError",
    "DeliveryConfig",
    "DiscardRoute",
    "ListenAddress",
    "LogConfig",
    "MaildirRoute",
    "MxRoute",
    "NoRoute",
    "RelayConfig",
    "Route",
    "ServerConfig",
    "SmtpRoute",
    "SpoolConfig",
    "TlsMode",
    "find_config_file",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_listen_address",
    "parse_route",
    "parse_size",
]

ENV_VAR = "LOGSPOOL_CONFIG"
DEFAULT_FILE = "logspool.toml"
DEFAULTS_SOURCE = "<defaults>"

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ConfigError(ValueError):
    """The config cannot be used. ``file``, ``key`` (dotted) and ``problem`` say why.

    The message reads ``FILE: KEY: PROBLEM`` so an operator can go straight to it.
    """

    def __init__(self, problem: str, file: str = "", key: str = "") -> None:
        self.file = file
        self.key = key
        self.problem = problem
        super().__init__(": ".join(part for part in (file, key, problem) if part))


# --------------------------------------------------------------------------- values

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
# A hundred years: anything longer is a typo, and it keeps arithmetic on
# deadlines far from float overflow.
_MAX_DURATION = 100 * 365 * 86400.0


def parse_duration(value: object) -> float:
    """Seconds from ``"30s"``/``"5m"``/``"2h"``/``"5d"``/``"1w"``/``"250ms"`` or a plain number.

    A bare number (TOML int or float, or a string of digits) is seconds.

    Raises:
        ConfigError: not a duration, negative, not finite, or over 100 years.
    """
    if isinstance(value, bool):
        raise ConfigError(f"expected a duration like '30s', '5m', '2h' or '5d', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.fullmatch(value)):
        seconds = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    else:
        raise ConfigError(f"expected a duration like '30s', '5m', '2h' or '5d', got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"a duration must be a finite number of seconds >= 0, got {value!r}")
    if seconds > _MAX_DURATION:
        raise ConfigError(f"duration {value!r} is longer than 100 years")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from ``"10MB"``/``"10M"``/``"512k"``/``"1GiB"`` or a plain integer (k = 1024).

    Raises:
        ConfigError: not a size, or negative.
    """
    if isinstance(value, bool):
        raise ConfigError(f"expected a size like '10MB', '512k' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE_RE.fullmatch(value)):
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    else:
        raise ConfigError(f"expected a size like '10MB', '512k' or a number of bytes, got {value!r}")
    if size < 0:
        raise ConfigError(f"a size must be >= 0, got {value!r}")
    return size


@attrs.frozen
class ListenAddress:
    """A TCP endpoint. ``host`` holds an IPv6 address without brackets."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def parse_listen_address(value: str, default_port: int | None = None) -> ListenAddress:
    """``host:port`` or ``[v6]:port`` (port may be left out only if ``default_port`` is given).

    Port 0 is allowed: the OS picks a free port, which tests rely on.

    Raises:
        ConfigError: malformed host or port.
    """
    host, sep, port_text = value, "", ""
    if value.startswith("["):
        close = value.find("]")
        if close < 0:
            raise ConfigError(f"unclosed '[' in address {value!r}")
        host, rest = value[1:close], value[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"expected ':PORT' after ']' in {value!r}")
            sep, port_text = ":", rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{host!r} in {value!r} is not an IPv6 address") from None
    else:
        if value.count(":") > 1:
            raise ConfigError(f"IPv6 addresses need brackets, as in '[::1]:2525'; got {value!r}")
        host, sep, port_text = value.partition(":")
        if not _HOSTNAME_RE.fullmatch(host):
            raise ConfigError(f"bad host {host!r} in address {value!r}")
    if not sep:
        if default_port is None:
            raise ConfigError(f"expected HOST:PORT, got {value!r}")
        return ListenAddress(host, default_port)
    if not port_text.isdigit() or not port_text.isascii() or int(port_text) > 65535:
        raise ConfigError(f"bad port {port_text!r} in address {value!r} (0-65535)")
    return ListenAddress(host, int(port_text))


# --------------------------------------------------------------------------- routes


class TlsMode(enum.Enum):
    """How an ``smtp://`` route uses STARTTLS towards the next hop."""

    NONE = "none"  # never; for a next hop on the same host
    OPPORTUNISTIC = "opportunistic"  # if offered, without checking the certificate (the default)
    REQUIRE = "require"  # always, without checking the certificate; fail if not offered
    VERIFY = "verify"  # always, and the certificate must be valid for the host


@attrs.frozen
class MxRoute:
    """Deliver by MX lookup of the recipient domain (A/AAAA fallback, RFC 5321 §5)."""


@attrs.frozen
class SmtpRoute:
    """Deliver to one fixed next hop (smarthost or static route), MX ignored."""

    host: str
    port: int = 25
    tls: TlsMode = TlsMode.OPPORTUNISTIC


@attrs.frozen
class MaildirRoute:
    """Deliver locally: ``path/<localpart>/`` is each recipient's Maildir."""

    path: str


@attrs.frozen
class DiscardRoute:
    """Accept and drop: for benchmarks and sinks. Counted as delivered."""


Route = MxRoute | SmtpRoute | MaildirRoute | DiscardRoute


@attrs.frozen
class NoRoute:
    """No route matches the domain: a value, not an exception, so the relay can answer per recipient."""

    domain: str
    code: int = 550
    status: str = "5.1.2"

    @property
    def text(self) -> str:
        return f"{self.status} no route to domain {self.domain}"


def _resolve_path(path: str, base_dir: str | None) -> str:
    if "\0" in path:
        raise ConfigError("a path cannot contain a NUL character")
    return os.path.normpath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(path)))


def parse_route(value: str, base_dir: str | None = None) -> Route:
    """``"mx"``, ``"discard"``, ``"maildir:PATH"`` or ``"smtp://HOST[:PORT][?tls=MODE]"``.

    Raises:
        ConfigError: anything else.
    """
    if value == "mx":
        return MxRoute()
    if value == "discard":
        return DiscardRoute()
    if value.startswith("maildir:"):
        path = value.removeprefix("maildir:")
        if not path:
            raise ConfigError("'maildir:' needs a directory, as in 'maildir:var/maildir'")
        return MaildirRoute(_resolve_path(path, base_dir))
    if value.startswith("smtp://"):
        return _parse_smtp_route(value)
    raise ConfigError(f"expected 'mx', 'discard', 'maildir:PATH' or 'smtp://HOST:PORT', got {value!r}")


def _parse_smtp_route(value: str) -> SmtpRoute:
    rest = value.removeprefix("smtp://")
    netloc, _, query = rest.partition("?")
    if netloc.endswith("/"):
        netloc = netloc[:-1]
    if not netloc or "/" in netloc or "@" in netloc or "#" in netloc:
        raise ConfigError(f"expected 'smtp://HOST[:PORT][?tls=MODE]', got {value!r}")
    address = parse_listen_address(netloc, default_port=25)
    tls = TlsMode.OPPORTUNISTIC
    try:
        params = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"bad query {query!r} in {value!r}") from None
    for name, values in params.items():
        if name != "tls":
            raise ConfigError(f"unknown parameter {name!r} in {value!r}; only 'tls' is known")
        modes = [mode.value for mode in TlsMode]
        if len(values) != 1 or values[0] not in modes:
            raise ConfigError(f"tls must be one of {', '.join(modes)} in {value!r}")
        tls = TlsMode(values[0])
    return SmtpRoute(address.host, address.port, tls)


# "*" is refused inside a name: "*.example.com" looks like a wildcard but would
# match nothing; ".example.com" is how subdomains are written.
_DOMAIN_RE = re.compile(r"\.?(?:[^\s.@/\\\[\]\"<>,;:*]+\.)*[^\s.@/\\\[\]\"<>,;:*]+")


def _normalize_domain(domain: str) -> str:
    return domain.strip().rstrip(".").lower()


def _check_domain(value: str) -> str:
    domain = _normalize_domain(value) if value != "." else value
    if not _DOMAIN_RE.fullmatch(domain) or len(domain) > 254:
        raise ConfigError(f"{value!r} is not a domain (use '.example.com' for all subdomains)")
    return domain


def _domain_candidates(domain: str) -> Iterable[str]:
    """``a.b.c`` → ``a.b.c``, ``.b.c``, ``.c``: exact first, then ever wider parents."""
    yield domain
    labels = domain.split(".")
    for i in range(1, len(labels)):
        yield "." + ".".join(labels[i:])


def _match_domain(domain: str, entries: Mapping[str, Any]) -> Any:
    for candidate in _domain_candidates(_normalize_domain(domain)):
        if candidate in entries:
            return entries[candidate]
    return None


# --------------------------------------------------------------------------- records


@attrs.frozen
class ServerConfig:
    """``[server]``: the listening side.

    Defaults: listen ``["127.0.0.1:2525"]``; hostname ``socket.getfqdn()``
    (or ``"localhost"``); max_message_size ``10MB``; max_recipients 1000;
    max_errors 10 (bad commands before the session is dropped);
    line_length_limit 1000 (RFC 5321's minimum, CRLF included);
    normalize_bare_lf false (reject bare LF, the SMTP-smuggling defence);
    tls_cert/tls_key none (no STARTTLS); control_socket
    ``<spool.dir>/control.sock``; metrics_listen none (no metrics endpoint);
    processes 1 (relay processes, each owning a spool shard; ``"auto"`` is
    ``os.cpu_count()``, resolved when the config is loaded; see ``mta.process.shards``).

    Denial of service (docs/security.md, "Denial of service", has the
    reasoning and Postfix's equivalents): max_sessions 100;
    reserved_sessions a tenth of max_sessions (slots only ``mynetworks``
    clients may take); max_sessions_per_client 20 and
    max_sessions_per_network 50 (sessions from one address, and from one
    /network_prefix_ipv4 = /24 or /network_prefix_ipv6 = /64; ``mynetworks``
    clients are exempt from both, as from Postfix's anvil limits);
    command_timeout ``5m`` (for a whole command line, from when the relay
    starts waiting for it, not per read); data_timeout ``10m`` and
    min_data_rate 1000 bytes/s (the DATA phase starts with data_timeout to
    spend; every byte received buys 1/min_data_rate s more, never more than
    data_timeout ahead); session_time_limit ``1h`` (no new command after it);
    metrics_max_connections 8 and metrics_timeout ``10s`` (the metrics
    endpoint's concurrent requests and per-request deadline).
    """

    listen: tuple[ListenAddress, ...]
    hostname: str
    max_message_size: int = 10 << 20
    max_recipients: int = 1000
    max_sessions: int = 100
    max_sessions_per_client: int = 20
    max_errors: int = 10
    line_length_limit: int = 1000
    normalize_bare_lf: bool = False
    command_timeout: float = 300.0
    data_timeout: float = 600.0
    tls_cert: str | None = None
    tls_key: str | None = None
    control_socket: str = ""
    metrics_listen: ListenAddress | None = None
    processes: int = 1
    reserved_sessions: int = 10
    max_sessions_per_network: int = 50
    network_prefix_ipv4: int = 24
    network_prefix_ipv6: int = 64
    min_data_rate: int = 1000
    session_time_limit: float = 3600.0
    metrics_max_connections: int = 8
    metrics_timeout: float = 10.0


DEFAULT_RETRY_INTERVALS = (60.0, 300.0, 900.0, 1800.0, 3600.0)


@attrs.frozen
class SpoolConfig:
    """``[spool]``: where the log lives and how long mail may stay.

    Defaults: dir ``var/spool``; archive_dir none (garbage segments are
    deleted); segment_size ``64MB``; retry_intervals 1m, 5m, 15m, 30m, 60m
    (one deferred runner per interval); max_queue_lifetime ``5d`` (then
    bounce); active_limit 10000 (messages in delivery at once);
    queue_minfree 3 x max_message_size (below it, answer 452).

    The engine's pacing (``spool.config.SpoolConfig`` explains each):
    commit_delay ``100ms`` (group-commit window bound; 0: commit at once);
    checkpoint_interval ``2s``, checkpoint_bytes ``16MB`` (0: a checkpoint
    every interval), checkpoint_max_interval ``60s``; deferred_share 0.2
    (retries' share of the claims while new mail flows; 1: no budget).
    """

    dir: str
    archive_dir: str | None = None
    segment_size: int = 64 << 20
    retry_intervals: tuple[float, ...] = DEFAULT_RETRY_INTERVALS
    max_queue_lifetime: float = 5 * 86400.0
    active_limit: int = 10000
    queue_minfree: int = 30 << 20
    commit_delay: float = 0.1
    checkpoint_interval: float = 2.0
    checkpoint_bytes: int = 16 << 20
    checkpoint_max_interval: float = 60.0
    deferred_share: float = 0.2


_ALL_V4 = ipaddress.IPv4Network("0.0.0.0/0")
_ALL_V6 = ipaddress.IPv6Network("::/0")


@attrs.frozen
class RelayConfig:
    """``[relay]``: who may relay, and who the postmaster is.

    Defaults: mynetworks ``127.0.0.0/8`` and ``::1/128``; no relay_domains;
    postmaster ``postmaster@<hostname>``; postmaster_maildir ``var/maildir``.
    relay_domains entries match exactly, or all subdomains when written ``.example.com``.
    IPv4-mapped IPv6 networks (``::ffff:10.0.0.0/104``) are kept as the IPv4
    networks they mean, as clients' mapped addresses are (``Config.in_mynetworks``).

    allow_open_relay (default false): mynetworks that together cover every
    IPv4 or every IPv6 address (``0.0.0.0/0``, ``::/0``, ``::ffff:0:0/96``,
    two halves ...) make an open relay, and are refused unless this is true.

    ``postmaster`` is where mail to ``<postmaster>`` and ``<postmaster@HOSTNAME>``
    goes (RFC 5321 §4.5.1: accepted from anyone); it is routed like any other
    address, except that when no route is named for its domain and that
    domain is the relay's own hostname it is delivered into the Maildir
    ``postmaster_maildir/<local part>/`` (never by a ``"*"`` route, which
    would send it back to this relay).
    """

    mynetworks: tuple[IPNetwork, ...]
    relay_domains: tuple[str, ...] = ()
    allow_open_relay: bool = False

    def open_to_all(self) -> bool:
        """Whether mynetworks, taken together, hold every IPv4 address or every IPv6 address."""
        v4 = [n for n in self.mynetworks if isinstance(n, ipaddress.IPv4Network)]
        v6 = [n for n in self.mynetworks if isinstance(n, ipaddress.IPv6Network)]
        return _ALL_V4 in ipaddress.collapse_addresses(v4) or _ALL_V6 in ipaddress.collapse_addresses(v6)
    postmaster: str = ""
    postmaster_maildir: str = ""


@attrs.frozen
class DeliveryConfig:
    """``[delivery]``: the outgoing side.

    Defaults: concurrency 100 (delivery tasks in all); per_destination 20;
    connect_timeout ``30s``; command_timeout ``5m`` and data_timeout ``10m``
    (RFC 5321 §4.5.3.2's client timeouts); max_messages_per_connection 100
    (connection reuse); connection_cache_time ``2s`` (how long an idle
    connection to a next hop is kept for the next message; 0: never, as
    Postfix's smtp_connection_cache_time_limit); resolver none (system resolver; ``host[:port]``,
    port 53 by default); mx_port 25 (the port of hosts found by MX lookup;
    for tests and unusual setups); bounce_sender ``MAILER-DAEMON@<hostname>``
    (the From: of DSNs, whose envelope sender is always null); delay_warning
    none (no delay notices; else a duration after arrival).
    """

    bounce_sender: str
    concurrency: int = 100
    per_destination: int = 20
    connect_timeout: float = 30.0
    command_timeout: float = 300.0
    data_timeout: float = 600.0
    max_messages_per_connection: int = 100
    connection_cache_time: float = 2.0
    resolver: ListenAddress | None = None
    mx_port: int = 25
    delay_warning: float | None = None
    tls_ca_file: str | None = None


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


@attrs.frozen
class LogConfig:
    """``[log]``: level (debug|info|warning|error|critical, default info); format (text|json, default text)."""

    level: str = "info"
    format: str = "text"


def _frozen_routes(routes: Mapping[str, Route]) -> Mapping[str, Route]:
    return types.MappingProxyType(dict(routes))


@attrs.frozen
class Config:
    """The whole, validated config. ``source`` is the file it came from, or ``<defaults>``."""

    server: ServerConfig
    spool: SpoolConfig
    relay: RelayConfig
    delivery: DeliveryConfig
    log: LogConfig
    routes: Mapping[str, Route] = attrs.field(converter=_frozen_routes, hash=False)
    source: str = DEFAULTS_SOURCE

    def route_for(self, domain: str) -> Route | NoRoute:
        """The route for a recipient domain: exact key, then ``.parent`` keys, then ``"*"``."""
        route: Route | None = _match_domain(domain, self.routes)
        if route is None:
            route = self.routes.get("*")
        return route if route is not None else NoRoute(_normalize_domain(domain))

    def postmaster_alias(self, address: str) -> str | None:
        """The configured postmaster if ``address`` is ``postmaster`` or ``postmaster@HOSTNAME``, else None.

        The local part is matched without regard to case (RFC 5321 §4.5.1), so is the host name.
        """
        local, at, domain = address.rpartition("@")
        if not at:
            local, domain = address, ""
        if local.lower() != "postmaster":
            return None
        if domain and _normalize_domain(domain) != _normalize_domain(self.server.hostname):
            return None
        return self.relay.postmaster

    def route_for_recipient(self, address: str) -> Route | NoRoute:
        """How one recipient is delivered: the route for its domain (``route_for``), but see ``postmaster``.

        The postmaster address at the relay's own hostname, with no route
        named for that domain, goes into ``postmaster_maildir``.
        """
        domain = address.rpartition("@")[2]
        if address.lower() == self.relay.postmaster.lower() and _match_domain(domain, self.routes) is None \
                and _normalize_domain(domain) == _normalize_domain(self.server.hostname):
            return MaildirRoute(self.relay.postmaster_maildir)
        return self.route_for(domain)

    def is_local(self, domain: str) -> bool:
        """Whether a route *named for this domain* delivers to a Maildir.

        A ``"*"`` maildir route does not count: it would make every domain on
        earth local and so let anyone inject mail (see ``may_relay``).
        """
        return isinstance(_match_domain(domain, self.routes), MaildirRoute)

    def may_relay(self, client_ip: str | IPAddress, domain: str) -> bool:
        """Accept a recipient at ``domain`` from ``client_ip``? Never an open relay.

        Yes if the client is in mynetworks, or the domain is local, or it is in
        relay_domains. Routes never open the relay: a ``"*"`` route does not.
        An unparsable client address (say, a Unix socket peer) is not in
        mynetworks.
        """
        return self.in_mynetworks(client_ip) or self.is_local(domain) or self.is_relay_domain(domain)

    def in_mynetworks(self, client_ip: str | IPAddress) -> bool:
        try:
            address = ipaddress.ip_address(client_ip)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket reports v4 clients as ::ffff:a.b.c.d
        return any(address in network for network in self.relay.mynetworks)

    def is_relay_domain(self, domain: str) -> bool:
        return _match_domain(domain, dict.fromkeys(self.relay.relay_domains, True)) is not None


# --------------------------------------------------------------------------- loading


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


def load_config(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Find, read and validate the config (see ``find_config_file``); no file gives the defaults.

    Raises:
        ConfigError: unreadable file, TOML syntax error, or a bad value.
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
    return parse_config(text, file)


def parse_config(text: str, source: str = "<string>", base_dir: str | None = None) -> Config:
    """Validate TOML text. Relative paths resolve against ``base_dir`` (default: the current directory).

    Raises:
        ConfigError: TOML syntax error, unknown key, or a bad value; the message names ``source`` and the key.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"TOML syntax error: {e}", source) from None
    try:
        return _build(data, source, base_dir)
    except ConfigError as e:
        if e.file:
            raise
        raise ConfigError(e.problem, source, e.key) from None


T = TypeVar("T")


def _key_name(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Table:
    """One TOML table being read: typed getters that name the dotted key on error, and a check for leftovers."""

    def __init__(self, data: Mapping[str, Any], prefix: str) -> None:
        self.data = data
        self.prefix = prefix
        self.known: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{_key_name(name)}" if self.prefix else _key_name(name)

    def get(self, name: str, default: T, convert: Callable[[Any], T]) -> T:
        self.known.add(name)
        if name not in self.data:
            return default
        try:
            return convert(self.data[name])
        except ConfigError as e:
            raise ConfigError(e.problem, key=e.key or self.key(name)) from None

    def table(self, name: str) -> _Table:
        value: dict[str, Any] = self.get(name, {}, _expect(dict, "a table"))
        return _Table(value, self.key(name))

    def list_of(self, name: str, default: tuple[T, ...], convert: Callable[[Any], T]) -> tuple[T, ...]:
        self.known.add(name)
        if name not in self.data:
            return default
        items = self.data[name]
        if not isinstance(items, list):
            raise ConfigError(f"expected a list, got {_type_name(items)}", key=self.key(name))
        result = []
        for i, item in enumerate(items):
            try:
                result.append(convert(item))
            except ConfigError as e:
                raise ConfigError(e.problem, key=f"{self.key(name)}[{i}]") from None
        return tuple(result)

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.known)
        if unknown:
            hint = difflib.get_close_matches(unknown[0], sorted(self.known), n=1)
            problem = "unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
            raise ConfigError(problem, key=self.key(unknown[0]))


def _type_name(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list", dict: "a table"}
    return names.get(type(value), type(value).__name__)


def _expect(kind: type[T], description: str) -> Callable[[Any], T]:
    def convert(value: Any) -> T:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"expected {description}, got {_type_name(value)} {value!r}")
        return value

    return convert


def _int(low: int, high: int = 1 << 62) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        number = _expect(int, "an integer")(value)
        if not low <= number <= high:
            raise ConfigError(f"must be between {low} and {high}, got {number}")
        return number

    return convert


def _str(value: Any) -> str:
    text = _expect(str, "a string")(value)
    if "\0" in text:
        raise ConfigError("must not contain a NUL character")
    return text


def _positive(convert: Callable[[Any], T]) -> Callable[[Any], T]:
    def check(value: Any) -> T:
        result = convert(value)
        if not result:
            raise ConfigError(f"must be greater than zero, got {value!r}")
        return result

    return check


def _at_most(high: float, convert: Callable[[Any], float]) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        result = convert(value)
        if result > high:
            raise ConfigError(f"must be at most {high:g} s, got {value!r}")
        return result

    return check


def _size_between(low: int, high: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        size = parse_size(value)
        if not low <= size <= high:
            raise ConfigError(f"must be between {_human_size(low)} and {_human_size(high)}, got {value!r}")
        return size

    return check


def _human_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"expected a number between 0 and 1, got {_type_name(value)} {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"must be between 0 and 1, got {value!r}")
    return float(value)


def _optional(convert: Callable[[Any], T]) -> Callable[[Any], T | None]:
    """The config spells "not set" as an empty string, as the operator's template does."""

    def check(value: Any) -> T | None:
        return None if value == "" else convert(value)

    return check


MAX_PROCESSES = 256


def _processes(value: Any) -> int:
    """An integer >= 1, or ``"auto"``: one per CPU, as this machine counts them when the config is loaded."""
    if value == "auto":
        return max(1, min(os.cpu_count() or 1, MAX_PROCESSES))
    if isinstance(value, str):
        raise ConfigError(f"expected an integer or 'auto', got {value!r}")
    return _int(1, MAX_PROCESSES)(value)


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        text = _str(value)
        if text.lower() not in choices:
            raise ConfigError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text.lower()

    return convert


def _hostname(value: Any) -> str:
    text = _str(value)
    if not _HOSTNAME_RE.fullmatch(text) or ".." in text or len(text) > 253:
        raise ConfigError(f"{text!r} is not a host name")
    return text


def _address(value: Any) -> str:
    text = _str(value)
    local, at, domain = text.rpartition("@")
    if not at or not local or not domain or any(c.isspace() or c in "<>\0" for c in text):
        raise ConfigError(f"expected an address like 'MAILER-DAEMON@relay.example', got {text!r}")
    return text


_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
def _mailbox(value: Any) -> str:
    text = _str(value)
    if not parse_mailbox(text):
        raise ConfigError(f"expected a mailbox like 'hostmaster@example.com', got {text!r}")
    return text


def _network(value: Any) -> IPNetwork:
    text = _str(value)
    try:
        network = ipaddress.ip_network(text.strip())
    except ValueError as e:
        raise ConfigError(f"not an IP network: {e}") from None
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_MAPPED):
        mapped = network.network_address.ipv4_mapped
        assert mapped is not None
        return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
    return network


def _readable_file(base_dir: str | None) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        path = _resolve_path(_str(value), base_dir)
        if not os.path.isfile(path):
            raise ConfigError(f"no such file: {path}")
        return path

    return convert


@functools.cache
def _default_hostname() -> str:
    """Cached: getfqdn() may wait on DNS, and the answer does not change while we run."""
    name = socket.getfqdn()
    return name if name and _HOSTNAME_RE.fullmatch(name) else "localhost"


def _build(data: Mapping[str, Any], source: str, base_dir: str | None) -> Config:
    root = _Table(data, "")
    server = _build_server(root.table("server"), base_dir)
    spool = _build_spool(root.table("spool"), base_dir, server.max_message_size)
    if not server.control_socket:
        server = attrs.evolve(server, control_socket=os.path.join(spool.dir, "control.sock"))
    relay = _build_relay(root.table("relay"), server.hostname, base_dir)
    delivery = _build_delivery(root.table("delivery"), server.hostname, base_dir)
    routes = _build_routes(root, base_dir)
    log = _build_log(root.table("log"))
    root.finish()
    config = Config(server, spool, relay, delivery, log, routes, source)
    if isinstance(config.route_for_recipient(relay.postmaster), NoRoute):
        raise ConfigError(f"no route delivers {relay.postmaster!r}: add a route for its domain",
                          key="relay.postmaster")
    return config


def _build_server(t: _Table, base_dir: str | None) -> ServerConfig:
    listen = t.list_of("listen", (ListenAddress("127.0.0.1", 2525),), lambda v: parse_listen_address(_str(v)))
    if not listen:
        raise ConfigError("at least one address is needed", key=t.key("listen"))
    hostname = t.get("hostname", None, _optional(_hostname)) or _default_hostname()
    tls_cert = t.get("tls_cert", None, _optional(_readable_file(base_dir)))
    tls_key = t.get("tls_key", None, _optional(_readable_file(base_dir)))
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("tls_cert and tls_key must be set together", key=t.key("tls_key" if tls_cert else "tls_cert"))
    server = ServerConfig(
        listen=listen,
        hostname=hostname,
        max_message_size=t.get("max_message_size", 10 << 20, _positive(parse_size)),
        max_recipients=t.get("max_recipients", 1000, _int(1)),
        max_sessions=t.get("max_sessions", 100, _int(1)),
        max_sessions_per_client=t.get("max_sessions_per_client", 20, _int(1)),
        max_errors=t.get("max_errors", 10, _int(1)),
        line_length_limit=t.get("line_length_limit", 1000, _int(1000, 1 << 20)),
        normalize_bare_lf=t.get("normalize_bare_lf", False, _expect(bool, "true or false")),
        command_timeout=t.get("command_timeout", 300.0, _positive(parse_duration)),
        data_timeout=t.get("data_timeout", 600.0, _positive(parse_duration)),
        tls_cert=tls_cert,
        tls_key=tls_key,
        control_socket=t.get("control_socket", None, _optional(lambda v: _resolve_path(_str(v), base_dir))) or "",
        metrics_listen=t.get("metrics_listen", None, _optional(lambda v: parse_listen_address(_str(v)))),
        processes=t.get("processes", 1, _processes),
        max_sessions_per_network=t.get("max_sessions_per_network", 50, _int(1)),
        network_prefix_ipv4=t.get("network_prefix_ipv4", 24, _int(8, 32)),
        network_prefix_ipv6=t.get("network_prefix_ipv6", 64, _int(16, 128)),
        min_data_rate=t.get("min_data_rate", 1000, _positive(parse_size)),
        session_time_limit=t.get("session_time_limit", 3600.0, _positive(parse_duration)),
        metrics_max_connections=t.get("metrics_max_connections", 8, _int(1, 1024)),
        metrics_timeout=t.get("metrics_timeout", 10.0, _positive(parse_duration)),
    )
    reserved = t.get("reserved_sessions", None, _int(0))
    if reserved is None:
        reserved = server.max_sessions // 10
    elif reserved >= server.max_sessions:
        raise ConfigError(f"must be less than max_sessions ({server.max_sessions}), or clients outside mynetworks "
                          f"could never connect; got {reserved}", key=t.key("reserved_sessions"))
    t.finish()
    return attrs.evolve(server, reserved_sessions=reserved)


def _build_spool(t: _Table, base_dir: str | None, max_message_size: int) -> SpoolConfig:
    def path(value: Any) -> str:
        text = _str(value)
        if not text:
            raise ConfigError("must not be empty")
        return _resolve_path(text, base_dir)

    intervals = t.list_of("retry_intervals", DEFAULT_RETRY_INTERVALS, _positive(parse_duration))
    if not intervals:
        raise ConfigError("at least one retry interval is needed", key=t.key("retry_intervals"))
    minfree = t.get("queue_minfree", None, _optional(parse_size))
    spool = SpoolConfig(
        dir=t.get("dir", _resolve_path("var/spool", base_dir), path),
        archive_dir=t.get("archive_dir", None, _optional(path)),
        segment_size=t.get("segment_size", 64 << 20, _size_between(MIN_SEGMENT_SIZE, MAX_SEGMENT_SIZE)),
        retry_intervals=intervals,
        max_queue_lifetime=t.get("max_queue_lifetime", 5 * 86400.0, _positive(parse_duration)),
        active_limit=t.get("active_limit", 10000, _int(1)),
        queue_minfree=3 * max_message_size if minfree is None else minfree,
        commit_delay=t.get("commit_delay", 0.1, _at_most(1.0, parse_duration)),
        checkpoint_interval=t.get("checkpoint_interval", 2.0, _positive(parse_duration)),
        checkpoint_bytes=t.get("checkpoint_bytes", 16 << 20, parse_size),
        checkpoint_max_interval=t.get("checkpoint_max_interval", 60.0, _positive(parse_duration)),
        deferred_share=t.get("deferred_share", 0.2, _fraction),
    )
    t.finish()
    return spool


def _build_relay(t: _Table, hostname: str, base_dir: str | None) -> RelayConfig:
    default = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
    relay = RelayConfig(
        mynetworks=t.list_of("mynetworks", default, _network),
        relay_domains=t.list_of("relay_domains", (), lambda v: _check_domain(_str(v))),
        allow_open_relay=t.get("allow_open_relay", False, _expect(bool, "true or false")),
        postmaster=t.get("postmaster", f"postmaster@{hostname}", _mailbox),
        postmaster_maildir=t.get("postmaster_maildir", _resolve_path("var/maildir", base_dir),
                                 lambda v: _resolve_path(_str(v), base_dir)),
    )
    t.finish()
    if relay.open_to_all() and not relay.allow_open_relay:
        raise ConfigError("covers every address, which makes an open relay (anyone may send anywhere); "
                          "set [relay] allow_open_relay = true if that is really meant", key=t.key("mynetworks"))
    return relay


def _build_delivery(t: _Table, hostname: str, base_dir: str | None) -> DeliveryConfig:
    delivery = DeliveryConfig(
        concurrency=t.get("concurrency", 100, _int(1)),
        per_destination=t.get("per_destination", 20, _int(1)),
        connect_timeout=t.get("connect_timeout", 30.0, _positive(parse_duration)),
        command_timeout=t.get("command_timeout", 300.0, _positive(parse_duration)),
        data_timeout=t.get("data_timeout", 600.0, _positive(parse_duration)),
        max_messages_per_connection=t.get("max_messages_per_connection", 100, _int(1)),
        connection_cache_time=t.get("connection_cache_time", 2.0, _at_most(300.0, parse_duration)),
        resolver=t.get("resolver", None, _optional(lambda v: parse_listen_address(_str(v), default_port=53))),
        mx_port=t.get("mx_port", 25, _int(1, 65535)),
        bounce_sender=t.get("bounce_sender", None, _optional(_address)) or f"MAILER-DAEMON@{hostname}",
        delay_warning=t.get("delay_warning", None, _optional(_positive(parse_duration))),
        tls_ca_file=t.get("tls_ca_file", None, _optional(_readable_file(base_dir))),
    )
    t.finish()
    return delivery


DEFAULT_ROUTES = {"localhost": "maildir:var/maildir", "*": "mx"}


def _build_routes(root: _Table, base_dir: str | None) -> dict[str, Route]:
    if "routes" not in root.data:
        root.known.add("routes")
        return {domain: parse_route(value, base_dir) for domain, value in DEFAULT_ROUTES.items()}
    table = root.table("routes")
    routes: dict[str, Route] = {}
    for name in table.data:
        try:
            domain = "*" if name == "*" else _check_domain(name)
        except ConfigError as e:
            raise ConfigError(e.problem, key=table.key(name)) from None
        if domain in routes:
            raise ConfigError(f"names the same domain as another key ({domain!r})", key=table.key(name))
        default: Route = MxRoute()  # never used: the key is present
        routes[domain] = table.get(name, default, lambda v: parse_route(_str(v), base_dir))
    return routes


def _build_log(t: _Table) -> LogConfig:
    log = LogConfig(
        level=t.get("level", "info", _one_of(LOG_LEVELS)),
        format=t.get("format", "text", _one_of(LOG_FORMATS)),
    )
    t.finish()
    return log
