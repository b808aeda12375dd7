"""Group-relative advantages: one test per invariant of tiderl.advantages."""

import math

import pytest

from tiderl.advantages import IncompleteGroupError, advantages_by_group, group_advantages


def test_hand_computed_values():
    # rewards 1, 0, 0, 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    s = math.sqrt(1.0 / 3.0)
    assert adv == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])


def test_sum_is_zero():
    assert sum(group_advantages([0.3, 2.0, -1.0, 5.5, 0.0])) == pytest.approx(0.0, abs=1e-9)


def test_equal_rewards_give_zero():
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]


def test_group_of_one_gives_zero():
    assert group_advantages([3.0]) == [0.0]


def test_order_follows_rewards():
    adv = group_advantages([0.0, 1.0, 2.0])
    assert adv[0] < adv[1] < adv[2]


def test_incomplete_group_is_refused():
    with pytest.raises(IncompleteGroupError, match="g7.*3 of 4"):
        advantages_by_group({"g1": [1, 0, 1, 0], "g7": [1, 0, 1]}, group_size=4)
    assert set(advantages_by_group({"g1": [1, 0, 1, 0]}, group_size=4)) == {"g1"}


def test_bad_rewards_are_named():
    with pytest.raises(ValueError, match="reward 1"):
        group_advantages([0.0, float("nan")])
    with pytest.raises(ValueError, match="empty"):
        group_advantages([])
