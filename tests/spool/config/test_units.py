"""spool.config.units: one grammar of durations and sizes, written back exactly;
spool.config.settings: the engine checks its own."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spool.config.engine import SpoolConfig
from spool.config.units import MAX_DURATION, format_age, format_duration, format_size, parse_duration, parse_size
from spool.errors import ConfigError


@given(st.one_of(st.floats(0, MAX_DURATION), st.integers(0, int(MAX_DURATION)).map(float),
                 st.integers(0, 10**6).map(lambda ms: ms / 1000)))
def test_a_duration_is_written_so_that_it_reads_back_exactly(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


@given(st.integers(0, 1 << 50))
def test_a_size_is_written_so_that_it_reads_back_exactly(size: int) -> None:
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (0.1, "100ms"), (90, "90s"), (300, "5m"), (3600, "1h"),
                                               (5400, "90m"), (432000, "5d"), (604800, "1w"), (1.5, "1.5s")])
def test_durations_are_written_in_the_largest_whole_unit(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_sizes_are_written_in_binary_units_where_exact() -> None:
    assert [format_size(n) for n in (10 << 20, 64 << 20, 512 << 10, 10_240_000, 1000)] == \
        ["10MiB", "64MiB", "512KiB", "10000KiB", 1000]


def test_format_age_rounds_for_reading() -> None:
    assert [format_age(s) for s in (45, 300, 273845, 3 * 86400)] == ["45s", "5m", "3d 4h", "3d"]


@pytest.mark.parametrize("bad", ["soon", "5 m s", "-1s", "1e3s", True, float("nan"), "999999w"])
def test_a_bad_duration_is_one_config_error(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_the_engine_checks_its_settings_by_their_definitions() -> None:
    """Code that builds a SpoolConfig meets the rules of the config file, in the same words, named by setting."""
    with pytest.raises(ConfigError, match=r"^segment_size: must be between 4 KiB and 1 GiB, got 1$"):
        SpoolConfig(segment_size=1)
    with pytest.raises(ConfigError, match=r"^retry_intervals\[1\]: must be greater than zero"):
        SpoolConfig(retry_intervals=(5.0, 0.0))
    with pytest.raises(ConfigError, match=r"^retry_intervals: retry intervals must not decrease"):
        SpoolConfig(retry_intervals=(5.0, 1.0))
    with pytest.raises(ConfigError, match=r"^deferred_share: must be between 0 and 1"):
        SpoolConfig(deferred_share=1.5)
    with pytest.raises(ValueError, match=r"^commit_delay: must be at most 1 s"):
        SpoolConfig(commit_delay=2.0)
    assert SpoolConfig(checkpoint_interval=math.inf).checkpoint_interval == math.inf  # tests turn checkpoints off
