"""One test per invariant of tiderl.policy.ctb_budget (numbered as in its docstring)."""

from __future__ import annotations

import random

import pytest

from tiderl.policy.ctb_budget import BudgetLimits, CacheFeedback, adjust_budget, prefix_kept

LIMITS = BudgetLimits(floor_tokens=1024, max_factor=4.0, grow_share=0.125, shrink=0.5, evicted_tolerance=0.05,
                      window_turns=16)


def feedback(rng: random.Random) -> CacheFeedback:
    return CacheFeedback(kept_turns=rng.randint(0, 40), evicted_turns=rng.randint(0, 10), budget_bound=rng.random() < 0.5)


def test_1_the_budget_stays_between_the_floor_and_the_ceiling():
    rng = random.Random(3)
    budget = LIMITS.floor_tokens
    for _ in range(2000):
        budget = adjust_budget(budget, feedback(rng), LIMITS)
        assert LIMITS.floor_tokens <= budget <= 4 * 1024
    # A budget handed in out of range is brought back into it.
    assert adjust_budget(10, CacheFeedback(0, 0, False), LIMITS) == 1024
    assert adjust_budget(10**6, CacheFeedback(0, 0, False), LIMITS) == 4096


def test_2_no_change_before_a_full_window():
    assert adjust_budget(2048, CacheFeedback(kept_turns=10, evicted_turns=5, budget_bound=True), LIMITS) == 2048
    assert adjust_budget(2048, CacheFeedback(kept_turns=15, evicted_turns=0, budget_bound=True), LIMITS) == 2048


def test_3_evictions_above_the_tolerance_shrink_the_part_above_the_floor():
    many = CacheFeedback(kept_turns=14, evicted_turns=2, budget_bound=True)  # 12.5% evicted
    assert adjust_budget(3072, many, LIMITS) == 1024 + 1024  # half of the 2,048 above the floor
    assert adjust_budget(1024, many, LIMITS) == 1024
    rng = random.Random(5)
    for _ in range(2000):
        f, budget = feedback(rng), rng.randint(1024, 4096)
        if f.judged_turns >= 16 and f.evicted_turns > 0.05 * f.judged_turns:
            after = adjust_budget(budget, f, LIMITS)
            assert after <= budget and (after < budget or budget == 1024)


def test_4_growth_only_while_binding_and_within_the_tolerance():
    assert adjust_budget(1024, CacheFeedback(kept_turns=20, evicted_turns=1, budget_bound=True), LIMITS) == 1152
    assert adjust_budget(1024, CacheFeedback(kept_turns=20, evicted_turns=0, budget_bound=False), LIMITS) == 1024
    assert adjust_budget(4000, CacheFeedback(kept_turns=20, evicted_turns=0, budget_bound=True), LIMITS) == 4096
    rng = random.Random(9)
    for _ in range(2000):
        f, budget = feedback(rng), rng.randint(1024, 4096)
        if adjust_budget(budget, f, LIMITS) > budget:
            assert f.budget_bound and f.evicted_turns <= 0.05 * f.judged_turns and f.judged_turns >= 16


def test_5_pure():
    f = CacheFeedback(kept_turns=20, evicted_turns=0, budget_bound=True)
    assert adjust_budget(2000, f, LIMITS) == adjust_budget(2000, f, LIMITS)
    assert f == CacheFeedback(kept_turns=20, evicted_turns=0, budget_bound=True)


def test_prefix_kept_judges_full_blocks_with_one_block_of_slack():
    assert prefix_kept(prefix_tokens=100, cached_tokens=96, block_tokens=32)
    assert prefix_kept(prefix_tokens=100, cached_tokens=64, block_tokens=32)  # one block short: slack
    assert not prefix_kept(prefix_tokens=100, cached_tokens=32, block_tokens=32)
    assert prefix_kept(prefix_tokens=40, cached_tokens=0, block_tokens=32) is None  # one full block: no evidence


@pytest.mark.parametrize("bad", [dict(floor_tokens=0), dict(max_factor=0.5), dict(grow_share=0), dict(shrink=1.0),
                                 dict(evicted_tolerance=1.0), dict(window_turns=0)])
def test_bad_limits_are_refused_by_name(bad):
    args = dict(floor_tokens=1024) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        BudgetLimits(**args)


def test_6_the_tracker_adjusts_once_a_window_with_that_window_only():
    from tiderl.policy.ctb_budget import BudgetTracker
    tracker = BudgetTracker(1024, LIMITS)
    tracker.held_back(True)
    for _ in range(15):
        assert tracker.judge(prefix_tokens=640, cached_tokens=640, block_tokens=16) is True
    assert tracker.budget_tokens == 1024  # a window not yet full
    tracker.judge(640, 640, 16)  # the 16th kept turn, the budget held a task back: it grows
    assert tracker.budget_tokens == 1024 + 128 and tracker.window == [0, 0] and not tracker.bound
    for _ in range(16):  # a new window of kept turns, the budget never binding: unchanged
        tracker.judge(640, 640, 16)
    assert tracker.budget_tokens == 1152
    for _ in range(16):  # evicted turns: back toward the floor
        assert tracker.judge(640, 0, 16) is False
    assert tracker.budget_tokens == 1024 + 64
    assert tracker.judge(16, 0, 16) is None and tracker.window == [0, 0]  # too short to judge: not counted
    fixed = BudgetTracker(1024)  # no limits: judged, never adjusted
    for _ in range(40):
        fixed.held_back(True)
        fixed.judge(640, 640, 16)
    assert fixed.budget_tokens == 1024
