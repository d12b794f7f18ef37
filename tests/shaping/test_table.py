"""The shaping table: the shipped defaults load, the operator's file overrides them field by field, bad entries
are one line naming the file and the entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from mta.shaping.resolve import provider_of_reply, resolve
from mta.shaping.table import BUILTIN, Rate, ShapingError, load_table, parse_rate


def test_the_shipped_table_carries_the_big_providers() -> None:
    table = load_table(True, None)
    names = {p.name: p for p in table.providers}
    assert {"google", "yahoo", "outlook", "office365", "apple"} <= set(names)
    assert names["google"].limits.connections == 5 and names["google"].limits.messages_per_connection == 50
    assert names["yahoo"].mx_suffixes == (".yahoodns.net",)
    assert table.domains["comcast.net"].tls_required is True
    assert {r.name for r in table.rules} >= {"yahoo-tss04", "gmail-4.7.28"}


def test_the_operators_file_overrides_field_by_field_and_says_where_each_limit_came_from(tmp_path: Path) -> None:
    path = tmp_path / "shaping.toml"
    path.write_text('[provider.google]\nconnections = 2\n\n[domain."example.net"]\nrate = "30/min"\n')
    table = load_table(True, str(path))
    r = resolve(table, "gmail.com", ["alt1.gmail-smtp-in.l.google.com"])
    assert r.provider is not None and r.provider.name == "google"
    assert r.matched == "MX host alt1.gmail-smtp-in.l.google.com ends with .google.com"
    assert r.provider_limits.connections == 2 and r.provider_limits.sources["connections"] == str(path)
    assert r.provider_limits.messages_per_connection == 50
    assert r.provider_limits.sources["messages_per_connection"] == BUILTIN
    assert resolve(table, "example.net", []).domain_limits.rate == Rate(30, 60)
    assert resolve(table, "example.net", []).provider is None


def test_a_reply_names_its_provider_by_the_host_that_answered() -> None:
    table = load_table(True, None)
    assert provider_of_reply(table, "gmail.com", "gmail-smtp-in.l.google.com[192.0.2.1]:25 tls=TLSv1.3") == "google"
    assert provider_of_reply(table, "example.org", "mx.example.org[192.0.2.1]:25") is None


@pytest.mark.parametrize(("text", "problem"), [
    ('[provider.x]\nconnections = 2\n', "provider.x: names neither mx_suffix nor domains"),
    ('[provider.x]\nmx_suffix = ["example.net"]\n', "must begin with a dot"),
    ('[domain."a.test"]\nconnections = 0\n', "domain.a.test: connections must be a whole number of 1 or more"),
    ('[domain."a.test"]\nrate = "fast"\n', "is not a rate"),
    ('[domain."a.test"]\nspeed = 1\n', "unknown key 'speed'"),
    ('[[rule]]\nname = "r"\naction = "suspend"\nduration = "1h"\n', "names no pattern"),
    ('[[rule]]\nname = "r"\ncode = 421\naction = "nap"\nduration = "1h"\n', "action must be one of"),
    ('[[rule]]\nname = "r"\ncode = 421\naction = "suspend"\n', "duration is required"),
    ('[[rule]]\nname = "r"\ntext = "("\naction = "suspend"\nduration = "1h"\n', "not a regular expression"),
    ('[[rule]]\nname = "r"\ncode = 421\naction = "limit"\nlimit = {connections = "150%"}\nduration = "1h"\n',
     "between 0% and 100%"),
    ('[[rule]]\nname = "r"\ncode = 421\napplies_to = "provider:nobody"\naction = "suspend"\nduration = "1h"\n',
     "applies_to names no provider"),
    ('[provider', "shaping file"),
])
def test_a_bad_entry_is_one_line_naming_the_file_and_the_entry(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "shaping.toml"
    path.write_text(text)
    with pytest.raises(ShapingError) as info:
        load_table(False, str(path))
    assert problem in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_missing_file_is_one_line() -> None:
    with pytest.raises(ShapingError, match=r"shaping file /nonexistent/shaping\.toml: No such file"):
        load_table(True, "/nonexistent/shaping.toml")


def test_rates() -> None:
    assert parse_rate("100/s").per_second == 100
    assert parse_rate("30/min").per_second == 0.5
    assert str(parse_rate("500/h")) == "500/h"
    with pytest.raises(ValueError):
        parse_rate("0/s")
