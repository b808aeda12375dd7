"""One test per invariant of tiderl.policy.ra2p (numbered as in its docstring),
with hand-worked timelines for the cost model."""

from __future__ import annotations

import math
import random

import pytest

from tiderl.policy.ra2p import (
    Ra2pMode,
    StageTimes,
    break_even_ras,
    choose_mode,
    colocated_cost_s,
    decoupled_cost_s,
    ready_at_start,
    smallest_last_microbatches,
    time_per_ready_microbatch_s,
    vanilla_stream_cost_s,
    zigzag_dispatch,
)

UNIT = StageTimes(t_ref_s=1.0, t_act_f_s=1.0, t_act_b_s=1.0, t_swap_s=0.5)
# Backward = 2 x forward; the ref share is half an actor forward share.
PAPERISH = StageTimes(t_ref_s=0.5, t_act_f_s=1.0, t_act_b_s=2.0, t_swap_s=0.5)


def random_ready(rng: random.Random) -> list[float]:
    n = rng.randint(0, 12)
    return [rng.choice([-3.0, 0.0]) if rng.random() < 0.3 else rng.uniform(0, 40) for _ in range(n)]


def test_1_ras_and_tprm():
    ready = [20.0, 3.0, -5.0, 4.0, 0.0]
    assert ready_at_start(ready) == 2
    assert time_per_ready_microbatch_s(ready) == pytest.approx((20 - 3) / 2)
    assert time_per_ready_microbatch_s([-1.0, 7.0]) == 7.0  # one post-start arrival: its own time
    assert time_per_ready_microbatch_s([-1.0, 0.0]) is None
    rng = random.Random(1)
    for _ in range(200):
        r = random_ready(rng)
        post = sum(1 for a in r if a > 0)
        assert ready_at_start(r) + post == len(r)
        assert (time_per_ready_microbatch_s(r) is None) == (post == 0)
        shuffled = r[:]
        rng.shuffle(shuffled)
        assert time_per_ready_microbatch_s(shuffled) == time_per_ready_microbatch_s(r)


def test_2_empty_and_no_ref():
    assert decoupled_cost_s([], UNIT, 4) == 0.0
    assert colocated_cost_s([], UNIT) == 0.0
    assert decoupled_cost_s([0.0], UNIT, 4, num_ref_ranks=0) == math.inf


def test_3_colocated_hand_timeline_and_bounds():
    # ready [0, 0, 3, 4, 20]; a burst costs swap + k*ref + swap + k*(f+b) = 1 + 3k.
    #   T=0:  k=2 (0, 0)  -> T = 0 + 1 + 6 = 7
    #   T=7:  k=2 (3, 4)  -> T = 7 + 1 + 6 = 14
    #   T=14 < 20: idle  -> T = 20, k=1 -> T = 20 + 1 + 3 = 24
    ready = [0.0, 0.0, 3.0, 4.0, 20.0]
    assert colocated_cost_s(ready, UNIT) == pytest.approx(24.0)
    # Vanilla streaming pays a swap pair per micro-batch: 4, 8, 12, 16, then 20 + 4 = 24.
    assert vanilla_stream_cost_s(ready, UNIT) == pytest.approx(24.0)
    assert vanilla_stream_cost_s([0.0] * 5, UNIT) == pytest.approx(5 * 4.0)
    rng = random.Random(2)
    for _ in range(300):
        r = random_ready(rng)
        if not r:
            continue
        c = colocated_cost_s(r, PAPERISH)
        t = PAPERISH
        assert c >= max(r) + 2 * t.t_swap_s + t.t_ref_s + t.t_act_f_s + t.t_act_b_s - 1e-9
        assert c <= vanilla_stream_cost_s(r, PAPERISH) + 1e-9


def test_4_all_ready_at_start_is_one_burst():
    assert colocated_cost_s([0.0] * 8, UNIT) == pytest.approx(2 * 0.5 + 8 * 3.0)
    # Capped by memory at 3 per burst: bursts of 3, 3, 2.
    assert colocated_cost_s([0.0] * 8, UNIT, max_aggregate=3) == pytest.approx(3 * 1.0 + 8 * 3.0)


