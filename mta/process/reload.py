"""SIGHUP: read the config file again and apply what can change while the relay runs.

What changes live: every setting the SMTP sessions read (limits, timeouts,
relay networks and domains, ``[submission]`` and its users file, ``[limits]``
and ``[policy]``), the TLS certificate and key, the DKIM keys, the HTTP
API's tokens file and TLS certificate, the routes and the rest of
``[delivery]`` that the scheduler reads per message. A session already open keeps the
settings it started with; the next one gets the new ones. What needs a
restart (``RESTART``: addresses, the spool, processes, sizes of pools) keeps
its old value, and the one log line says so.

A new config that does not load or does not pass the start checks changes
nothing: one log line, and the relay serves on as it was.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs

from mta.config import Config, ConfigError, load_config
from mta.errors import StartError
from mta.observe.logline import event
from mta.process.server_tls import ssl_context

if TYPE_CHECKING:
    from mta.process.relay import Relay

log = logging.getLogger("mta")

# Settings read once at start: (section, key). A change is reported and waits for a restart.
RESTART: frozenset[tuple[str, str]] = frozenset({
    ("server", "listen"), ("server", "processes"), ("server", "control_socket"), ("server", "metrics_listen"),
    ("server", "metrics_max_connections"), ("server", "metrics_timeout"), ("server", "hostname"),
    ("server", "max_sessions"), ("server", "max_sessions_per_client"), ("server", "max_sessions_per_network"),
    ("server", "reserved_sessions"), ("server", "network_prefix_ipv4"), ("server", "network_prefix_ipv6"),
    ("server", "drain_timeout"),
    ("submission", "listen"), ("submission", "implicit_tls_listen"),
    ("delivery", "processes"), ("delivery", "concurrency"), ("delivery", "per_destination"),
    ("delivery", "max_messages_per_connection"), ("delivery", "connect_timeout"), ("delivery", "command_timeout"),
    ("delivery", "data_timeout"), ("delivery", "connection_cache_time"), ("delivery", "resolver"),
    ("delivery", "mx_port"), ("delivery", "tls_ca_file"),
    ("log", "level"), ("log", "format"),
    ("recipients", "verify_cache"),  # opened by the server's verifier, once
})
SECTIONS = ("server", "spool", "relay", "delivery", "submission", "tls_policy", "log", "dkim", "limits", "policy",
            "filters", "recipients", "egress", "bounce_classes", "client_certs", "shaping")
# The engine's, the outgoing transport's, the scheduler's choice of address and classes, and the shaping table
# (its adaptive state is rebuilt at start): read at start.
RESTART_SECTIONS = frozenset({"spool", "tls_policy", "egress", "bounce_classes", "shaping"})
LIVE: frozenset[tuple[str, str]] = frozenset({("spool", "queue_minfree")})  # read by the sessions' disk check


def changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """The keys whose values differ, as ``section.key``: (applied live, needing a restart)."""
    live: list[str] = []
    later: list[str] = []
    for section in SECTIONS:
        a, b = getattr(old, section), getattr(new, section)
        for field in attrs.fields(type(a)):
            if getattr(a, field.name) != getattr(b, field.name):
                key = f"{section}.{field.name}"
                restart = (section in RESTART_SECTIONS and (section, field.name) not in LIVE) or \
                    (section, field.name) in RESTART
                (later if restart else live).append(key)
    if dict(old.routes) != dict(new.routes):
        live.append("routes")
    if old.dkim_keys != new.dkim_keys:
        live.append("dkim.key")
    return live, later


def as_running(loaded: Config, shard: int, shards: int) -> Config:
    """The file's config as the running process has it: its shard's, ``[delivery] processes`` resolved."""
    from mta.config.sections import delivery_workers
    from mta.shards import shard_config

    loaded = attrs.evolve(loaded, delivery=attrs.evolve(
        loaded.delivery, processes=delivery_workers(loaded.delivery.processes, shards)))
    return shard_config(loaded, shard, shards)


def applicable(old: Config, new: Config) -> Config:
    """``new`` with every setting that needs a restart (and the whole of ``[spool]``) kept as ``old`` has it."""
    evolved: dict[str, Any] = {}
    for section in SECTIONS:
        if section in RESTART_SECTIONS:
            live = {name: getattr(getattr(new, section), name) for s, name in LIVE if s == section}
            evolved[section] = attrs.evolve(getattr(old, section), **live)
            continue
        keep = {name: getattr(getattr(old, section), name) for s, name in RESTART if s == section}
        evolved[section] = attrs.evolve(getattr(new, section), **keep)
    return attrs.evolve(new, **evolved)


def reload(relay: Relay) -> bool:
    """Read ``relay.config.source`` again and apply it; one log line either way. Returns whether it applied."""
    from mta.dkim import signer_for
    from mta.dkim.accept import AcceptSigner
    from mta.http.start import api_tls_context
    from mta.http.tokens import read_tokens
    from mta.inbound.checks import Checks
    from mta.inbound.submission import Authenticator
    from mta.process.startup import check_dkim_keys, check_recipient_tables, check_tls, check_users_file

    old = relay.config
    try:
        loaded = as_running(load_config(old.source), relay.shard, relay.shards)
        new = applicable(old, loaded)
        check_tls(new)
        check_dkim_keys(new)
        check_users_file(new)
        check_recipient_tables(new)
        context = ssl_context(new)
        signer = signer_for(new)
        server = relay.server
        auth = Authenticator(new, relay.metrics) if server is not None else None
        checks = Checks(new, server.checks) if server is not None else None
        tokens = read_tokens(new.http.tokens_file, old.source) if relay.http_api is not None else None
        api_tls = api_tls_context(new) if relay.http_api is not None else None
    except (ConfigError, StartError, OSError, ValueError) as exc:
        event(log, "reload_failed", level=logging.ERROR, config=old.source, error=" ".join(str(exc).split()),
              action="serving on with the config already loaded")
        return False
    live, later = changes(old, loaded)
    relay.config = new
    if server is not None:
        server.config = new
        server.ssl_context = context
        server.dkim = AcceptSigner(signer) if signer else None
        assert auth is not None
        server.auth = auth
        server.disk.minfree = new.spool.queue_minfree
        assert checks is not None
        server.checks.close()
        server.checks = checks
        server.recipient_check.maps.reread()  # at once, not at the next look at the files' status
    relay.scheduler.config = new
    if relay.http_api is not None and tokens is not None:
        relay.http_api.tokens.replace(tokens)
        if relay.http_api.server is not None:
            relay.http_api.server.ssl_context = api_tls  # new connections get the renewed certificate
    reread = [name for name, present in (
        ("tls_cert", new.server.tls_cert is not None), ("dkim.key", bool(new.dkim_keys)),
        ("submission.users_file", auth is not None and auth.users is not None),
        ("http.tokens_file", tokens is not None), ("http.tls_cert", api_tls is not None)) if present]
    event(log, "reload", config=old.source, changed=",".join(live) or "nothing",
          needs_restart=",".join(later) or "nothing", files_read_again=",".join(reread) or "none")
    return True
