"""The kinds of value only the relay's settings take: addresses, host names, mailboxes, networks, files.

Each is a ``spool.config.settings.Kind``: it reads a TOML value, checks a typed one,
writes one back for ``mta config show`` and describes itself for the docs.
The grammars of durations and sizes are ``spool.config.units``, shared with the engine.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket

import attrs

from mta.smtp.addresses import parse_mailbox
from spool import ConfigError, Integer, Kind, TomlValue, expect, resolve_path

__all__ = [
    "Address",
    "Hostname",
    "IPAddress",
    "IPNetwork",
    "Listen",
    "ListenAddress",
    "Mailbox",
    "Network",
    "Processes",
    "ReadableFile",
    "default_hostname",
    "parse_listen_address",
    "text_of",
    "usable_cpus",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

HOSTNAME_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def text_of(raw: object) -> str:
    """A TOML string without NUL, or ConfigError."""
    text = expect(raw, str, "a string")
    if "\0" in text:
        raise ConfigError("must not contain a NUL character")
    return text


@attrs.frozen
class ListenAddress:
    """A TCP endpoint. ``host`` holds an IPv6 address without brackets."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


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
        if not HOSTNAME_RE.fullmatch(host):
            raise ConfigError(f"bad host {host!r} in address {value!r}")
    if not sep:
        if default_port is None:
            raise ConfigError(f"expected HOST:PORT, got {value!r}")
        return ListenAddress(host, default_port)
    if not port_text.isdigit() or not port_text.isascii() or int(port_text) > 65535:
        raise ConfigError(f"bad port {port_text!r} in address {value!r} (0-65535)")
    return ListenAddress(host, int(port_text))


@attrs.frozen
class Listen(Kind[ListenAddress]):
    """``host:port`` or ``[v6]:port``; with ``default_port`` the port may be left out."""

    default_port: int | None = None

    def what(self) -> str:
        return "host:port" if self.default_port is None else f"host[:port] (port {self.default_port})"

    def convert(self, raw: object, base_dir: str | None) -> ListenAddress:
        return parse_listen_address(text_of(raw), self.default_port)

    def write(self, value: ListenAddress) -> TomlValue:
        return str(value)


@functools.cache
def default_hostname() -> str:
    """``socket.getfqdn()``, or ``localhost`` if that is no fully qualified host name (the relay warns at start).

    Cached: it may wait on DNS.
    """
    name = socket.getfqdn()
    return name if name and HOSTNAME_RE.fullmatch(name) and "." in name.strip(".") else "localhost"


@attrs.frozen
class Hostname(Kind[str]):
    def what(self) -> str:
        return "host name"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return text_of(raw)

    def check(self, value: str) -> None:
        if not HOSTNAME_RE.fullmatch(value) or ".." in value or len(value) > 253:
            raise ConfigError(f"{value!r} is not a host name")


@attrs.frozen
class Mailbox(Kind[str]):
    """An RFC 5321 mailbox, as the SMTP server would accept it in RCPT TO."""

    def what(self) -> str:
        return "mailbox"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return text_of(raw)

    def check(self, value: str) -> None:
        if not parse_mailbox(value):
            raise ConfigError(f"expected a mailbox like 'hostmaster@example.com', got {value!r}")


@attrs.frozen
class Address(Kind[str]):
    """``local@domain``, looser than a mailbox: what a DSN's From: header may carry."""

    def what(self) -> str:
        return "address"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return text_of(raw)

    def check(self, value: str) -> None:
        local, at, domain = value.rpartition("@")
        if not at or not local or not domain or any(c.isspace() or c in "<>\0" for c in value):
            raise ConfigError(f"expected an address like 'MAILER-DAEMON@relay.example', got {value!r}")


_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


@attrs.frozen
class Network(Kind[IPNetwork]):
    """An IP network; an IPv4-mapped IPv6 one (``::ffff:10.0.0.0/104``) is kept as the IPv4 network it means."""

    def what(self) -> str:
        return "IP network"

    def convert(self, raw: object, base_dir: str | None) -> IPNetwork:
        text = text_of(raw)
        try:
            network = ipaddress.ip_network(text.strip())
        except ValueError as e:
            raise ConfigError(f"not an IP network: {e}") from None
        if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_MAPPED):
            mapped = network.network_address.ipv4_mapped
            assert mapped is not None
            return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
        return network

    def write(self, value: IPNetwork) -> TomlValue:
        return str(value)


@attrs.frozen
class ReadableFile(Kind[str]):
    """A file that exists when the config is read, made absolute."""

    def what(self) -> str:
        return "path of a file"

    def convert(self, raw: object, base_dir: str | None) -> str:
        path = resolve_path(text_of(raw), base_dir)
        if not os.path.isfile(path):
            raise ConfigError(f"no such file: {path}")
        return path


MAX_PROCESSES = 256


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), which is what "auto" counts.

    Why not ``os.cpu_count()``: that is the host's, and a relay in a container
    or a cpuset (``taskset``, systemd's ``CPUAffinity=``) given 2 of 64 CPUs
    would start 64 processes to share 2 of them.
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call here (not Linux)
        return max(1, os.cpu_count() or 1)


@attrs.frozen
class Processes(Kind[int]):
    """An integer, or ``"auto"``: one per CPU this process may run on, counted when the config is read."""

    def what(self) -> str:
        return f'integer 1–{MAX_PROCESSES}, or "auto" (one per CPU this process may run on)'

    def convert(self, raw: object, base_dir: str | None) -> int:
        if raw == "auto":
            return max(1, min(usable_cpus(), MAX_PROCESSES))
        if isinstance(raw, str):
            raise ConfigError(f"expected an integer or 'auto', got {raw!r}")
        return expect(raw, int, "an integer")

    def check(self, value: int) -> None:
        Integer(1, MAX_PROCESSES).check(value)