def test_5_decoupled_is_the_paper_formula_when_the_ref_keeps_up():
    # M = 2 actors, one ref: fill = sum_{i<2} i*t_ref = 1; period = t_f + t_b = 2 (2*t_ref = 2 keeps up).
    # ready [0, 0, 3, 4, 20]: deltas 0, 0, 3, 1, 16 -> max(., 2): 2 + 2 + 3 + 2 + 16 = 25.
    ready = [0.0, 0.0, 3.0, 4.0, 20.0]
    assert decoupled_cost_s(ready, UNIT, num_actor_ranks=2) == pytest.approx(1 + 25)
    rng = random.Random(5)
    for _ in range(200):
        r = sorted(random_ready(rng))
        m = rng.randint(1, 6)
        t = StageTimes(t_ref_s=0.25, t_act_f_s=0.5, t_act_b_s=1.0, t_swap_s=0.3)  # m * 0.25 <= 1.5
        n0 = ready_at_start(r)
        first = [max(r[n0], 0.0)] if len(r) > n0 else []
        deltas = [0.0] * n0 + first + [r[i] - r[i - 1] for i in range(n0 + 1, len(r))]
        paper = sum(i * t.t_ref_s for i in range(m)) + sum(max(d, t.t_act_f_s + t.t_act_b_s) for d in deltas)
        expected = paper if r else 0.0
        assert decoupled_cost_s(r, t, m) == pytest.approx(expected)
    # The generalisations: a ref that cannot keep up sets the period; two refs halve the fill.
    assert decoupled_cost_s([0.0] * 4, UNIT, num_actor_ranks=4) == pytest.approx((0 + 1 + 2 + 3) + 4 * 4.0)
    assert decoupled_cost_s([0.0] * 4, UNIT, 4, num_ref_ranks=2) == pytest.approx((0 + 0 + 1 + 1) + 4 * 2.0)


def test_6_choice_is_the_cheaper_mode_tie_colocated():
    ready = [0.0, 0.0, 3.0, 4.0, 20.0]
    choice = choose_mode(ready, UNIT, num_actor_ranks=2)
    assert (choice.decoupled_s, choice.colocated_s) == pytest.approx((26.0, 24.0))
    assert choice.mode is Ra2pMode.COLOCATED and choice.ras == 2
    assert choose_mode([0.0] * 8, UNIT, 2, num_ref_ranks=0).mode is Ra2pMode.COLOCATED
    tie = StageTimes(t_ref_s=0.0, t_act_f_s=1.0, t_act_b_s=1.0, t_swap_s=0.0)
    assert choose_mode([0.0], tie, 1).mode is Ra2pMode.COLOCATED  # both 2.0
    rng = random.Random(6)
    for _ in range(200):
        r = random_ready(rng)
        c = choose_mode(r, PAPERISH, rng.randint(1, 8), rng.randint(0, 2))
        assert c.mode is (Ra2pMode.DECOUPLED if c.decoupled_s < c.colocated_s else Ra2pMode.COLOCATED)


def test_7_paper_regimes():
    # Six actors, one ref; per micro-batch: ref 0.5, actor 1 + 2, swap 0.5. Fill = 0.5 * (0+..+5) = 7.5.
    m = 6
    # Large RAS: 16 ready at the start. C_dec = 7.5 + 16 * 3 = 55.5; C_col = 1 + 16 * 3.5 = 57.
    big = choose_mode([0.0] * 16, PAPERISH, m)
    assert (big.decoupled_s, big.colocated_s) == pytest.approx((55.5, 57.0))
    assert big.mode is Ra2pMode.DECOUPLED
    # Short TPRM: nothing at the start, 16 arrivals every 0.5 s.
    #   C_dec = 7.5 + 16 * max(0.5, 3) = 55.5
    #   C_col: T=0.5 k=1 -> 5.0; T=5 k=9 (1.0..5.0) -> 5 + 1 + 31.5 = 37.5; k=6 -> 37.5 + 1 + 21 = 59.5
    fast = choose_mode([0.5 * (i + 1) for i in range(16)], PAPERISH, m)
    assert (fast.decoupled_s, fast.colocated_s) == pytest.approx((55.5, 59.5))
    assert fast.mode is Ra2pMode.DECOUPLED and fast.ras == 0 and fast.tprm_s == pytest.approx(0.5)
    # Small RAS, long TPRM: arrivals at 10, 20, 30.
    #   C_dec = 7.5 + 10 + 10 + 10 = 37.5
    #   C_col: each arrival is its own burst of 1 + 3.5 = 4.5 s, absorbed by the gaps: 30 + 4.5 = 34.5
    slow = choose_mode([10.0, 20.0, 30.0], PAPERISH, m)
    assert (slow.decoupled_s, slow.colocated_s) == pytest.approx((37.5, 34.5))
    assert slow.mode is Ra2pMode.COLOCATED and slow.ras == 0 and slow.tprm_s == pytest.approx(10.0)


