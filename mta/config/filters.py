"""``[filters]``: the milters and rspamd asked before the final reply (docs/operations.md, "Filters").

Milters are named as Postfix names them (``inet:PORT@HOST``, ``inet:HOST:PORT``
or ``unix:/path``), in the order they are asked; port 25's listeners and the
submission listeners (587, 465) each have their own list, as Postfix's
``smtpd_milters`` can differ per ``master.cf`` service. The time limits and
the failure default hold for every milter; docs/security.md, "Filters", has
what a filter may change and why tempfail is the default.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import attrs

from mta.config.values import text_of
from spool import ConfigError, Derived, Duration, Kind, ListOf, OneOf, Optional, Resolver, TomlValue, setting

__all__ = ["FAILURE_ACTIONS", "FiltersSection", "MilterAddress", "parse_milter_address"]

FAILURE_ACTIONS = ("tempfail", "accept", "reject")
PORTS = ("smtp", "submission")
_HOST = re.compile(r"[A-Za-z0-9.:_-]+")


@attrs.frozen
class MilterAddress:
    """Where one milter listens: a TCP host and port, or a unix socket path (``host`` empty)."""

    host: str
    port: int
    path: str = ""

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.path else f"inet:{self.port}@{self.host}"


def parse_milter_address(text: str) -> MilterAddress:
    """Postfix's spellings: ``inet:PORT@HOST``, ``inet:HOST:PORT``, ``unix:/path`` (``local:`` too)."""
    kind, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ConfigError(f"{text!r} is not a milter address (inet:PORT@HOST, inet:HOST:PORT or unix:/path)")
    if kind in ("unix", "local"):
        if not rest.startswith("/"):
            raise ConfigError(f"{text!r}: a unix socket needs an absolute path")
        return MilterAddress("", 0, rest)
    if kind not in ("inet", "inet6"):
        raise ConfigError(f"{text!r}: the kind must be inet or unix, not {kind!r}")
    if "@" in rest:
        port_text, _, host = rest.partition("@")
    else:
        host, _, port_text = rest.rpartition(":")
    host = host.strip("[]")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{text!r}: the port must be a number 1–65535")
    if not host or not _HOST.fullmatch(host):
        raise ConfigError(f"{text!r}: {host!r} is not a host")
    return MilterAddress(host, int(port_text))


@attrs.frozen
class Milter(Kind[MilterAddress]):
    def what(self) -> str:
        return "milter address: `inet:PORT@HOST`, `inet:HOST:PORT` or `unix:/path`"

    def convert(self, raw: object, base_dir: str | None) -> MilterAddress:
        return parse_milter_address(text_of(raw))

    def write(self, value: MilterAddress) -> TomlValue:
        return str(value)


@attrs.frozen
class HttpUrl(Kind[str]):
    """An ``http://host:port`` base URL (rspamd's normal worker); the path ``/checkv2`` is added."""

    def what(self) -> str:
        return "`http://HOST:PORT` URL"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return text_of(raw).rstrip("/")

    def check(self, value: str) -> None:
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            raise ConfigError(f"{value!r} is not an http:// URL with a host and port") from None
        if parts.scheme != "http" or not parts.hostname or port is None or parts.query or parts.fragment:
            raise ConfigError(f"{value!r} is not an http:// URL with a host and port")


def _same_as_smtp(r: Resolver) -> tuple[MilterAddress, ...]:
    milters: tuple[MilterAddress, ...] = r("filters.smtp_milters")
    return milters


@attrs.frozen(kw_only=True)
class FiltersSection:
    """``[filters]``: milters (protocol 6) and rspamd over HTTP, asked before the reply to the data."""

    smtp_milters: tuple[MilterAddress, ...] = setting(
        ListOf(Milter()), "milters asked, in this order, for mail on `server.listen` (port 25), as Postfix's "
        "`smtpd_milters`", ())
    submission_milters: tuple[MilterAddress, ...] = setting(
        ListOf(Milter()), "milters for mail on the submission listeners (587 and 465)",
        derived=Derived("`smtp_milters`", _same_as_smtp))
    milter_connect_timeout: float = setting(
        Duration(positive=True), "to connect to a milter and negotiate (Postfix's `milter_connect_timeout`)", 30.0)
    milter_command_timeout: float = setting(
        Duration(positive=True), "for a milter's reply to one step; a progress note starts it again (Postfix's "
        "`milter_command_timeout`)", 30.0)
    milter_message_timeout: float = setting(
        Duration(positive=True), "for all of a message's content (headers, body, end of message) to one milter "
        "(Postfix's `milter_content_timeout`)", 300.0)
    milter_default_action: str = setting(
        OneOf(FAILURE_ACTIONS), "when a milter is down, too slow or breaks the protocol: `tempfail` the command "
        "(`451 4.7.1`), `accept` (go on without that milter for the session) or `reject` (`554 5.7.1`)", "tempfail")
    rspamd_url: str | None = setting(
        Optional(HttpUrl()), "rspamd's normal worker, e.g. `http://127.0.0.1:11333`: every message is scanned "
        "through `/checkv2` after the milters; not set, none", None)
    rspamd_ports: tuple[str, ...] = setting(
        ListOf(OneOf(PORTS)), "which listeners' mail rspamd scans: `smtp` (port 25), `submission` (587 and 465)",
        PORTS)
    rspamd_timeout: float = setting(
        Duration(positive=True), "for one whole `/checkv2` exchange (connect, request, answer)", 20.0)
    rspamd_default_action: str = setting(
        OneOf(FAILURE_ACTIONS), "when rspamd cannot be asked or answers nonsense: `tempfail`, `accept` or "
        "`reject` the message", "tempfail")

    def milters_for(self, submission: bool) -> tuple[MilterAddress, ...]:
        return self.submission_milters if submission else self.smtp_milters

    def rspamd_for(self, submission: bool) -> str | None:
        return self.rspamd_url if ("submission" if submission else "smtp") in self.rspamd_ports else None

    @property
    def enabled(self) -> bool:
        return bool(self.smtp_milters or self.submission_milters or self.rspamd_url)
