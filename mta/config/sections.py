"""Every setting of the relay, defined once: the sections of the config file as frozen records.

Each field is declared with ``spool.config.settings.setting``: its kind (type,
grammar, limits), its default (or how the default follows from other
settings), and one line of help. The loader, ``mta config show``, ``mta
config check`` and the tables in docs/operations.md are all made from these
definitions; nothing else names a default. ``[spool]`` is the engine's own
``spool.config.engine.SpoolConfig`` (its settings are defined there, where the
engine can see them without the relay) plus where the spool lives and how
much disk the relay keeps free. ``[routes]`` is a table of its own
(``mta.config.routes``).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from typing import Any

import attrs

from mta.config.bounce_classes import BounceClassesSection
from mta.config.client_certs import ClientCertsSection
from mta.config.dkim import DkimSection
from mta.config.egress import EgressSection
from mta.config.events import EventsSection
from mta.config.filters import FiltersSection
from mta.config.http import HttpSection
from mta.config.limits import LimitsSection
from mta.config.policy import PolicySection
from mta.config.proxy import ProxySection
from mta.config.recipients import RecipientsSection
from mta.config.routes import Domain
from mta.config.sendmail import SendmailSection
from mta.config.shaping import ShapingSection
from mta.config.smarthost_auth import SmarthostAuthSection
from mta.config.values import (
    Address,
    Hostname,
    IPNetwork,
    Listen,
    ListenAddress,
    Mailbox,
    Network,
    Processes,
    ReadableFile,
    default_hostname,
    usable_cpus,
)
from mta.smtp.common import DEFAULT_MAX_ERRORS, DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_MAX_RECIPIENTS
from spool import (
    Boolean,
    Derived,
    Duration,
    Integer,
    ListOf,
    OneOf,
    Optional,
    Path,
    Resolver,
    Setting,
    Size,
    SpoolConfig,
    Text,
    TomlValue,
    resolve_path,
    setting,
    settings_of,
)

__all__ = [
    "SECTIONS",
    "DeliveryConfig",
    "LogConfig",
    "RelayConfig",
    "ServerConfig",
    "SpoolSection",
    "SubmissionConfig",
    "TlsPolicyConfig",
    "file_settings",
]


def _path_default(path: str) -> Derived:
    """A relative path default: resolved like one written in the file."""
    return Derived(f"`{path}`", lambda r: resolve_path(path, r.base_dir))


@attrs.frozen(kw_only=True)
class ServerConfig:
    """``[server]``: the listening side.

    Denial of service (docs/security.md, "Denial of service", has the
    reasoning and Postfix's equivalents): the session limits, the deadlines
    and min_data_rate.
    """

    listen: tuple[ListenAddress, ...] = setting(
        ListOf(Listen(), least=1, needed="at least one address is needed"),
        "SMTP addresses, `host:port` or `[v6]:port`; port 0 lets the OS pick", (ListenAddress("127.0.0.1", 2525),))
    hostname: str = setting(Hostname(), "banner and EHLO name", blank_is_default=True,
                            derived=Derived("`socket.getfqdn()` (else `localhost`)", lambda r: default_hostname()))
    max_message_size: int = setting(Size(positive=True), "SIZE limit; larger data gets 552", DEFAULT_MAX_MESSAGE_SIZE)
    max_recipients: int = setting(Integer(1), "per transaction", DEFAULT_MAX_RECIPIENTS)
    max_sessions: int = setting(Integer(1), "concurrent SMTP sessions; beyond it, `421 4.7.0`", 100)
    reserved_sessions: int = setting(
        Integer(0), "of those, slots only `mynetworks` clients may take; must be less than `max_sessions`",
        derived=Derived("`max_sessions` / 10", lambda r: r("server.max_sessions") // 10))
    max_sessions_per_client: int = setting(
        Integer(1), "sessions from one client address (clients in `mynetworks` are exempt)", 20)
    max_sessions_per_network: int = setting(
        Integer(1), "sessions from one client network (clients in `mynetworks` are exempt)", 50)
    network_prefix_ipv4: int = setting(Integer(8, 32), "what a client network is for IPv4: the /24 by default", 24)
    network_prefix_ipv6: int = setting(Integer(16, 128), "what a client network is for IPv6: the /64 by default", 64)
    max_errors: int = setting(Integer(1), "bad commands before the session is dropped", DEFAULT_MAX_ERRORS)
    line_length_limit: int = setting(Integer(1000, 1 << 20), "bytes, CRLF included (RFC 5321's minimum)", 1000)
    normalize_bare_lf: bool = setting(Boolean(), "false rejects bare LF (the SMTP smuggling defence)", False)
    command_timeout: float = setting(
        Duration(positive=True), "for a whole command line (and the replies before it), from when the relay starts "
        "waiting for it; reads of parts of it do not restart it; also the whole STARTTLS handshake", 300.0)
    data_timeout: float = setting(
        Duration(positive=True), "the DATA phase's first budget and its longest allowed stall", 600.0)
    min_data_rate: int = setting(
        Size(positive=True), "inside DATA each byte buys `1/min_data_rate` s, never more than `data_timeout` ahead; "
        "a DATA phase lasts at most `data_timeout` + `max_message_size` / `min_data_rate`", 1000, unit="bytes/s")
    session_time_limit: float = setting(
        Duration(positive=True), "no new command is taken after this long in one session (`421 4.4.2`)", 3600.0)
    tls_cert: str | None = setting(
        Optional(ReadableFile()), "PEM certificate (chain); with `tls_key`, enables STARTTLS. Checked at start: PEM, "
        "and the key's certificate", None)
    tls_key: str | None = setting(
        Optional(ReadableFile()), "PEM private key of `tls_cert`: unencrypted, not open to other users "
        "(docs/security.md, \"Files and permissions\")", None)
    control_socket: str = setting(
        Path(), "where `mta queue` reaches the relay; at most 107 bytes (with `processes` > 1, shard k's is the path "
        "plus `.k`), in a directory that exists and no other user may write", blank_is_default=True,
        derived=Derived("`<spool.dir>/control.sock`", lambda r: os.path.join(r("spool.dir"), "control.sock")))
    metrics_listen: ListenAddress | None = setting(
        Optional(Listen()), "the Prometheus endpoint; not set, none", None)
    metrics_max_connections: int = setting(
        Integer(1, 1024), "metrics requests served at once; more wait in the listen backlog", 8)
    metrics_timeout: float = setting(
        Duration(positive=True), "per metrics request, to send its request and read the answer", 10.0)
    processes: int = setting(
        Processes(), "relay processes, one spool shard each (see \"Several processes\")", 1)
    drain_timeout: float = setting(
        Duration(at_most=3600.0), "on SIGTERM, how long transactions and deliveries in flight may take to finish "
        "before the process ends as a crash does (see \"Restarting, reloading and upgrading\")", 10.0)


def _minfree(r: Resolver) -> int:
    size: int = r("server.max_message_size")
    return 3 * size


@attrs.frozen(kw_only=True)
class SpoolSection(SpoolConfig):
    """``[spool]``: the engine's settings (``spool.config.engine.SpoolConfig``), where the spool lives,
    and the disk floor.

    ``engine()`` is what the engine is opened with.
    """

    dir: str = setting(Path(), "the log, checkpoint, lock and the 256 KiB reserve (see \"Disk space\")",
                       derived=_path_default("var/spool"))
    queue_minfree: int = setting(
        Size(), "below this much free disk (less what the spool has not yet written), MAIL, DATA and its end get 452 "
        "(see \"Disk space\")", blank_is_default=True, derived=Derived("3 × `server.max_message_size`", _minfree))

    def engine(self, **changes: Any) -> SpoolConfig:
        """The engine's own config: this section without the relay's fields, with ``changes``."""
        values = {f.name: getattr(self, f.name) for f in attrs.fields(SpoolConfig) if f.init}
        return SpoolConfig(**{**values, **changes})


_ALL_V4 = ipaddress.IPv4Network("0.0.0.0/0")
_ALL_V6 = ipaddress.IPv6Network("::/0")


@attrs.frozen(kw_only=True)
class RelayConfig:
    """``[relay]``: who may relay, and who the postmaster is.

    ``postmaster`` is where mail to ``<postmaster>`` and ``<postmaster@HOSTNAME>``
    goes (RFC 5321 §4.5.1: accepted from anyone); it is routed like any other
    address, except that when no route is named for its domain and that
    domain is the relay's own hostname it is delivered into the Maildir
    ``postmaster_maildir/<local part>/`` (never by a ``"*"`` route, which
    would send it back to this relay).
    """

    mynetworks: tuple[IPNetwork, ...] = setting(
        ListOf(Network()), "clients allowed to relay anywhere; IPv4-mapped entries (`::ffff:10.0.0.0/104`) are read "
        "as the IPv4 network they name", (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")))
    relay_domains: tuple[str, ...] = setting(
        ListOf(Domain()), "domains accepted from anyone; `.example.com` means every subdomain", ())
    allow_open_relay: bool = setting(
        Boolean(), "`mynetworks` that together cover every IPv4 or every IPv6 address (`0.0.0.0/0`, `::/0`, "
        "`::ffff:0:0/96`, ...) make an open relay and are refused at load (exit 2) unless this is `true`; then the "
        "relay logs a warning at start", False)
    postmaster: str = setting(
        Mailbox(), "where mail to `<postmaster>` and `<postmaster@HOSTNAME>` goes (accepted from anyone, RFC 5321 "
        "§4.5.1); routed like any other address, see below. The relay refuses to start if no route delivers it",
        derived=Derived("`postmaster@<hostname>`", lambda r: f"postmaster@{r('server.hostname')}"))
    postmaster_maildir: str = setting(
        Path(), "the Maildir root for the postmaster when no route is named for its domain and that domain is the "
        "relay's own hostname (the default): mail lands in `var/maildir/postmaster/new/`",
        derived=_path_default("var/maildir"))

    def open_to_all(self) -> bool:
        """Whether mynetworks, taken together, hold every IPv4 address or every IPv6 address."""
        v4 = [n for n in self.mynetworks if isinstance(n, ipaddress.IPv4Network)]
        v6 = [n for n in self.mynetworks if isinstance(n, ipaddress.IPv6Network)]
        return _ALL_V4 in ipaddress.collapse_addresses(v4) or _ALL_V6 in ipaddress.collapse_addresses(v6)


MAX_DELIVERY_PROCESSES = 64
# ``[delivery] processes = "auto"`` as read: resolved by ``mta serve`` when it starts (``delivery_workers``).
AUTO_DELIVERY_PROCESSES = -1


@attrs.frozen
class DeliveryProcesses(Processes):
    """``[delivery] processes``: 0 (deliver in the relay process), N, or ``"auto"`` (the default).

    ``"auto"`` is kept as ``AUTO_DELIVERY_PROCESSES`` and resolved where the relay's processes are started
    (``delivery_workers``): ``mta serve`` knows how many relay processes share the CPUs; a relay run inside
    another program (the tests, the benchmarks' in-process relay) delivers itself.
    """

    def what(self) -> str:
        return (f'integer 0–{MAX_DELIVERY_PROCESSES}, or "auto" (the CPUs left by the relay processes, shared '
                "among them: one per CPU beyond the first with one relay process; 0 on one CPU)")

    def convert(self, raw: object, base_dir: str | None) -> int:
        if raw == "auto":
            return AUTO_DELIVERY_PROCESSES
        value = super().convert(raw, base_dir)
        Integer(0, MAX_DELIVERY_PROCESSES).check(value)  # here: a -1 in the file is not "auto"
        return value

    def check(self, value: int) -> None:
        if value != AUTO_DELIVERY_PROCESSES:
            Integer(0, MAX_DELIVERY_PROCESSES).check(value)

    def write(self, value: int) -> TomlValue:
        return "auto" if value == AUTO_DELIVERY_PROCESSES else value


def delivery_workers(processes: int, relay_processes: int, cpus: int | None = None) -> int:
    """Delivery workers for each of ``relay_processes`` relay processes: ``processes``, or for ``"auto"`` the CPUs
    the relay processes leave, shared among them (1 relay process on 2 CPUs: 1; 2 on 2: 0; 2 on 8: 3 each)."""
    if processes != AUTO_DELIVERY_PROCESSES:
        return processes
    cpus = cpus if cpus is not None else usable_cpus()
    return max(0, min((cpus - relay_processes) // max(1, relay_processes), MAX_DELIVERY_PROCESSES))


@attrs.frozen(kw_only=True)
class DeliveryConfig:
    """``[delivery]``: the outgoing side."""

    concurrency: int = setting(Integer(1), "delivery tasks in all", 100)
    per_destination: int = setting(Integer(1), "connections to one destination at once", 20)
    connect_timeout: float = setting(Duration(positive=True), "to open a connection to one address", 30.0)
    command_timeout: float = setting(Duration(positive=True), "client side, RFC 5321 §4.5.3.2", 300.0)
    data_timeout: float = setting(
        Duration(positive=True), "client side: for sending the body, and again for the reply to its end "
        "(RFC 5321 §4.5.3.2)", 600.0)
    max_messages_per_connection: int = setting(
        Integer(1), "connection reuse: messages one connection carries, within a batch and across batches; a "
        "connection that has carried this many is closed", 100)
    connection_cache_time: float = setting(
        Duration(at_most=300.0), "how long a connection to a next hop is kept idle for the next batch to the same hop "
        "(checked before it is used again: with RSET after 1 s idle, docs/design.md); `0`: close it after each "
        "batch. At most `per_destination` wait per hop. As Postfix's `smtp_connection_cache_time_limit`", 2.0)
    resolver: ListenAddress | None = setting(
        Optional(Listen(default_port=53)), "the DNS server for every delivery lookup (MX, addresses, MTA-STS and "
        "TLSA records); for DANE it must validate DNSSEC and be trusted to say so (on this host: `127.0.0.1`); "
        "not set, the system resolver", None)
    mx_port: int = setting(Integer(1, 65535), "port of the hosts an MX lookup finds; for tests and unusual setups", 25)
    bounce_sender: str = setting(
        Address(), "From: of DSNs (their envelope sender is always null)", blank_is_default=True,
        derived=Derived("`MAILER-DAEMON@<hostname>`", lambda r: f"MAILER-DAEMON@{r('server.hostname')}"))
    delay_warning: float | None = setting(
        Optional(Duration(positive=True)), "a duration after arrival for delay notices; not set, none", None)
    on_damaged_body: str = setting(
        OneOf(("bounce", "hold")), "a message whose data the spool finds damaged when delivering it: `bounce` it to "
        "its sender with the reason, or `hold` it for the administrator (see \"When the disk lies\")", "bounce")
    tls_ca_file: str | None = setting(
        Optional(ReadableFile()), "PEM CA certificates trusted besides the system's wherever a certificate is "
        "verified: `tls=verify` routes (a private smarthost's CA), MTA-STS policy fetches and the MX hosts an MTA-STS "
        "policy names", None)
    processes: int = setting(
        DeliveryProcesses(), "delivery worker processes that run the SMTP client beside each relay process, so "
        "deliveries use another core (see \"Delivery worker processes\"); `0`: the relay process delivers itself",
        AUTO_DELIVERY_PROCESSES)


@attrs.frozen(kw_only=True)
class TlsPolicyConfig:
    """``[tls_policy]``: MTA-STS (RFC 8461) and TLS reporting (RFC 8460); docs/security.md, "MTA-STS and DANE".

    Which routes look policies up is the route's ``tls`` (``mx?tls=dane,mta-sts``);
    the DNS server (a validating one for DANE) is ``[delivery] resolver``, the
    extra trust anchors ``[delivery] tls_ca_file``.
    """

    mta_sts_cache: str = setting(
        Path(), "where fetched MTA-STS policies are kept for their `max_age`, one file per domain, so a restart "
        "keeps them", derived=Derived("`<spool.dir>/mta-sts`", lambda r: os.path.join(r("spool.dir"), "mta-sts")))
    mta_sts_port: int = setting(
        Integer(1, 65535), "port of `https://mta-sts.DOMAIN/`; 443 but for tests", 443)
    mta_sts_timeout: float = setting(
        Duration(positive=True), "a whole policy fetch (address lookup, connect, TLS, the answer); a fetch that fails "
        "leaves the cached policy, or none, in force", 30.0)
    report_dir: str | None = setting(
        Optional(Path()), "where daily TLS-RPT reports (RFC 8460's JSON, one file per policy domain and day) are "
        "written; not set, sessions are not counted", None)
    report_organization: str = setting(
        Text(nonempty=True), "`organization-name` of the reports", blank_is_default=True,
        derived=Derived("`<hostname>`", lambda r: r("server.hostname")))
    report_contact: str = setting(
        Text(nonempty=True), "`contact-info` of the reports", blank_is_default=True,
        derived=Derived("`<relay.postmaster>`", lambda r: r("relay.postmaster")))


@attrs.frozen(kw_only=True)
class SubmissionConfig:
    """``[submission]``: mail from the relay's own users, authenticated (RFC 6409, RFC 8314, RFC 4954).

    A submission listener relays for authenticated clients only: MAIL before
    AUTH gets ``530 5.7.0``, AUTH before TLS gets ``538 5.7.11``. Needs
    ``server.tls_cert`` and ``users_file``. docs/security.md, "SMTP AUTH".
    """

    listen: tuple[ListenAddress, ...] = setting(
        ListOf(Listen()), "submission addresses with STARTTLS, required before AUTH and MAIL (port 587); none: off",
        ())
    implicit_tls_listen: tuple[ListenAddress, ...] = setting(
        ListOf(Listen()), "submission addresses with TLS from the first byte (port 465, RFC 8314); none: off", ())
    users_file: str | None = setting(
        Optional(Path()), "the users and their Argon2 hashes, written by `mta user add|passwd|del` (mode 0600); "
        "reread when it changes", None)
    max_auth_failures: int = setting(
        Integer(1), "failed AUTH attempts from one client address within `auth_failure_window`: the one that "
        "reaches it, and every AUTH from that address while it holds, gets `421 4.7.0` and the connection is closed", 5)
    auth_failure_window: float = setting(Duration(positive=True), "see `max_auth_failures`", 900.0)
    auth_failure_delay: float = setting(
        Duration(), "how long a failed AUTH waits before its `535 5.7.8` (slows guessing on one connection)", 1.0)
    auth_concurrency: int = setting(
        Integer(1, 64), "password checks at once (each an Argon2 verification: ~0.3 s of CPU and 64 MiB); more wait",
        2)
    authenticated_header: bool = setting(
        Boolean(), "name the user in the `Received:` header, `(Authenticated sender: NAME)` as Postfix writes it "
        "(Postfix's smtpd_sasl_authenticated_header); the envelope keeps it either way", False)

    @property
    def enabled(self) -> bool:
        return bool(self.listen or self.implicit_tls_listen)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


@attrs.frozen(kw_only=True)
class LogConfig:
    """``[log]``."""

    level: str = setting(OneOf(LOG_LEVELS), "the least severe log line written", "info")
    format: str = setting(OneOf(LOG_FORMATS),
                          "`text`: one `key=value` line per event (logfmt); `json`: one JSON object per line. "
                          "Both are described, with a sample of every line, under \"Log lines\"", "text")


# The sections of the file, in the order the loader reads them and ``mta config show`` writes them.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("server", ServerConfig),
    ("spool", SpoolSection),
    ("relay", RelayConfig),
    ("delivery", DeliveryConfig),
    ("submission", SubmissionConfig),
    ("tls_policy", TlsPolicyConfig),
    ("log", LogConfig),
    ("dkim", DkimSection),  # its keys, [[dkim.key]], are read by mta.config.dkim.parse_dkim_keys
    ("limits", LimitsSection),
    ("policy", PolicySection),
    ("proxy", ProxySection),
    ("sendmail", SendmailSection),
    ("smarthost_auth", SmarthostAuthSection),
    ("filters", FiltersSection),
    ("recipients", RecipientsSection),
    ("http", HttpSection),
    ("events", EventsSection),
    ("egress", EgressSection),
    ("bounce_classes", BounceClassesSection),
    ("client_certs", ClientCertsSection),
    ("shaping", ShapingSection),
)


def file_settings(cls: type) -> Sequence[Setting[Any]]:
    """The settings of a section that the file may set: the section's own first, then inherited ones."""
    own = {f.name for f in attrs.fields(cls) if not f.inherited}
    chosen = [s for s in settings_of(cls) if s.in_file]
    return [s for s in chosen if s.name in own] + [s for s in chosen if s.name not in own]
