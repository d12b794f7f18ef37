"""Routes: which transport delivers a recipient domain, and how a route is written.

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

import enum
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from mta.config.values import parse_listen_address, text_of
from spool.settings import ConfigError, Kind, resolve_path

__all__ = [
    "DEFAULT_ROUTES",
    "DiscardRoute",
    "Domain",
    "MaildirRoute",
    "MxRoute",
    "NoRoute",
    "Route",
    "SmtpRoute",
    "TlsMode",
    "check_domain",
    "format_route",
    "match_domain",
    "normalize_domain",
    "parse_route",
]

# What a config without a [routes] table delivers: @localhost into var/maildir, everything else by MX.
DEFAULT_ROUTES = {"localhost": "maildir:var/maildir", "*": "mx"}


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
        return MaildirRoute(resolve_path(path, base_dir))
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


def format_route(route: Route) -> str:
    """What ``parse_route`` reads back as ``route`` (a maildir path is already absolute)."""
    match route:
        case MxRoute():
            return "mx"
        case DiscardRoute():
            return "discard"
        case MaildirRoute(path):
            return f"maildir:{path}"
        case SmtpRoute(host, port, tls):
            where = f"[{host}]" if ":" in host else host
            return f"smtp://{where}:{port}?tls={tls.value}"


# "*" is refused inside a name: "*.example.com" looks like a wildcard but would
# match nothing; ".example.com" is how subdomains are written.
_DOMAIN_RE = re.compile(r"\.?(?:[^\s.@/\\\[\]\"<>,;:*]+\.)*[^\s.@/\\\[\]\"<>,;:*]+")


def normalize_domain(domain: str) -> str:
    return domain.strip().rstrip(".").lower()


def check_domain(value: str) -> str:
    """``value`` normalised, if it is a domain or ``.domain`` (every subdomain). Raises ConfigError."""
    domain = normalize_domain(value) if value != "." else value
    if not _DOMAIN_RE.fullmatch(domain) or len(domain) > 254:
        raise ConfigError(f"{value!r} is not a domain (use '.example.com' for all subdomains)")
    return domain


@attrs.frozen
class Domain(Kind[str]):
    """A domain, or ``.domain`` for every subdomain; kept normalised (lower case, no final dot)."""

    def what(self) -> str:
        return "domain (`.example.com`: every subdomain)"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return check_domain(text_of(raw))

    def check(self, value: str) -> None:
        check_domain(value)


def _domain_candidates(domain: str) -> Iterable[str]:
    """``a.b.c`` → ``a.b.c``, ``.b.c``, ``.c``: exact first, then ever wider parents."""
    yield domain
    labels = domain.split(".")
    for i in range(1, len(labels)):
        yield "." + ".".join(labels[i:])


def match_domain(domain: str, entries: Mapping[str, Any]) -> Any:
    """The entry for ``domain``: its exact key, else the nearest ``.parent`` key, else None."""
    for candidate in _domain_candidates(normalize_domain(domain)):
        if candidate in entries:
            return entries[candidate]
    return None
