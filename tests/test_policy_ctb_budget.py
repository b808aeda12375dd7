"""One test per invariant of tiderl.policy.ctb_budget (numbered as in its docstring)."""

from __future__ import annotations

import math
import random

import pytest

from tiderl.policy.ctb_budget import (
    BudgetLimits,
    BudgetState,
    BudgetTracker,
    CacheFeedback,
    adjust_budget,
    gain_ratio,
    next_budget,
    prefix_kept,
    reprefill_cost,
)

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
    # With costs too, and a hold is not counted down by a window not yet full.
    costly = CacheFeedback(kept_turns=10, evicted_turns=5, budget_bound=True, reprefill_cost_tokens=10**6,
                           generated_tokens=100)
    assert next_budget(BudgetState(2048, 5, 7), costly, LIMITS) == BudgetState(2048, 5, 7)


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
                                 dict(evicted_tolerance=1.0), dict(window_turns=0), dict(probe_cost_share=0),
                                 dict(max_hold_windows=-1), dict(cost_smoothing=0), dict(cost_smoothing=1.5)])
def test_bad_limits_are_refused_by_name(bad):
    args = dict(floor_tokens=1024) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        BudgetLimits(**args)


def test_6_the_tracker_adjusts_once_a_window_with_that_window_only():
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


def costed(kept: int, evicted: int, bound: bool, cost: float, generated: int) -> CacheFeedback:
    return CacheFeedback(kept_turns=kept, evicted_turns=evicted, budget_bound=bound, reprefill_cost_tokens=cost,
                         generated_tokens=generated)


def costed_feedback(rng: random.Random) -> CacheFeedback:
    return costed(rng.randint(0, 40), rng.randint(0, 10), rng.random() < 0.5, rng.choice([0.0, rng.random() * 800]),
                  rng.randint(0, 2000))


def test_gain_ratio_and_reprefill_cost_by_hand():
    assert gain_ratio(1024, 1024) == 0 and gain_ratio(1000, 1024) == 0
    assert gain_ratio(1152, 1024) == 0.125 and gain_ratio(2048, 1024) == 1.0 and gain_ratio(4096, 1024) == 3.0
    # A 7B model on a GPU: 3e-5 s a prefilled token, 300 sequences decoding at 30 ms an iteration.
    assert reprefill_cost(3e-5, 0.03, 300) == pytest.approx(0.3)
    assert reprefill_cost(3e-5, 0.03, 0) == pytest.approx(0.001)  # an idle engine: one sequence waits
    with pytest.raises(ValueError, match="iteration_s"):
        reprefill_cost(3e-5, 0.0, 4)


def nb(budget: int, hold: int, f: CacheFeedback, memory: int = 0) -> tuple[int, int, int]:
    state = next_budget(BudgetState(budget, hold, memory), f, LIMITS)
    return state.budget_tokens, state.hold_windows, state.memory_windows


def test_7_costly_re_prefills_put_the_budget_back_at_the_floor_and_hold_it():
    # 1,152 = the floor + one step: g = 128 / 1,024 = 0.125. Re-prefills costing 200 of 1,000 generated
    # tokens (k = 0.2) cost more than the overcommit could gain: the floor, and ceil(0.2 / 0.02) = 10 windows.
    assert nb(1152, 0, costed(14, 2, True, 200, 1000)) == (1024, 10, 10)
    assert nb(4096, 0, costed(0, 16, True, 16_000, 1000)) == (1024, 800, 800)
    assert nb(1152, 0, costed(0, 16, True, 10**6, 1)) == (1024, 4096, 4096)  # the longest hold
    assert nb(1152, 30, costed(14, 2, True, 200, 1000)) == (1024, 30, 10)  # a longer hold pending stays
    assert nb(1152, 0, costed(14, 2, True, 200, 1000), memory=8) == (1024, 16, 16)  # failing again: doubled
    assert nb(1152, 0, costed(14, 2, True, 200, 1000), memory=3) == (1024, 10, 10)
    # k = 0.1 <= g: the overcommit pays for its re-prefills, even with half the turns evicted (the count
    # rule would shrink): not lowered, and it rises (g(1,280) = 0.25 >= 0.1).
    # At twice the floor the overcommit pays up to k = 1 (twice the tasks, each losing half its time):
    # k = 0.9 keeps the budget and raises it, k = 1.1 is a failed probe.
    assert nb(2048, 0, costed(2, 14, True, 900, 1000)) == (2176, 0, 0)
    assert nb(2048, 0, costed(2, 14, True, 1100, 1000)) == (1024, 55, 55)
    assert nb(1152, 0, costed(8, 8, True, 100, 1000)) == (1280, 0, 0)
    assert nb(1152, 0, costed(8, 8, False, 100, 1000)) == (1152, 0, 0)
    rng = random.Random(7)
    for _ in range(3000):
        f, budget, hold, memory = costed_feedback(rng), rng.randint(1024, 4096), rng.randint(0, 20), rng.randint(0, 20)
        after, hold_after, memory_after = nb(budget, hold, f, memory)
        if f.judged_turns < 16:
            continue
        if budget > 1024 and f.cost_share > gain_ratio(budget, 1024):
            new = min(4096, max(math.ceil(f.cost_share / 0.02), 2 * memory))
            assert (after, hold_after, memory_after) == (1024, max(hold, new), new)
        else:
            assert after >= budget


