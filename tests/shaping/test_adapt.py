"""The adaptive state, sans-IO: hits counted per window, overrides fired, extended, ramped back and gone."""

from __future__ import annotations

from pathlib import Path

from mta.shaping.adapt import Adaptive
from mta.shaping.reply import remote_reply
from mta.shaping.table import load_table

RULES = """
[provider.p]
mx_suffix = [".p.test"]
rate = "20/s"
connections = 8

[[rule]]
name = "suspend"
applies_to = "provider:p"
code = 421
enhanced = "4.7.28"
threshold = 2
window = "60s"
action = "suspend"
duration = "100s"

[[rule]]
name = "slow"
applies_to = "provider:p"
text = "slow down"
threshold = 1
window = "60s"
action = "limit"
limit = { rate = "25%", connections = "50%" }
floor = { connections = 2 }
duration = "10s"
ramp_steps = 3
ramp_step = "5s"
"""

HOP = "mx.p.test[127.0.0.1]:25"


def adaptive(tmp_path: Path) -> Adaptive:
    path = tmp_path / "s.toml"
    path.write_text(RULES)
    return Adaptive(load_table(False, str(path)).rules)


def feed(a: Adaptive, pos: int, t: float, code: int = 421, enhanced: str = "4.7.28", text: str = "unusual rate",
         hop: str = HOP) -> list[str]:
    return [o.rule.name for o in a.feed(pos=pos, time=t, recipient=f"u{pos}@d.test", code=code, enhanced=enhanced,
                                        text=text, next_hop=hop, provider="p")]


def test_two_hits_within_the_window_suspend_and_one_outside_does_not(tmp_path: Path) -> None:
    a = adaptive(tmp_path)
    assert feed(a, 1, 1000.0) == []
    assert feed(a, 2, 1061.0) == []  # the first has left the 60 s window
    assert feed(a, 3, 1070.0) == ["suspend"]
    (o,) = a.active(["provider:p"], 1070.0)
    assert (o.began, o.ends) == (1070.0, 1170.0)
    assert [h.pos for h in o.hits] == [2, 3]
    assert a.active(["provider:p"], 1170.0) == []


def test_the_relays_own_deferrals_never_count(tmp_path: Path) -> None:
    a = adaptive(tmp_path)
    for pos, t in ((1, 1000.0), (2, 1001.0)):
        # No reply code and no host: what a suspended provider's or a backed-off destination's mail records,
        # even when its text repeats the reply that caused it.
        assert a.feed(pos=pos, time=t, recipient="u@d.test", code=0, enhanced="4.4.1", text="421 4.7.28 unusual rate",
                      next_hop="", provider="p") == []
    assert remote_reply(0, "4.4.1", "destination mx:d.test not reachable, retry postponed: "
                        "mx.p.test[127.0.0.1]:25: the server is closing the connection: 421 4.7.28 x", "mx:d.test") \
        is None
    assert remote_reply(0, "4.7.0", "shaping: provider p suspended by rule suspend until 1.000", "") is None
    assert a.overrides == {}


def test_a_reply_quoted_in_a_connection_failure_is_the_next_hops() -> None:
    said = remote_reply(0, "4.4.1", "mx.p.test[127.0.0.1]:25: the server is closing the connection: 421 4.7.28 "
                        "Our system has detected an unusual rate", "mx:d.test")
    assert said is not None
    assert (said.code, said.enhanced, said.text, said.next_hop) == (421, "4.7.28", "Our system has detected an "
                                                                     "unusual rate", "mx.p.test[127.0.0.1]:25")


def test_a_relative_decrease_ramps_back_up_in_steps_and_then_is_gone(tmp_path: Path) -> None:
    a = adaptive(tmp_path)
    assert feed(a, 1, 0.0, code=451, enhanced="4.7.1", text="please slow down") == ["slow"]
    (o,) = a.active(["provider:p"], 0.0)
    rate, conns = o.rule.changes  # rate 25 %, connections 50 % with a floor of 2
    seen = [(t, o.apply(rate, 20.0, t), o.apply(conns, 8.0, t)) for t in (0.0, 9.9, 10.0, 15.0, 20.0, 24.9)]
    assert seen == [(0.0, 5.0, 4.0), (9.9, 5.0, 4.0), (10.0, 8.75, 5.0), (15.0, 12.5, 6.0), (20.0, 16.25, 7.0),
                    (24.9, 16.25, 7.0)]
    assert o.next_change(0.0) == 10.0 and o.next_change(12.0) == 15.0
    assert a.active(["provider:p"], 25.0) == []
    a.expire(25.0)
    assert a.overrides == {}


def test_the_trigger_again_while_it_ramps_starts_it_over(tmp_path: Path) -> None:
    a = adaptive(tmp_path)
    feed(a, 1, 0.0, code=451, enhanced="4.7.1", text="slow down")
    assert feed(a, 2, 12.0, code=451, enhanced="4.7.1", text="slow down") == ["slow"]
    (o,) = a.active(["provider:p"], 12.0)
    assert o.began == 0.0 and o.ends == 22.0 and o.step(12.0) == 0
    assert [h.pos for h in o.hits] == [1, 2]


def test_the_same_outcomes_fed_again_give_the_same_overrides(tmp_path: Path) -> None:
    hits = [(1, 100.0), (2, 130.0), (3, 150.0)]
    first, second = adaptive(tmp_path), adaptive(tmp_path)
    for pos, t in hits:
        feed(first, pos, t)
        feed(second, pos, t)
    assert [(o.scope, o.began, o.ends, [h.pos for h in o.hits]) for o in first.overrides.values()] == \
        [(o.scope, o.began, o.ends, [h.pos for h in o.hits]) for o in second.overrides.values()]
