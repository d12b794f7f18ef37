"""The retry class of mail deferred by a suspension: the smallest whose interval reaches the suspension's end."""

from __future__ import annotations

import pytest

from mta.delivery.retry_class import class_after_suspension, class_reaching

INTERVALS = (60.0, 300.0, 900.0, 1800.0, 3600.0)  # the spool's default classes 1..5
NOW = 1_000_000.0


@pytest.mark.parametrize(("wait", "klass"), [
    (1.0, 1), (60.0, 1), (61.0, 2), (300.0, 2), (301.0, 3), (900.0, 3), (1000.0, 4), (3600.0, 5),
])
def test_the_smallest_class_whose_interval_reaches_the_end(wait: float, klass: int) -> None:
    assert class_reaching(INTERVALS, NOW, NOW + wait) == klass


def test_a_suspension_longer_than_every_interval_takes_the_last_class() -> None:
    assert class_reaching(INTERVALS, NOW, NOW + 86400) == 5


def test_the_envelope_stamps_whole_seconds_so_a_fraction_of_a_second_counts_whole() -> None:
    # At 0.7 s into a second the envelope is stamped with the second's start: 60 s from the stamp is 0.3 s
    # before an end 59.6 s away, so class 1 would be due before the end.
    assert class_reaching(INTERVALS, NOW + 0.7, NOW + 0.7 + 59.6) == 2
    assert class_reaching(INTERVALS, NOW, NOW + 59.6) == 1


def test_equal_intervals_give_the_first_of_them() -> None:
    assert class_reaching((3.0, 3.0), NOW, NOW + 20) == 2
    assert class_reaching((3.0, 3.0), NOW, NOW + 2) == 1


def test_no_suspended_recipient_leaves_the_spools_class() -> None:
    assert class_after_suspension(INTERVALS, NOW, ["a@x.test"], {}, usual=2) is None


def test_only_suspended_recipients_left_ignore_the_usual_class_either_way() -> None:
    assert class_after_suspension(INTERVALS, NOW, ["a@x.test"], {"a@x.test": NOW + 1000}, usual=1) == 4
    assert class_after_suspension(INTERVALS, NOW, ["a@x.test"], {"a@x.test": NOW + 30}, usual=5) == 1


def test_recipients_deferred_for_other_reasons_take_the_earlier_of_the_two() -> None:
    remaining = ["a@x.test", "b@y.test"]
    assert class_after_suspension(INTERVALS, NOW, remaining, {"a@x.test": NOW + 1000}, usual=2) == 2
    assert class_after_suspension(INTERVALS, NOW, remaining, {"a@x.test": NOW + 30}, usual=3) == 1


def test_two_suspensions_bring_the_message_back_at_the_earlier_end() -> None:
    suspended = {"a@x.test": NOW + 1000, "b@y.test": NOW + 200}
    assert class_after_suspension(INTERVALS, NOW, ["a@x.test", "b@y.test"], suspended, usual=1) == 2


def test_a_suspended_recipient_with_its_final_outcome_is_not_counted() -> None:
    # Delivered recipients are not among the remaining ones: only the ordinary deferral is left.
    assert class_after_suspension(INTERVALS, NOW, ["b@y.test"], {"a@x.test": NOW + 1000}, usual=2) is None