def test_8_growth_only_while_binding_unheld_and_paid_for():
    # At the floor, one step up multiplies the generation by at most 1,152 / 1,024: g = 0.125.
    assert nb(1024, 0, costed(16, 0, True, 0, 1280)) == (1152, 0, 0)
    assert nb(1024, 0, costed(15, 1, True, 125, 1000)) == (1152, 0, 0)  # k = 0.125 <= 0.125
    assert nb(1024, 0, costed(15, 1, True, 130, 1000)) == (1024, 0, 0)  # k = 0.13: not worth it
    assert nb(1024, 0, costed(16, 0, False, 0, 1280)) == (1024, 0, 0)  # never held a task back
    assert nb(1024, 3, costed(16, 0, True, 0, 1280)) == (1024, 2, 0)  # a hold: one window less
    # Re-prefills during a hold are the failed probe's aftermath: k = 0.25 charges floor(0.25 / 0.02) = 12 windows.
    assert nb(1024, 3, costed(15, 1, True, 320, 1280), memory=5) == (1024, 2 + 12, 5 + 12)
    assert nb(1024, 3, costed(15, 1, True, 19, 1000), memory=5) == (1024, 2, 5)  # k = 0.019: no charge
    assert nb(1024, 4090, costed(15, 1, True, 320, 1280), memory=4090) == (1024, 4096, 4096)  # the longest hold
    assert nb(4096, 0, costed(16, 0, True, 0, 1280)) == (4096, 0, 0)  # the ceiling
    rng = random.Random(11)
    for _ in range(3000):
        f, budget, hold = costed_feedback(rng), rng.randint(1024, 4096), rng.randint(0, 3)
        after, _, _ = nb(budget, hold, f, rng.randint(0, 5))
        assert 1024 <= after <= 4096  # invariant 1 under the cost rule
        if after > budget:
            assert f.judged_turns >= 16 and f.budget_bound and hold == 0 and f.cost_share <= gain_ratio(after, 1024)


def test_9_the_memory_of_a_failed_probe_fades_outside_holds_and_grows_only_with_failures_or_held_costs():
    assert nb(1024, 2, costed(16, 0, True, 0, 1280), memory=10) == (1024, 1, 10)  # in a hold: kept
    assert nb(1024, 0, costed(16, 0, True, 0, 1280), memory=10) == (1152, 0, 10)  # a probe from the floor: kept
    assert nb(1152, 0, costed(16, 0, True, 0, 1280), memory=10) == (1280, 0, 9)  # above, paid: one less
    assert nb(1152, 0, costed(14, 2, True, 100, 1000), memory=10) == (1280, 0, 9)  # k = 0.1 <= 0.125: paid
    assert nb(1152, 0, costed(16, 0, False, 0, 1280), memory=1) == (1152, 0, 0)
    assert nb(1152, 0, costed(16, 0, False, 0, 1280), memory=0) == (1152, 0, 0)  # never below 0
    rng = random.Random(13)
    for _ in range(3000):
        f, budget, hold, memory = costed_feedback(rng), rng.randint(1024, 4096), rng.randint(0, 5), rng.randint(0, 9)
        after, _, memory_after = nb(budget, hold, f, memory)
        failed = f.judged_turns >= 16 and budget > 1024 and f.cost_share > gain_ratio(budget, 1024)
        charged = f.judged_turns >= 16 and hold > 0 and f.cost_share >= 0.02
        assert 0 <= memory_after <= 4096
        if not failed and not charged:
            assert memory_after <= memory
            if budget == 1024 or hold > 0:
                assert memory_after == memory  # fades only above the floor, outside a hold
    # The count rule leaves hold and memory alone.
    assert nb(1152, 4, CacheFeedback(8, 8, True), memory=6) == (1088, 4, 6)


