"""``mta shape``: which shaping applies to a domain and why (``resolve``), and what the replies changed (``explain``).

``explain`` rebuilds the adaptive state from the log itself, with the same
code the relay runs at start (``mta.shaping.rebuild``), rather than asking
the running relay: the state is a function of the log's durable outcomes,
so the answer is the relay's own (up to the last commit), and it is there
when the relay is stopped or down, which is when an operator most wants to
know why a provider's mail is not moving.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from typing import TYPE_CHECKING, Any

import click

from mta.cli_common import config_option, json_option

if TYPE_CHECKING:
    from mta.shaping.adapt import Override
    from mta.shaping.resolve import Resolution

# The rest is imported by the commands that need it: ``mta`` starts for every command (``mta queue``
# among them), and the resolver and the event stream are not what they need.

_DOMAIN = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")


def _domain(text: str) -> str:
    from mta.admin.errors import BadRequest

    domain = text.strip().lower().rstrip(".").rpartition("@")[2]
    if not _DOMAIN.fullmatch(domain) or len(domain) > 253:
        raise BadRequest(f"{text!r} is not a domain")
    return domain


def _resolution(config: Any, domain: str) -> Resolution:
    import trio

    from mta.shaping.resolve import resolve
    from mta.shaping.setup import mx_hosts, resolver_of, table_of

    table = table_of(config)
    hosts = trio.run(mx_hosts, resolver_of(config), domain)
    return resolve(table, domain, hosts)


def _when(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _override_dict(o: Override, now: float) -> dict[str, Any]:
    from spool import format_pos

    return {"rule": o.rule.name, "scope": o.scope, "action": o.rule.action, "began": _when(o.began),
            "ends": _when(o.ends), "ends_unix": round(o.ends, 3), "ramp_ends": _when(o.gone),
            "ramping": now >= o.ends, "hits": [{"id": format_pos(h.pos), "time": _when(h.time),
                                                  "recipient": h.recipient, "reply": h.describe(),
                                                  "next_hop": h.next_hop} for h in o.hits]}


@click.group()
def shape() -> None:
    """Per-provider shaping: the limits and rules that apply, and what the replies changed."""


@shape.command("resolve")
@click.argument("domain")
@config_option
@json_option
def resolve_command(domain: str, config_path: str | None, as_json: bool) -> None:
    """Which provider DOMAIN belongs to (and why), its limits with the file that set each, and its rules."""
    from mta.config import load_config

    name = _domain(domain)
    config = load_config(config_path)
    r = _resolution(config, name)
    if as_json:
        click.echo(json.dumps({"domain": r.domain, "provider": r.provider.name if r.provider else None,
                               "matched": r.matched, "lines": r.lines()}, sort_keys=True))
        return
    for line in r.lines():
        click.echo(line)


@shape.command("explain")
@click.argument("domain")
@config_option
@click.option("--shard", type=click.IntRange(0), default=0, show_default=True, help="Which shard's log.")
@json_option
def explain_command(domain: str, config_path: str | None, shard: int, as_json: bool) -> None:
    """The overrides in force on DOMAIN (and its provider): the replies that fired each, and when it ends."""
    from mta.config import load_config
    from mta.events.source import open_stream
    from mta.shaping.rebuild import rebuild
    from mta.shaping.setup import table_of

    name = _domain(domain)
    config = load_config(config_path)
    r = _resolution(config, name)
    stream = open_stream(config, shard)
    now = time.time()
    adaptive = rebuild(table_of(config), stream, stream.spool_dir, now)
    found = adaptive.active(dict.fromkeys((r.provider_key, r.domain_key)), now)
    if as_json:
        click.echo(json.dumps({"domain": name, "provider": r.provider.name if r.provider else None,
                               "overrides": [_override_dict(o, now) for o in found]}, sort_keys=True))
        return
    if not found:
        click.echo(f"{name}: no override in force ({r.provider_key})")
        return
    for o in found:
        d = _override_dict(o, now)
        state = "ramping back" if d["ramping"] else "in force"
        click.echo(f"{o.scope}: rule {o.rule.name} {o.rule.action} {state}, began {d['began']}, ends {d['ends']}"
                   + (f", ramp ends {d['ramp_ends']}" if o.rule.ramp_steps else ""))
        for h in d["hits"]:
            click.echo(f"  {h['id']} {h['time']} <{h['recipient']}> {h['next_hop']}: {h['reply']}")
