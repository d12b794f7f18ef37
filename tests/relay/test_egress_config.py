"""``[egress]``: what the loader takes and refuses, ``mta config show``'s round trip, and the choice of address."""

from __future__ import annotations

import datetime as dt

import cbor2
import pytest

from mta.config import ConfigError, parse_config
from mta.config.egress import Source, warmup_cap
from mta.config.show import show_config
from mta.delivery.egress import AllCapped, Egress
from spool import Delivery, Outcome, Status
from spool.format.record import RecordType, decode_payload

GOOD = """
[egress.sources."192.0.2.10"]
ehlo = "out1.example.com"
[egress.sources."192.0.2.11"]
warmup_start = 2026-12-01
warmup = [[1, 50], [2, 100], [4, 400]]
[egress.pools]
bulk = { "192.0.2.10" = 3, "192.0.2.11" = 1 }
[egress.routes]
".example.net" = "bulk"
"*" = "192.0.2.10"
[egress.senders]
"news.example.com" = "192.0.2.11"
"""


def test_a_full_section_reads_and_show_writes_it_back_as_the_same_config() -> None:
    config = parse_config(GOOD)
    assert config.egress.sources[1] == Source("192.0.2.11", "", dt.date(2026, 12, 1), ((1, 50), (2, 100), (4, 400)))
    assert config.egress.pools[0].members == (("192.0.2.10", 3), ("192.0.2.11", 1))
    again = parse_config(show_config(config))
    assert again.egress == config.egress


@pytest.mark.parametrize(("text", "key", "words"), [
    ('[egress.pools]\np = { "192.0.2.9" = 1 }', "egress.pools[p][192.0.2.9]", "not in [egress.sources]"),
    ('[egress.routes]\n"a.example" = "nowhere"', "egress.routes[a.example]", "neither a pool"),
    ('[egress.sources."not-an-ip"]\n', "egress.sources", "not an IP address"),
    ('[egress.sources."192.0.2.1"]\nwarmup = [[1, 5]]', "egress.sources[192.0.2.1].warmup_start", "needs warmup_start"),
    ('[egress.sources."192.0.2.1"]\nwarmup_start = "2026-13-01"', "egress.sources[192.0.2.1]", "not a date"),
    ('[egress.sources."192.0.2.1"]\nwarmup_start = 2026-12-01\nwarmup = [[2, 5], [1, 9]]',
     "egress.sources[192.0.2.1].warmup[1]", "days must increase"),
    ('[egress.sources."192.0.2.1"]\nehlo = "bad name"', "egress.sources[192.0.2.1]", "not a host name"),
    ('[egress.sources."192.0.2.1"]\ncolour = "blue"', "egress.sources[192.0.2.1].colour", "unknown key"),
    ('[egress.sources."192.0.2.1"]\n[egress.pools]\np = { "192.0.2.1" = 0 }', "egress.pools[p][192.0.2.1]",
     "weight is an integer"),
])
def test_a_bad_section_is_named_in_one_line(text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, source="relay.toml")
    assert key in str(caught.value) and words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_warmup_cap_follows_the_schedule_by_day_and_ends_after_it() -> None:
    s = Source("192.0.2.11", "", dt.date(2026, 12, 1), ((1, 50), (2, 100), (4, 400)))
    caps = [warmup_cap(s, dt.date(2026, 11, 30) + dt.timedelta(days=i)) for i in range(7)]
    assert caps == [0, 50, 100, 100, 400, None, None]
    assert warmup_cap(Source("192.0.2.10"), dt.date(2026, 12, 1)) is None


def test_weights_share_the_mail_and_a_capped_address_leaves_it_to_the_others() -> None:
    config = parse_config(GOOD)
    noon = dt.datetime(2026, 12, 2, 12, tzinfo=dt.UTC).timestamp()  # day 2: 192.0.2.11 may carry 100
    egress = Egress(config.egress, clock=lambda: noon)
    picked = [egress.choose("a@src.example", "x.example.net") for _ in range(8)]
    assert [p.address for p in picked if isinstance(p, Source)].count("192.0.2.10") == 6
    egress.counts["192.0.2.11"] = 100
    assert all(getattr(egress.choose("a@src.example", "x.example.net"), "address", "") == "192.0.2.10"
               for _ in range(5))
    egress.counts["192.0.2.10"] = 0
    assert isinstance(egress.pick("192.0.2.11"), AllCapped)
    assert getattr(egress.choose("b@news.example.com", "x.example.net"), "address", None) is None
    assert egress.choose("a@src.example", "y.example.org") == Source("192.0.2.10", "out1.example.com")


def test_a_new_day_starts_every_count_at_zero() -> None:
    now = [dt.datetime(2026, 12, 1, 23, 59, tzinfo=dt.UTC).timestamp()]
    egress = Egress(parse_config(GOOD).egress, clock=lambda: now[0])
    assert isinstance(egress.choose("a@news.example.com", "z.example"), Source)
    assert egress.counts == {"192.0.2.11": 1}
    now[0] += 120
    assert egress.room("192.0.2.11") and egress.counts == {}


def test_a_delivery_record_keeps_its_source_and_one_without_reads_as_before() -> None:
    outcome = Outcome("r@x.example", Status.DELIVERED, 250, "2.0.0", "ok", "mx[192.0.2.5]:25")
    with_source = Delivery(5, 6, (outcome,), 7, (), "192.0.2.10")
    payload = with_source.to_payload()
    assert decode_payload(RecordType.DELIVERY, payload) == with_source

    assert cbor2.loads(payload) == with_source.to_map()
    plain = Delivery(5, 6, (outcome,), 7)
    assert 5 not in plain.to_map() and decode_payload(RecordType.DELIVERY, plain.to_payload()) == plain
