"""Routes: which transport delivers a recipient domain, and how a route is written.

Routes map a recipient domain to a transport::

    [routes]
    "localhost" = "maildir:var/maildir"   # local delivery, one Maildir per local part
    "example.com" = "smtp://10.0.0.5:25"  # static next hop (exact domain only)
    ".example.com" = "smtp://[::1]:2526?tls=require"  # any subdomain of example.com
    "bench.test" = "discard"
    "mail.example" = "lmtp://127.0.0.1:24"  # a mailbox server over LMTP (Dovecot), TCP
    "other.example" = "lmtp:/run/dovecot/lmtp"  # ... or its unix socket
    "secure.example" = "mx?tls=dane,mta-sts"  # authenticated TLS where the domain publishes a policy
    "*" = "mx"                             # everything else, by MX lookup

The ``tls`` parameter holds at most one base mode (``none``, ``opportunistic``,
``require``, ``verify``: how STARTTLS is used when no policy applies) and the
policies to look up before delivering: ``dane`` (RFC 7672, TLSA records the
resolver validated) and ``mta-sts`` (RFC 8461, ``mx`` routes only: a fixed
next hop is not the domain's MX). DANE, where it applies, wins over MTA-STS.

An ``lmtp`` route hands mail to a mailbox server (RFC 2033), which answers
for each recipient on its own; it never uses STARTTLS (the server is on this
host or next to it). A domain whose route is ``maildir`` or ``lmtp`` is one
the relay is final for (``Config.is_local``).

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
from spool import ConfigError, Kind, resolve_path

__all__ = [
    "DEFAULT_ROUTES",
    "DiscardRoute",
    "Domain",
    "LmtpRoute",
    "MaildirRoute",
    "MxRoute",
    "NoRoute",
    "Route",
    "SmtpRoute",
    "TlsMode",
    "TlsPolicy",
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


class TlsPolicy(enum.Enum):
    """A published TLS policy a route looks up before it delivers (docs/security.md, "MTA-STS and DANE")."""

    DANE = "dane"  # RFC 7672: DNSSEC-validated TLSA records of the next hop
    MTA_STS = "mta-sts"  # RFC 8461: the recipient domain's policy, fetched over HTTPS


def tls_text(mode: TlsMode, policies: tuple[TlsPolicy, ...]) -> str:
    """How a route's TLS is written: ``dane,mta-sts`` (policies, then the base mode unless it is the default)."""
    words = [p.value for p in policies]
    if mode is not TlsMode.OPPORTUNISTIC or not policies:
        words.append(mode.value)
    return ",".join(words)


def parse_tls(text: str) -> tuple[TlsMode, tuple[TlsPolicy, ...]]:
    """``tls_text`` read back: the base mode and the policies (DANE first). Raises ConfigError."""
    modes = {m.value: m for m in TlsMode}
    policies = {p.value: p for p in TlsPolicy}
    mode: TlsMode | None = None
    chosen: set[TlsPolicy] = set()
    for word in (w.strip() for w in text.split(",")):
        if word in modes:
            if mode is not None:
                raise ConfigError(f"tls names two modes ({mode.value!r} and {word!r}); name at most one")
            mode = modes[word]
        elif word in policies:
            chosen.add(policies[word])
        else:
            known = ", ".join([*modes, *policies])
            raise ConfigError(f"tls must be one of {known} (policies and one mode, comma-separated), got {word!r}")
    if mode is TlsMode.NONE and chosen:
        raise ConfigError("tls=none cannot go with a policy (dane, mta-sts): a policy may require TLS")
    return mode or TlsMode.OPPORTUNISTIC, tuple(p for p in TlsPolicy if p in chosen)


@attrs.frozen
class MxRoute:
    """Deliver by MX lookup of the recipient domain (A/AAAA fallback, RFC 5321 §5)."""

    tls: TlsMode = TlsMode.OPPORTUNISTIC
    policies: tuple[TlsPolicy, ...] = ()


@attrs.frozen
class SmtpRoute:
    """Deliver to one fixed next hop (smarthost or static route), MX ignored."""

    host: str
    port: int = 25
    tls: TlsMode = TlsMode.OPPORTUNISTIC
    policies: tuple[TlsPolicy, ...] = ()  # dane only: MTA-STS names a domain's MX hosts, not a fixed hop


@attrs.frozen
class MaildirRoute:
    """Deliver locally: ``path/<localpart>/`` is each recipient's Maildir."""

    path: str


@attrs.frozen
class DiscardRoute:
    """Accept and drop: for benchmarks and sinks. Counted as delivered."""


