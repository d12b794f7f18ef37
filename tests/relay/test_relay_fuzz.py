"""Server-level fuzzing: hostile SMTP sessions against a relay running in this process.

``tests/smtp/test_smtp_fuzz.py`` fuzzes the sans-IO core; these drive the whole
relay over TCP on 127.0.0.1 with the generator of ``fault_injection.smtpfuzz``
(its docstring says what is checked): every byte value in every command
argument, random and mutated sessions in random chunking, abrupt closes. After
every batch a fresh client must get 220 and a well-formed message must be
delivered. The long run is ``python -m fault_injection smtpfuzz --minutes N``
(figures in docs/reliability.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fault_injection import smtpfuzz

_probes = itertools.count(1)


class HypothesisChooser:
    """The harness's choices drawn from hypothesis, so a failing batch shrinks."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def binary(self, max_size: int) -> bytes:
        return self.data.draw(st.binary(max_size=max_size))


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[smtpfuzz.RelayThread]:
    with smtpfuzz.RelayThread(str(tmp_path_factory.mktemp("smtpfuzz"))) as running:
        yield running


def assert_still_serving(relay: smtpfuzz.RelayThread, stats: smtpfuzz.Stats, *, bdat: bool = False) -> None:
    smtpfuzz.probe(relay, next(_probes), stats, bdat=bdat)
    assert relay.alive(), f"the relay ended: {relay.crash!r}"
    assert not stats.problems, stats.problems
    assert not relay.errors, [r.getMessage() for r in relay.errors]  # contained, but still a bug
    assert stats.probes >= 1


def test_every_byte_value_in_every_argument_is_answered_and_the_relay_serves_on(
        relay: smtpfuzz.RelayThread) -> None:
    ch = smtpfuzz.RandomChooser(0)
    for first in range(0, 256, 32):
        stats = smtpfuzz.Stats()
        for value in range(first, first + 32):
            smtpfuzz.run_batch(relay.port, [smtpfuzz.byte_sweep(value)], ch, stats)
        assert stats.sessions == 32 and stats.replies >= 32 * len(smtpfuzz.TEMPLATES)
        assert_still_serving(relay, stats)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
@pytest.mark.slow
def test_random_hostile_sessions_in_random_chunks_never_stop_the_relay(
        relay: smtpfuzz.RelayThread, data: st.DataObject) -> None:
    ch = HypothesisChooser(data)
    stats = smtpfuzz.Stats()
    smtpfuzz.run_batch(relay.port, smtpfuzz.batch(ch), ch, stats)
    assert_still_serving(relay, stats)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_hostile_bdat_chunks_never_stop_the_relay(relay: smtpfuzz.RelayThread, data: st.DataObject) -> None:
    """BDAT sessions (RFC 3030): chunks of hostile content, sizes that lie, commands between chunks, cut
    anywhere; then a message sent with BDAT is still delivered."""
    ch = HypothesisChooser(data)
    stats = smtpfuzz.Stats()
    smtpfuzz.run_batch(relay.port, [smtpfuzz.bdat_session(ch) for _ in range(ch.integer(1, 3))], ch, stats)
    assert_still_serving(relay, stats, bdat=True)
