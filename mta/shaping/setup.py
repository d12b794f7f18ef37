"""The relay's shaper, made from its config: the table loaded, the adaptive state rebuilt from the log."""

from __future__ import annotations

from collections.abc import Sequence

import dns.asyncresolver
import dns.exception
import trio

from mta.config import Config
from mta.shaping.gate import Shaper
from mta.shaping.rebuild import rebuild
from mta.shaping.table import ShapingTable, load_table
from spool import EventStream

__all__ = ["make_shaper", "mx_hosts", "table_of"]


def table_of(config: Config) -> ShapingTable:
    """The table ``[shaping]`` names. Raises ShapingError (a ConfigError: one line, exit 2)."""
    return load_table(config.shaping.builtin, config.shaping.file)


def resolver_of(config: Config) -> dns.asyncresolver.Resolver:
    """The resolver the transport asks (``[delivery] resolver``), for the MX host names alone."""
    r = config.delivery.resolver
    if r is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [r.host]
        resolver.port = r.port
    resolver.lifetime = resolver.timeout = 5.0
    return resolver


async def mx_hosts(resolver: dns.asyncresolver.Resolver, domain: str) -> Sequence[str]:
    """The domain's MX host names in preference order (none: no MX, or the lookup failed)."""
    try:
        answer = await resolver.resolve(domain, "MX", search=False)
    except (dns.exception.DNSException, OSError):
        return []
    return [str(r.exchange).rstrip(".").lower() for r in sorted(answer, key=lambda r: r.preference)]


async def make_shaper(config: Config) -> Shaper | None:
    """None with ``enabled = false``; else the shaper, its state rebuilt from the log's recent suffix."""
    if not config.shaping.enabled:
        return None
    table = table_of(config)
    stream = EventStream(config.spool.dir, archive_dir=config.spool.archive_dir)
    adaptive = await trio.to_thread.run_sync(rebuild, table, stream, config.spool.dir)
    resolver = resolver_of(config)

    async def lookup(domain: str) -> Sequence[str]:
        return await mx_hosts(resolver, domain)

    return Shaper(table, adaptive, config.delivery.per_destination, max(1, config.delivery.max_messages_per_connection),
                  lookup)