@attrs.frozen
class LmtpRoute:
    """Deliver to a mailbox server over LMTP: at ``host:port`` (TCP), or at the unix socket ``socket``."""

    host: str = ""
    port: int = 24
    socket: str = ""  # an absolute path; when set, host and port are unused

    @property
    def target(self) -> str:
        """The next hop as a destination names it: ``host:port``, or the socket's path (which starts with /)."""
        if self.socket:
            return self.socket
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


Route = MxRoute | SmtpRoute | MaildirRoute | DiscardRoute | LmtpRoute


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
    """``"mx[?tls=...]"``, ``"discard"``, ``"maildir:PATH"`` or ``"smtp://HOST[:PORT][?tls=...]"``.

    Raises:
        ConfigError: anything else.
    """
    if value == "mx" or value.startswith("mx?"):
        mode, policies = _tls_param(value.partition("?")[2], value)
        return MxRoute(mode, policies)
    if value == "discard":
        return DiscardRoute()
    if value.startswith("maildir:"):
        path = value.removeprefix("maildir:")
        if not path:
            raise ConfigError("'maildir:' needs a directory, as in 'maildir:var/maildir'")
        return MaildirRoute(resolve_path(path, base_dir))
    if value.startswith("smtp://"):
        return _parse_smtp_route(value)
    if value.startswith("lmtp:"):
        return _parse_lmtp_route(value, base_dir)
    raise ConfigError(f"expected 'mx', 'discard', 'maildir:PATH', 'smtp://HOST:PORT', 'lmtp://HOST:PORT' or "
                      f"'lmtp:SOCKET', got {value!r}")


def _parse_lmtp_route(value: str, base_dir: str | None) -> LmtpRoute:
    """``lmtp://HOST[:PORT]`` (port 24 by default) or ``lmtp:PATH`` (a unix socket). Raises ConfigError."""
    if value.startswith("lmtp://"):
        netloc = value.removeprefix("lmtp://").removesuffix("/")
        if not netloc or any(c in netloc for c in "/@#?"):
            raise ConfigError(f"expected 'lmtp://HOST[:PORT]' or 'lmtp:/PATH/TO/SOCKET', got {value!r}")
        address = parse_listen_address(netloc, default_port=24)
        return LmtpRoute(address.host, address.port)
    path = value.removeprefix("lmtp:")
    if not path or "?" in path:
        raise ConfigError(f"'lmtp:' needs a socket path, as in 'lmtp:/run/dovecot/lmtp', got {value!r}")
    return LmtpRoute(socket=resolve_path(path, base_dir))


def _parse_smtp_route(value: str) -> SmtpRoute:
    rest = value.removeprefix("smtp://")
    netloc, _, query = rest.partition("?")
    netloc = netloc.removesuffix("/")
    if not netloc or "/" in netloc or "@" in netloc or "#" in netloc:
        raise ConfigError(f"expected 'smtp://HOST[:PORT][?tls=MODE]', got {value!r}")
    address = parse_listen_address(netloc, default_port=25)
    tls, policies = _tls_param(query, value)
    if TlsPolicy.MTA_STS in policies:
        raise ConfigError(f"tls=mta-sts is for 'mx' routes (a fixed next hop is not the domain's MX) in {value!r}")
    return SmtpRoute(address.host, address.port, tls, policies)


def _tls_param(query: str, value: str) -> tuple[TlsMode, tuple[TlsPolicy, ...]]:
    """The ``tls`` parameter of a route's query (the only one there is). Raises ConfigError."""
    try:
        params = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"bad query {query!r} in {value!r}") from None
    tls: tuple[TlsMode, tuple[TlsPolicy, ...]] = (TlsMode.OPPORTUNISTIC, ())
    for name, values in params.items():
        if name != "tls":
            raise ConfigError(f"unknown parameter {name!r} in {value!r}; only 'tls' is known")
        if len(values) != 1:
            raise ConfigError(f"tls is given twice in {value!r}")
        try:
            tls = parse_tls(values[0])
        except ConfigError as e:
            raise ConfigError(f"{e.problem} in {value!r}") from None
    return tls


def format_route(route: Route) -> str:
    """What ``parse_route`` reads back as ``route`` (a maildir path is already absolute)."""
    match route:
        case MxRoute(tls, policies):
            return "mx" if tls is TlsMode.OPPORTUNISTIC and not policies else f"mx?tls={tls_text(tls, policies)}"
        case DiscardRoute():
            return "discard"
        case MaildirRoute(path):
            return f"maildir:{path}"
        case LmtpRoute(_, _, socket) if socket:
            return f"lmtp:{socket}"
        case LmtpRoute():
            return f"lmtp://{route.target}"
        case SmtpRoute(host, port, tls, policies):
            where = f"[{host}]" if ":" in host else host
            return f"smtp://{where}:{port}?tls={tls_text(tls, policies)}"


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
