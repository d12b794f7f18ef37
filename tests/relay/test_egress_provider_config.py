"""``[egress.providers]``: what the loader and ``mta config check`` refuse, where a provider stands among the
rules, and which recipient domains a message waits for (their MX lookups) before its address is chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from relay_support import write_relay_config

from mta.cli import main
from mta.config import ConfigError, parse_config
from mta.config.show import show_config
from mta.delivery.egress import Egress
from mta.shaping.adapt import Adaptive
from mta.shaping.gate import Shaper
from mta.shaping.resolve import provider_by_domain
from mta.shaping.table import load_table

SOURCES = """
[egress.sources."192.0.2.10"]
[egress.sources."192.0.2.11"]
[egress.sources."192.0.2.12"]
[egress.sources."192.0.2.13"]
[egress.pools]
bulk = { "192.0.2.10" = 1, "192.0.2.11" = 1 }
"""

ALL = SOURCES + """
[egress.routes]
"exact.example" = "192.0.2.10"
".sub.example" = "192.0.2.11"
"*" = "192.0.2.12"
[egress.senders]
"news.example" = "bulk"
"*" = "192.0.2.10"
[egress.providers]
google = "192.0.2.13"
"""


def test_the_first_match_decides_sender_then_route_then_provider_then_the_stars() -> None:
    section = parse_config(ALL).egress
    assert section.target_for("a@news.example", "exact.example", "google") == "bulk"  # the sender's domain
    assert section.target_for("a@src.example", "exact.example", "google") == "192.0.2.10"  # an exact route
    assert section.target_for("a@src.example", "mx.sub.example", "google") == "192.0.2.11"  # a .suffix route
    assert section.target_for("a@src.example", "gmail.example", "google") == "192.0.2.13"  # the provider
    assert section.target_for("a@src.example", "gmail.example", "yahoo") == "192.0.2.12"  # routes' *
    assert section.target_for("a@src.example", "gmail.example") == "192.0.2.12"
    assert section.needs_provider("a@src.example", "gmail.example")
    assert not section.needs_provider("a@news.example", "gmail.example")
    assert not section.needs_provider("a@src.example", "x.sub.example")
    no_route_star = parse_config(ALL.replace('"*" = "192.0.2.12"\n', "")).egress
    assert no_route_star.target_for("a@src.example", "gmail.example", None) == "192.0.2.10"  # senders' *
    assert no_route_star.target_for("a@src.example", "gmail.example", "google") == "192.0.2.13"


def test_without_providers_the_choice_is_as_before_and_needs_no_provider() -> None:
    section = parse_config(ALL.split("[egress.providers]")[0]).egress
    assert section.target_for("a@src.example", "gmail.example", "google") == "192.0.2.12"
    assert not section.needs_provider("a@src.example", "gmail.example")


def test_providers_read_and_show_writes_them_back() -> None:
    config = parse_config(ALL)
    assert config.egress.providers == (("google", "192.0.2.13"),)
    assert parse_config(show_config(config)).egress == config.egress


@pytest.mark.parametrize(("text", "key", "words"), [
    ('[shaping]\nenabled = false\n[egress.providers]\ngoogle = "192.0.2.13"', "egress.providers",
     "set [shaping] enabled = true"),
    ('[egress.providers]\ngoogle = "nowhere"', "egress.providers[google]", "neither a pool"),
])
def test_a_provider_the_relay_cannot_use_is_named_in_one_line(text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(SOURCES + text, source="relay.toml")
    assert f"relay.toml: {key}: " in str(caught.value) and words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_config_check_and_serve_refuse_a_provider_the_shaping_table_does_not_have(tmp_path: Path) -> None:
    (tmp_path / "shaping.toml").write_text('[provider.corp]\nmx_suffix = [".corp.test"]\n')
    good = SOURCES + '[egress.providers]\ncorp = "192.0.2.13"\ngoogle = "bulk"\n'
    config_path = write_relay_config(tmp_path, {"*": "mx"}, extra='[shaping]\nfile = "shaping.toml"\n',
                                     spool_extra=good)
    ok = CliRunner().invoke(main, ["config", "check", "--config", str(config_path)])
    assert ok.exit_code == 0, ok.output
    config_path = write_relay_config(tmp_path, {"*": "mx"}, extra='[shaping]\nfile = "shaping.toml"\n',
                                     spool_extra=good.replace("google =", "gogle ="))
    for args in (["config", "check"], ["serve"]):
        r = CliRunner().invoke(main, [*args, "--config", str(config_path)])
        assert r.exit_code == 2, (args, r.output)
        assert "egress.providers[gogle]: 'gogle' is not a provider of the shaping table" in r.output
        assert "google" in r.output and "corp" in r.output and "Traceback" not in r.output


def test_a_domain_in_a_providers_domain_list_names_it_without_its_mx_hosts(tmp_path: Path) -> None:
    (tmp_path / "shaping.toml").write_text('[provider.corp]\ndomains = ["corp.example"]\n')
    table = load_table(False, str(tmp_path / "shaping.toml"))
    assert provider_by_domain(table, "Corp.Example.") == "corp"
    assert provider_by_domain(table, "mail.corp.example") == "corp"
    assert provider_by_domain(table, "other.example") is None


async def test_a_message_waits_for_the_mx_lookup_only_where_a_provider_may_decide(tmp_path: Path) -> None:
    (tmp_path / "shaping.toml").write_text('[provider.corp]\ndomains = ["listed.example"]\n'
                                           'mx_suffix = [".corp.test"]\n')
    table = load_table(False, str(tmp_path / "shaping.toml"))
    hosts = {"hosted.example": ["mx1.corp.test"], "plain.example": ["mx.plain.example"]}

    async def lookup(domain: str) -> list[str]:
        return hosts.get(domain, [])

    shaper = Shaper(table, Adaptive(table.rules), per_destination=5, batch=10, mx_lookup=lookup)
    config = parse_config(ALL.replace("google =", "corp ="))
    egress = Egress(config.egress, shaper=shaper)
    domains = ["listed.example", "hosted.example", "plain.example", "exact.example", "hosted.example"]
    assert egress.lookups_wanted("a@src.example", domains) == ["hosted.example", "plain.example"]
    assert egress.lookups_wanted("a@news.example", domains) == []  # the sender's rule decides: nothing to wait for
    assert egress.provider_of("listed.example") == "corp" and egress.provider_of("hosted.example") is None
    await shaper.classify("hosted.example")
    await shaper.classify("plain.example")
    assert egress.lookups_wanted("a@src.example", domains) == []
    assert egress.provider_of("hosted.example") == "corp" and egress.provider_of("plain.example") is None
    assert getattr(egress.choose("a@src.example", "hosted.example", "corp"), "address", None) == "192.0.2.13"
    assert Egress(config.egress).provider_of("listed.example") is None  # shaping off: no provider