def test_the_tracker_weighs_what_evicted_contexts_cost():
    tracker = BudgetTracker(1024, LIMITS)
    tracker.held_back(True)
    for _ in range(16):  # kept turns, 80 tokens generated each: nothing to re-prefill, k = 0
        tracker.judge(640, 640, 16, generated_tokens=80, reprefill_cost=0.5)
    assert tracker.budget_tokens == 1152 and tracker.hold == 0 and tracker.cost == 0.0 and tracker.generated == 0
    for _ in range(14):
        tracker.judge(640, 640, 16, generated_tokens=80, reprefill_cost=1.0)
    # Two evicted 640-token contexts at 1 generated token a token: 1,280 of 1,280 generated, k_w = 1; the
    # average over windows is 0.75 x 0 + 0.25 x 1 = 0.25 > g = 0.125: the floor, for ceil(0.25 / 0.02) windows.
    assert tracker.judge(640, 0, 16, generated_tokens=80, reprefill_cost=1.0) is False
    assert tracker.judge(640, 0, 16, generated_tokens=80, reprefill_cost=1.0) is False
    assert tracker.budget_tokens == 1024 and tracker.hold == 13 and tracker.memory == 13 and tracker.lost_tokens == 1280
    assert tracker.cost_share == 0.25
    tracker.held_back(True)
    for _ in range(16):  # a clean window during the hold: no rise, 12 windows left
        tracker.judge(640, 640, 16, generated_tokens=80, reprefill_cost=0.5)
    assert tracker.budget_tokens == 1024 and tracker.hold == 12
    # A window in which a turn came without a cost is judged by the count rule (and rises: bound, no eviction).
    tracker.held_back(True)
    tracker.judge(640, 640, 16, generated_tokens=80)
    for _ in range(15):
        tracker.judge(640, 640, 16, generated_tokens=80, reprefill_cost=0.5)
    assert tracker.budget_tokens == 1152 and tracker.cost == 0.0


def test_the_cost_meter_fits_a_fixed_part_decoding_and_prefill_from_iterations():
    from tiderl.policy.ctb_budget import CostMeter
    meter = CostMeter()
    rng = random.Random(17)
    walls, decodings = [], []
    for i in range(100):  # 8 ms fixed, 0.1 ms a decoding sequence, 0.02 ms a prefilled token
        d, p = rng.randint(1, 40), rng.choice([0, 0, 0, 32, 640, 2000])
        walls.append(0.008 + 0.0001 * d + 0.00002 * p)
        decodings.append(d)
        meter.observe(walls[-1], p, d)
        if i < 63:
            assert meter.cost() is None  # fewer than 64 iterations
    iteration_s, prefill_s, decoding = meter.fit()
    assert prefill_s == pytest.approx(0.00002)
    weights = [0.995 ** (99 - i) for i in range(100)]
    assert iteration_s == pytest.approx(sum(w * x for w, x in zip(weights, walls)) / sum(weights))
    assert decoding == pytest.approx(sum(w * x for w, x in zip(weights, decodings)) / sum(weights))
    assert meter.cost() == pytest.approx(0.00002 * round(decoding) / iteration_s)

    # The old per-turn fit's mistake: the fixed part charged to the prefill. Here prefill is free; a
    # fit without a fixed part would find ~the overhead per prefilled token.
    free = CostMeter(min_iterations=8)
    for i in range(40):
        free.observe(0.010 + 0.0002 * (i % 5), [0, 200][i % 2], 1 + i % 5)
    assert free.cost() == pytest.approx(0.0, abs=1e-9)

    never = CostMeter(min_iterations=8)  # no iteration prefilled: the parts cannot be told apart
    for i in range(20):
        never.observe(0.01 + 0.001 * (i % 3), 0, 1 + i % 3)
    assert never.cost() is None
    assert CostMeter(min_iterations=1).cost() is None


def test_10_k_is_averaged_over_windows_so_one_unlucky_window_does_not_end_an_overcommit_that_pays():
    # At 1,536 tokens (g = 0.5) with an average k of 0.2: a window with k_w = 1.2 brings it to 0.45, within g.
    state = next_budget(BudgetState(1536, cost_share=0.2), costed(6, 10, True, 1200, 1000), LIMITS)
    assert state.budget_tokens == 1664 and state.cost_share == pytest.approx(0.45)
    # A second such window takes it to 0.6375, past g(1,664) = 0.625: a failed probe.
    state = next_budget(state, costed(6, 10, True, 1200, 1000), LIMITS)
    assert state.budget_tokens == 1024 and state.cost_share == pytest.approx(0.6375)
    # The first window with costs is taken as it is; the count rule leaves the average alone.
    assert next_budget(BudgetState(1536), costed(6, 10, True, 1200, 1000), LIMITS).budget_tokens == 1024
    assert next_budget(BudgetState(1536, cost_share=0.3), CacheFeedback(16, 0, True), LIMITS).cost_share == 0.3
    assert next_budget(BudgetState(1536, cost_share=0.3), costed(6, 4, True, 1200, 1000), LIMITS).cost_share == 0.3