def test_8_break_even_ras():
    n = 16
    ras = break_even_ras(PAPERISH, tprm_s=10.0, num_microbatches=n, num_actor_ranks=6)
    assert ras is not None and 0 < ras <= n

    def mode(k: int) -> Ra2pMode:
        ready = [0.0] * k + [10.0 * (i + 1) for i in range(n - k)]
        return choose_mode(ready, PAPERISH, 6).mode

    assert mode(ras) is Ra2pMode.DECOUPLED
    assert all(mode(k) is Ra2pMode.COLOCATED for k in range(ras))
    assert break_even_ras(PAPERISH, 10.0, n, 6, num_ref_ranks=0) is None


def test_9_zigzag_dispatch():
    assert zigzag_dispatch([10, 9, 8, 7, 6, 5], 3) == ((0, 5), (1, 4), (2, 3))  # loads 15, 15, 15
    rng = random.Random(9)
    for _ in range(300):
        lengths = [rng.randint(1, 8192) for _ in range(rng.randint(0, 40))]
        m = rng.randint(1, 8)
        ranks = zigzag_dispatch(lengths, m)
        assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))
        counts = [len(r) for r in ranks]
        assert max(counts) - min(counts) <= 1
        loads = [sum(lengths[i] for i in r) for r in ranks]
        assert max(loads) - min(loads) <= max(lengths, default=0)


def test_10_smallest_last_microbatches():
    lengths = [5000, 3000, 3000, 2000, 800, 600, 100]
    # Tail: the two shortest (600, 100), shortest last. Body, first-fit decreasing into 8,192:
    # [5000, 3000] = 8000, then [3000, 2000, 800] = 5800.
    assert smallest_last_microbatches(lengths, 8192, 2) == ((0, 1), (2, 3, 4), (5, 6))
    rng = random.Random(10)
    for _ in range(300):
        lengths = [rng.randint(1, 9000) for _ in range(rng.randint(1, 40))]
        cap, m = rng.choice([4096, 8192, 16384]), rng.randint(1, 8)
        mbs = smallest_last_microbatches(lengths, cap, m)
        flat = [i for mb in mbs for i in mb]
        assert sorted(flat) == list(range(len(lengths)))
        for mb in mbs:
            assert len(mb) == 1 or sum(lengths[i] for i in mb) <= cap
        body = [sum(lengths[i] for i in mb) for mb in mbs[:-1]]
        assert body == sorted(body, reverse=True)
        assert len(mbs[-1]) <= m
        assert lengths[flat[-1]] == min(lengths)


def test_mode_names_are_the_config_and_store_strings():
    import typing

    from tiderl.config.trainer import TrainerConfig

    configured = typing.get_args(typing.get_type_hints(TrainerConfig)["ra2p_mode"])
    assert {m.value for m in Ra2pMode} == set(configured) - {"auto"}
    for mode in Ra2pMode:
        assert Ra2pMode.parse(mode.value) is mode and mode == mode.value  # stored and compared as plain text
    with pytest.raises(ValueError, match="unknown RA2P mode 'fast' .*known: decoupled, colocated"):
        Ra2pMode.parse("fast")
