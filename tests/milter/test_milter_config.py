"""``[filters]``: milter addresses as Postfix spells them, per listener, and a clear error for every mistake."""

from __future__ import annotations

import pytest

from mta.config import ConfigError, parse_config
from mta.config.filters import MilterAddress, parse_milter_address
from mta.milter.chain import FilterSession


def test_postfix_spellings_of_a_milter_address() -> None:
    assert parse_milter_address("inet:8891@127.0.0.1") == MilterAddress("127.0.0.1", 8891)
    assert parse_milter_address("inet:localhost:11332") == MilterAddress("localhost", 11332)
    assert parse_milter_address("inet:[::1]:11332") == MilterAddress("::1", 11332)
    assert parse_milter_address("unix:/run/opendkim.sock") == MilterAddress("", 0, "/run/opendkim.sock")
    assert str(parse_milter_address("local:/run/m.sock")) == "unix:/run/m.sock"


@pytest.mark.parametrize(("text", "problem"), [
    ("8891@127.0.0.1", "not a milter address"),
    ("tcp:8891@127.0.0.1", "must be inet or unix"),
    ("inet:99999@127.0.0.1", "port must be a number"),
    ("inet:8891@", "is not a host"),
    ("unix:relative.sock", "absolute path"),
])
def test_a_bad_address_is_one_clear_problem(text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_milter_address(text)


@pytest.mark.parametrize(("line", "key"), [
    ('smtp_milters = ["nonsense"]', "filters.smtp_milters[0]"),
    ('rspamd_url = "https://x"', "filters.rspamd_url"),
    ('milter_default_action = "maybe"', "filters.milter_default_action"),
    ('rspamd_ports = ["lmtp"]', "filters.rspamd_ports[0]"),
])
def test_a_bad_setting_is_named_by_its_key(line: str, key: str) -> None:
    with pytest.raises(ConfigError, match=r"relay\.toml: " + key.replace(".", r"\.").replace("[", r"\[")):
        parse_config(f"[filters]\n{line}\n", source="relay.toml")


def test_each_listener_has_its_own_filters() -> None:
    cfg = parse_config('[filters]\nsmtp_milters = ["inet:1@127.0.0.1"]\nsubmission_milters = []\n'
                       'rspamd_url = "http://127.0.0.1:11333"\nrspamd_ports = ["smtp"]\n', source="relay.toml")
    assert cfg.filters.milters_for(submission=False) == (MilterAddress("127.0.0.1", 1),)
    assert cfg.filters.milters_for(submission=True) == ()
    assert FilterSession.for_session(cfg.filters, submission=True) is None
    assert FilterSession.for_session(cfg.filters, submission=False) is not None
    same = parse_config('[filters]\nsmtp_milters = ["inet:1@127.0.0.1"]\n', source="relay.toml")
    assert same.filters.submission_milters == same.filters.smtp_milters
    assert FilterSession.for_session(parse_config("", source="relay.toml").filters, submission=False) is None
