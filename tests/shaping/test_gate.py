"""The shaper's answers to the scheduler: connections per domain and per provider, messages per connection, the
rate's tokens, and suspensions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import dns.exception
import pytest

from mta.shaping.adapt import Adaptive
from mta.shaping.gate import Shaper, require_tls
from mta.shaping.resolve import resolve
from mta.shaping.table import load_table

TABLE = """
[provider.p]
mx_suffix = [".p.test"]
connections = 3
messages_per_connection = 4
rate = "10/s"

[domain."small.test"]
connections = 1
tls_required = true

[[rule]]
name = "stop"
applies_to = "provider:p"
code = 421
action = "suspend"
duration = "30s"
"""


async def no_lookup(domain: str) -> Sequence[str]:
    return []


def shaper(tmp_path: Path) -> Shaper:
    path = tmp_path / "s.toml"
    path.write_text(TABLE)
    table = load_table(False, str(path))
    return Shaper(table, Adaptive(table.rules), per_destination=5, batch=10, mx_lookup=no_lookup)


def test_the_provider_total_is_shared_by_its_domains(tmp_path: Path) -> None:
    s = shaper(tmp_path)
    one = s.settle(resolve(s.table, "one.test", ["mx.p.test"]))
    two = s.settle(resolve(s.table, "two.test", ["mx.p.test"]))
    for shape in (one, one, two):
        assert s.admits(shape, 0, 0.0)
        s.opened(shape)
    assert not s.admits(two, 1, 0.0)  # 3 open over the provider
    s.closed(one)
    assert s.admits(two, 1, 0.0)
    other = s.settle(resolve(s.table, "small.test", []))
    assert s.admits(other, 0, 0.0) and not s.admits(other, 1, 0.0)  # its own limit, 1
    assert s.tls_required(other) and not s.tls_required(one)


def test_messages_per_connection_and_the_rate_bound_a_batch(tmp_path: Path) -> None:
    s = shaper(tmp_path)
    shape = s.settle(resolve(s.table, "one.test", ["mx.p.test"]))
    assert s.take(shape, 100, 0.0) == 4  # messages_per_connection
    assert s.take(shape, 100, 0.0) == 4
    assert s.take(shape, 100, 0.0) == 2  # 10 tokens (one second's worth) spent
    assert not s.admits(shape, 0, 0.0)
    assert s.wake_at == 0.1  # one token back after 0.1 s at 10/s
    assert s.admits(shape, 0, 0.1)


def test_a_suspended_provider_is_admitted_at_once_to_be_deferred_without_a_connection(tmp_path: Path) -> None:
    s = shaper(tmp_path)
    shape = s.settle(resolve(s.table, "one.test", ["mx.p.test"]))
    assert s.verdict(shape, 0.0) is None
    fired = s.record(7, 5.0, "u@one.test", 421, "4.7.0", "try later", "mx.p.test[127.0.0.1]:25")
    assert [o.rule.name for o in fired] == ["stop"]
    verdict = s.verdict(shape, 6.0)
    assert verdict is not None and verdict.action == "suspend"
    assert verdict.reply() == "shaping: provider p suspended by rule stop until 35.000 (unix time)"
    assert s.verdict(shape, 35.0) is None
    # Its own deferrals (no code) never count.
    assert s.record(8, 6.0, "u@one.test", 0, "4.7.0", verdict.reply(), "") == []


def test_tls_required_keeps_the_policies() -> None:
    assert require_tls("opportunistic") == "require"
    assert require_tls("dane,mta-sts") == "dane,mta-sts,require"
    assert require_tls("verify") == "verify"


def test_a_bounce_rule_on_a_domain_bounces_that_domain_only(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[provider.p]\nmx_suffix = [".p.test"]\n\n[[rule]]\nname = "gone"\napplies_to = "provider:p"\n'
                    'code = 550\ntext = "blocked"\nscope = "domain"\naction = "bounce"\nduration = "1h"\n')
    table = load_table(False, str(path))
    s = Shaper(table, Adaptive(table.rules), per_destination=5, batch=10, mx_lookup=no_lookup)
    one = s.settle(resolve(table, "one.test", ["mx.p.test"]))
    two = s.settle(resolve(table, "two.test", ["mx.p.test"]))
    assert [o.scope for o in s.record(1, 0.0, "u@one.test", 550, "5.7.1", "you are blocked",
                                      "mx.p.test[127.0.0.1]:25")] == ["domain:one.test"]
    verdict = s.verdict(one, 1.0)
    assert verdict is not None and verdict.action == "bounce" and "domain one.test bounced" in verdict.reply()
    assert s.verdict(two, 1.0) is None


async def test_a_failed_lookup_shapes_by_the_domain_and_a_fault_in_the_lookup_is_not_hidden(tmp_path: Path) -> None:
    async def times_out(domain: str) -> Sequence[str]:
        raise dns.exception.Timeout

    async def faulty(domain: str) -> Sequence[str]:
        raise KeyError(domain)

    s = shaper(tmp_path)
    s.mx_lookup = times_out
    shape = await s.classify("small.test")
    assert shape.resolution.provider is None and not s.looking_up("small.test")
    s.mx_lookup = faulty
    with pytest.raises(KeyError):
        await s.classify("other.test")
    assert not s.looking_up("other.test")
