"""The rate-matching ERS planner (tiderl.policy.ers.model and tiderl.policy.ers.choose): one test per invariant of
the choice in docs/ers.md."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tiderl.config.ers import ErsConfig
from tiderl.policy.ers import ErsLimits, ErsPolicy, ErsReason, ErsSignals, StepObservation, plan
from tiderl.policy.ers.choose import candidates, regime
from tiderl.policy.ers.model import (Split, estimate, gen_latency_at, gen_latency_curve, host_factor, latency_s,
                                     predict_tok_s, slot_tok_s, split_of, step_compute_s)
from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import Ra2pMode, StageTimes
from tiderl.roles import Role

R, A, F = Role.ROLLOUT, Role.ACTOR, Role.REF
TIMES = StageTimes(t_ref_s=0.1, t_act_f_s=0.2, t_act_b_s=0.4, t_swap_s=0.01)
LIMITS = ErsLimits(groups_min=2, groups_ideal=4, policy=ErsPolicy.RATE, max_staleness=1)
ELASTIC = replace(LIMITS, elastic_actors=True)


def obs(rollout: int, actors: int, refs: int = 0, *, latency_s: float = 20.0, env_s: float = 10.0,
        wait_s: float = 0.0, idle_rank_s: float = 0.0, duration_s: float = 10.0) -> StepObservation:
    return StepObservation(version=10, duration_s=duration_s, consumed_tokens=4000, rollout_ranks=rollout, actor_ranks=actors,
                           ref_ranks=refs, produced_tokens=4000, groups_completed=4,
                           group_latency_sum_s=4 * latency_s, group_env_sum_s=4 * env_s,
                           rollout_idle_rank_s=idle_rank_s, rollout_busy_rank_s=rollout * duration_s - idle_rank_s,
                           trainer_wait_s=wait_s)


def signals(*window: StepObservation, times: StageTimes | None = TIMES) -> ErsSignals:
    groups = sum(s.groups_completed for s in window)
    return ErsSignals(ras_microbatches=0, ready_groups=4, hol_latency_s=0.0, tprm_s=None,
                      step_history_s=tuple(s.duration_s for s in window), stage_times=times,
                      microbatches_per_step=8, window=window, micro_batch_tokens=250,
                      group_latency_s=sum(s.group_latency_sum_s for s in window) / groups,
                      group_env_s=sum(s.group_env_sum_s for s in window) / groups, tokens_per_group=1000.0)


# A generation-bound run (the trainer waits half of each step) and a trainer-bound one.
SHORT = signals(obs(2, 2, wait_s=5.0, latency_s=60.0), obs(2, 2, wait_s=5.0, latency_s=60.0))
SLOW_TRAINER = signals(obs(4, 2, idle_rank_s=20.0, latency_s=8.0, env_s=6.0),
                       obs(4, 2, idle_rank_s=20.0, latency_s=8.0, env_s=6.0))
ALL = [SHORT, SLOW_TRAINER, signals(obs(3, 3)), signals(obs(3, 3), times=None)]
MAPS = [(R, R, A, A), (R, R, R, R, A, A), (R, R, R, F, A, A, A), (R, F, A)]


def count(roles, role) -> int:
    return sum(1 for r in roles if r is role)


@pytest.mark.parametrize("limits", [LIMITS, ELASTIC, replace(LIMITS, max_moves_per_step=2),
                                    replace(ELASTIC, max_rollout_moves_per_step=3)])
@pytest.mark.parametrize("roles", MAPS)
@pytest.mark.parametrize("sig", ALL)
def test_1_the_general_invariants_hold(roles, sig, limits):
    p = plan(roles, sig, limits)
    assert len(p.roles) == len(roles)
    assert (p.mode is Ra2pMode.DECOUPLED) == (F in p.roles)
    if p.reason is ErsReason.RATE_REPARTITION:  # the trainer's ranks divided anew: all at once, rollout kept
        assert limits.elastic_actors and count(p.roles, R) == count(roles, R)
        assert {(m.from_role, m.to_role) for m in p.moves} <= {(A, F), (F, A)}
    else:
        model = estimate(sig, limits)
        allowed = {(R, F), (F, R), (R, A), (A, R)}
        to_rollout = sum(1 for m in p.moves if m.to_role is R)
        # Invariant 3: within the move limits; a rank may pass through rollout between ref and actor.
        assert to_rollout <= limits.rollout_moves and len(p.moves) - to_rollout <= limits.max_moves_per_step
        if p.moves and count(p.roles, R) == count(roles, R) and limits.elastic_actors:
            allowed |= {(A, F), (F, A)}
        assert {(m.from_role, m.to_role) for m in p.moves} <= allowed
    assert [m.rank for m in p.moves] == [i for i, (a, b) in enumerate(zip(roles, p.roles)) if a is not b]
    assert count(p.roles, R) >= limits.min_rollout_ranks
    if not limits.elastic_actors:
        assert count(p.roles, A) == count(roles, A)
    assert count(p.roles, A) >= min(limits.min_actor_ranks, count(roles, A))
    assert plan(roles, sig, limits) == plan(list(roles), sig, limits)  # pure


def test_2_no_move_without_a_gain_above_the_margin_or_without_measurements():
    empty = replace(SHORT, window=())
    assert plan((R, R, A, A), empty, ELASTIC).moves == ()
    moved = plan((R, R, A, A), SHORT, ELASTIC)
    assert moved.moves  # the gain is real at a margin of 5%...
    huge = replace(ELASTIC, rate_margin=10.0)
    assert plan((R, R, A, A), SHORT, huge).moves == () and plan((R, R, A, A), SHORT, huge).reason is ErsReason.STEADY


def test_3_moves_go_toward_the_best_split():
    p = plan((R, R, A, A), SHORT, ELASTIC)  # generation-bound: the best split has more rollout
    assert p.reason is ErsReason.RATE_TO_ROLLOUT and count(p.roles, R) == 3
    q = plan((R, R, R, R, A, A), SLOW_TRAINER, ELASTIC)  # trainer-bound: more trainer ranks
    assert q.reason is ErsReason.RATE_TO_TRAINER and count(q.roles, R) == 3
    # The model agrees: the chosen split predicts more goodput than staying.
    for sig, old, new in ((SHORT, Split(2, 2, 0), Split(3, 1, 0)), (SLOW_TRAINER, Split(4, 2, 0), Split(3, 3, 0))):
        model = estimate(sig, ELASTIC)
        assert predict_tok_s(new, model)[2] > predict_tok_s(old, model)[2]


# Two ref ranks feed eight actors; the best split (3/8/0) lies one move through 2/8/1, where one ref feeds them all.
VALLEY = (replace(signals(*[obs(1, 8, 2, latency_s=7.8, env_s=2.1)] * 2,
                          times=StageTimes(t_ref_s=0.235, t_act_f_s=0.34, t_act_b_s=0.69, t_swap_s=0.06)),
                  gen_latency_by_rollout=((3, 4.0),)), (R, F, F) + (A,) * 8)


@pytest.mark.parametrize("case", [(sig, roles, limits) for sig in ALL for roles in MAPS for limits in (LIMITS, ELASTIC)]
                         + [(*VALLEY, ELASTIC), (*VALLEY, replace(ELASTIC, max_moves_per_step=2))])
def test_9_a_split_move_reaches_a_split_predicted_no_slower_than_the_current_one(case):
    sig, roles, limits = case
    p = plan(roles, sig, limits)
    if p.reason in (ErsReason.RATE_TO_ROLLOUT, ErsReason.RATE_TO_TRAINER, ErsReason.RATE_REBALANCE):
        model = estimate(sig, limits)
        assert predict_tok_s(split_of(p.roles), model)[2] >= predict_tok_s(split_of(roles), model)[2]


def test_9_where_the_best_target_lies_past_a_valley_the_plan_takes_the_next_best_or_repartitions():
    sig, roles = VALLEY
    model = estimate(sig, ELASTIC)
    assert predict_tok_s(Split(2, 8, 1), model)[2] < predict_tok_s(Split(1, 8, 2), model)[2]  # the valley
    p = plan(roles, sig, ELASTIC)
    assert p.reason is ErsReason.RATE_REPARTITION and split_of(p.roles) == Split(1, 10, 0)  # all refs at once
    # Two moves a boundary cross it: 3/8/0 at once.
    assert split_of(plan(roles, sig, replace(ELASTIC, max_moves_per_step=2)).roles) == Split(3, 8, 0)


def test_3_rollout_ranks_the_window_measured_idle_may_all_leave_at_one_boundary():
    roles = (R,) * 7 + (A,)  # one actor, seven rollout ranks: the planner's best split is 4/4/0

    def far(idle_ranks: float) -> ErsSignals:
        return signals(*[obs(7, 1, idle_rank_s=idle_ranks * 10.0, latency_s=4.0, env_s=3.0)] * 2)

    model = estimate(far(6.0), ELASTIC)
    best = max(candidates(Split(7, 1, 0), ELASTIC, model.stage_times), key=lambda s: predict_tok_s(s, model)[2])
    assert best == Split(4, 4, 0)
    # Six ranks idle on average: the three moves to the target at once, all rollout -> actor.
    p = plan(roles, far(6.0), ELASTIC)
    assert p.reason is ErsReason.RATE_TO_TRAINER and split_of(p.roles) == best
    assert {(m.from_role, m.to_role) for m in p.moves} == {(R, A)}
    # Two whole ranks idle: two moves; half a rank: the bound's one; the rule ablated: one.
    assert split_of(plan(roles, far(2.5), ELASTIC).roles) == Split(5, 3, 0)
    assert split_of(plan(roles, far(0.5), ELASTIC).roles) == Split(6, 2, 0)
    assert split_of(plan(roles, far(6.0), replace(ELASTIC, ablate=frozenset({"idle_moves"}))).roles) == Split(6, 2, 0)
    # Walking (the current split not yet measured), the bound holds whatever an earlier split idled.
    walking = replace(far(6.0), window=(), walk=far(6.0), last_rollout_change=-1)
    assert len(plan(roles, walking, ELASTIC).moves) <= 1


def test_4_the_measured_regime_overrides_the_model():
    assert regime(SHORT) == "supply" and regime(SLOW_TRAINER) == "idle"
    # A model that would take rollout ranks away while the trainer starves is overruled: a window whose
    # latency says "more trainer" (tiny generation share) but whose trainer waited half the time.
    starving = signals(obs(3, 3, wait_s=5.0, latency_s=10.0, env_s=9.9), obs(3, 3, wait_s=5.0, latency_s=10.0, env_s=9.9))
    assert regime(starving) == "supply"
    assert count(plan((R, R, R, A, A, A), starving, ELASTIC).roles, R) >= 3
    idle = signals(obs(4, 2, idle_rank_s=20.0, latency_s=100.0, env_s=0.0), obs(4, 2, idle_rank_s=20.0,
                                                                             latency_s=100.0, env_s=0.0))
    assert regime(idle) == "idle"
    assert count(plan((R, R, R, R, A, A), idle, ELASTIC).roles, R) <= 4


def test_5_ref_ranks_only_while_the_refs_cannot_keep_up():
    heavy_ref = StageTimes(t_ref_s=0.5, t_act_f_s=0.2, t_act_b_s=0.4, t_swap_s=0.3)
    sig = replace(SLOW_TRAINER, stage_times=heavy_ref)
    p = plan((R, R, R, R, A, A), sig, replace(LIMITS, ablate=frozenset({"idle_moves"})))
    assert p.moves and count(p.roles, F) == 1 and p.mode is Ra2pMode.DECOUPLED  # fixed actors: refs the only way up
    # The window's two idle rollout ranks both go (idle_moves): one ref per actor keeps up with these stage times.
    assert split_of(plan((R, R, R, R, A, A), sig, LIMITS).roles) == Split(2, 2, 2)
    # One ref keeps up with two actors here (2 x 0.1 <= 0.6): a second one would idle.
    q = plan((R, R, R, F, A, A), SLOW_TRAINER, replace(LIMITS, max_moves_per_step=3))
    assert count(q.roles, F) <= 1


def test_6_the_fetch_size_is_always_the_ideal_batch():
    for sig in ALL:
        for roles in MAPS:
            assert plan(roles, sig, ELASTIC).fetch_groups == ELASTIC.groups_ideal


def test_latency_grows_as_rollout_ranks_shrink_and_the_environment_part_stays():
    model = estimate(SHORT, ELASTIC)  # one split measured: 50 s beyond the env on 2 ranks
    assert latency_s(2, model) == pytest.approx(60.0)
    assert latency_s(1, model) == pytest.approx(10.0 + 50.0 * 2)  # fewer ranks: fully scaling
    assert latency_s(4, model) == pytest.approx(10.0 + 50.0 * (0.5 + 0.5 * 2 / 4))  # more: half of it
    # Little's law: (s + 1/2) x B x tokens per group over the time a group holds its place: the latency,
    # the trainer's tail (a swap pair, ref, forward, backward of the last share) and overhead (none here).
    assert model.overhead_s == 0.0
    assert predict_tok_s(Split(2, 2, 0), model)[0] == pytest.approx(1.5 * 4 * 1000.0 / (60.0 + 0.72))
    assert predict_tok_s(Split(2, 1, 1), model)[0] == pytest.approx(1.5 * 4 * 1000.0 / (60.0 + 0.1 + 0.6))


def test_measured_splits_are_read_as_measured_and_interpolated_in_one_over_n():
    curve = gen_latency_curve(((1, 120.0), (4, 20.0)), 2, 40.0)
    assert curve == ((1, 120.0), (2, 40.0), (4, 20.0))
    assert gen_latency_at(1, curve) == 120.0  # a split tried and found slow stays slow
    assert gen_latency_at(3, curve) == pytest.approx(20.0 + (1 / 3 - 1 / 4) / (1 / 2 - 1 / 4) * 20.0)
    # Beyond the most ranks measured: the slope of the two largest counts (40 s on 2, 20 s on 4: 80 / n).
    assert gen_latency_at(8, curve) == pytest.approx(10.0)
    assert gen_latency_at(8, ((2, 20.0), (4, 30.0))) == pytest.approx(30.0)  # never rising with more ranks
    assert gen_latency_at(8, ((4, 20.0),)) == pytest.approx(20.0 * (0.5 + 0.5 * 4 / 8))  # one count: the prior
    model = estimate(replace(SHORT, gen_latency_by_rollout=((1, 200.0),)), ELASTIC)
    assert latency_s(1, model) == pytest.approx(210.0)
    assert count(plan((R, R, A, A), replace(SHORT, gen_latency_by_rollout=((1, 200.0),)), ELASTIC).roles, R) >= 2


# ---- a shared host (tiderl.policy.host): idle ranks -------------------------------------------------------
I = Role.IDLE
HOST = HostShare(slots=1.0, rollout_weight=1.6)
SHARED = replace(LIMITS, host=HOST)
# Two rollout ranks busy 60% of the time, a rank's worth idling, the trainer busy 80%: the `idle` regime.
IDLING = signals(*[replace(obs(2, 1, idle_rank_s=10.0, wait_s=2.0), rollout_busy_rank_s=6.0)] * 2)


def test_7_without_a_shared_host_no_rank_is_left_idle_and_idle_ranks_only_return():
    assert regime(IDLING) == "idle"
    assert all(s.idle == 0 for s in candidates(Split(2, 1, 0, 1), LIMITS, TIMES))
    for roles in [(R, R, A, I), (R, R, A), (R, I, A, I)]:
        p = plan(roles, IDLING, LIMITS)
        assert {(m.from_role, m.to_role) for m in p.moves} <= {(R, F), (F, R), (I, R)}
    assert host_factor(Split(1, 1, 0, 1), estimate(IDLING, LIMITS)) == 1.0


def test_7_on_a_shared_host_an_unmeasured_rollout_count_is_tried_with_a_rank_left_idle():
    p = plan((R, R, A), IDLING, SHARED)
    assert p.reason is ErsReason.RATE_TO_IDLE
    assert [(m.from_role, m.to_role) for m in p.moves] == [(R, I)] and count(p.roles, R) == 1
    assert p.mode is Ra2pMode.COLOCATED
    # Never below min_rollout_ranks, and never while the trainer waits (generation is short).
    assert plan((R, A, I), replace(IDLING, window=tuple(replace(s, rollout_ranks=1) for s in IDLING.window)),
                SHARED).moves == ()
    short = signals(*[replace(obs(2, 1, wait_s=5.0), rollout_busy_rank_s=18.0)] * 2)
    assert plan((R, R, A), short, SHARED).reason is not ErsReason.RATE_TO_IDLE


def test_7_a_measured_idle_split_is_judged_by_its_measurement():
    # One rollout rank was measured: generation latency beyond the environment's of 30 s against 10 s with
    # two. The planner does not try it again; back at two ranks it stays, at one it returns to two.
    curve = ((1, 30.0), (2, 10.0))
    at_two = replace(IDLING, gen_latency_by_rollout=curve)
    assert plan((R, R, A), at_two, SHARED).moves == ()
    one = replace(obs(1, 1, latency_s=40.0, wait_s=4.0), rollout_busy_rank_s=9.0)
    at_one = replace(signals(one, one), gen_latency_by_rollout=curve)
    back = plan((R, A, I), at_one, SHARED)
    assert [(m.from_role, m.to_role) for m in back.moves] == [(I, R)]


def test_7_host_speed_moves_the_prediction_both_ways():
    model = estimate(IDLING, SHARED)
    fewer = host_factor(Split(1, 1, 0, 1), model)  # the same busy engine-time on one engine: no faster
    more = host_factor(Split(3, 1, 0, 0), model)  # a third engine spreads the work: slower
    assert fewer == pytest.approx(1.0) and more < 1.0
    busier = host_factor(Split(1, 2, 0, 0), replace(model, busy_rollout=1.0))
    assert busier < 1.0  # a further busy trainer rank slows everyone
    s_now = predict_tok_s(Split(2, 1, 0, 0), model)
    s_more = predict_tok_s(Split(3, 1, 0, 0), model)
    assert s_more[1] < s_now[1]  # the trainer is slower beside a third engine


def test_7_a_rollout_rank_holding_tasks_is_busy_on_the_host_while_its_engine_waits():
    # Engines generating a tenth of the time, but both ranks hold tasks throughout (they wait on their
    # environment): both load the host (turns, environment calls), as the simulator's shared host counts them.
    holding = replace(obs(2, 1, wait_s=2.0), rollout_busy_rank_s=2.0)
    assert estimate(signals(holding, holding), SHARED).busy_rollout == pytest.approx(2.0)
    # One of them with no task at all for the whole window: one rank on the host.
    one_empty = replace(holding, rollout_idle_rank_s=10.0)
    assert estimate(signals(one_empty, one_empty), SHARED).busy_rollout == pytest.approx(1.0)


def test_cold_start_on_a_shared_host_fills_only_the_room_the_host_has():
    cold = ErsSignals(ras_microbatches=0, ready_groups=0, hol_latency_s=0.0, tprm_s=None)
    # One slot, a rollout rank weighing 1.6: one engine already fills the host; the ref rank idles.
    p = plan((R, A, F), cold, SHARED)
    assert p.roles == (R, A, I) and p.reason is ErsReason.COLD_START and p.mode is Ra2pMode.COLOCATED
    assert plan((R, A, I), cold, SHARED).roles == (R, A, I)
    # Four slots, weight 1: up to four rollout ranks run at full speed.
    roomy = replace(SHARED, host=HostShare(slots=4.0, rollout_weight=1.0))
    assert plan((R, A, F, I, I, F), cold, roomy).roles == (R, A, R, R, R, I)
    # Without a shared host every ref and idle rank rolls out (the paper's rule).
    assert plan((R, A, F, I), cold, LIMITS).roles == (R, A, R, R)


def test_7_no_idle_trial_that_would_leave_the_groups_in_flight_without_task_slots():
    # (1 + 1) x 4 groups of 8 tasks in flight: one rank playing 64 tasks holds them, one playing 32 does not.
    roomy = replace(SHARED, rank_tasks=64, group_size=8)
    assert plan((R, R, A), IDLING, roomy).reason is ErsReason.RATE_TO_IDLE
    tight = replace(SHARED, rank_tasks=32, group_size=8)
    assert plan((R, R, A), IDLING, tight).reason is not ErsReason.RATE_TO_IDLE
    with pytest.raises(ValueError, match="rank_tasks"):
        replace(SHARED, rank_tasks=0)


# Generation-bound on 2 rollout and 4 actor ranks: the model's best split is 5 rollout ranks, three moves away.
MEASURED_2_4 = signals(obs(2, 4, wait_s=6.0, latency_s=80.0, env_s=5.0), obs(2, 4, wait_s=6.0, latency_s=80.0, env_s=5.0))


def walking(measured: ErsSignals, change: int, idle: float = 0.0) -> ErsSignals:
    """The signals one step after a plan moved `change` rollout ranks: the new split is not measured yet."""
    return replace(measured, window=(), group_latency_s=None, group_env_s=None, walk=measured,
                   last_rollout_change=change, rollout_idle_ranks=idle)


def test_10_a_walk_goes_on_toward_the_predicted_split_one_rank_a_step():
    first = plan((R, R, A, A, A, A), MEASURED_2_4, ELASTIC)
    assert first.reason is ErsReason.RATE_TO_ROLLOUT and count(first.roles, R) == 3
    second = plan(first.roles, walking(MEASURED_2_4, +1), ELASTIC)  # 3/3 not measured: go on, one rank
    assert second.reason is ErsReason.RATE_TO_ROLLOUT and count(second.roles, R) == 4 and len(second.moves) == 1
    # Without a walk the unmeasured split waits for its measurement (invariant 2).
    assert plan(first.roles, replace(walking(MEASURED_2_4, +1), walk=None), ELASTIC).moves == ()


def test_10_a_walk_never_turns_on_an_unmeasured_split_nor_grows_rollout_that_idles():
    roles = (R, R, R, A, A, A)
    back = plan(roles, walking(MEASURED_2_4, -1), ELASTIC)  # the previous plan went the other way
    assert back.moves == () and back.reason is ErsReason.STEADY
    assert plan(roles, walking(MEASURED_2_4, 0), ELASTIC).moves == ()  # the previous plan moved no rollout rank
    idle = plan(roles, walking(MEASURED_2_4, +1, idle=1.0), ELASTIC)  # the last step idled a rollout rank
    assert idle.moves == () and idle.reason is ErsReason.STEADY
    # At the predicted best the walk ends: no move, whatever the direction.
    assert plan((R, R, R, R, R, A), walking(MEASURED_2_4, +1), ELASTIC).moves == ()


def test_10_a_walk_moves_within_the_margin_and_the_move_limit():
    roles = (R, R, R, A, A, A)
    assert plan(roles, walking(MEASURED_2_4, +1), replace(ELASTIC, rate_margin=10.0)).moves == ()
    two = plan(roles, walking(MEASURED_2_4, +1), replace(ELASTIC, max_moves_per_step=2))
    assert len(two.moves) == 2 and count(two.roles, R) == 5


def test_3_moves_to_rollout_may_have_their_own_limit():
    """`max_rollout_moves_per_step` bounds the moves to rollout apart from the trainer's scale-up (the paper
    bounds only the latter to one rank a step)."""
    roles = (R, R, R, A, A, A)
    one = plan(roles, walking(MEASURED_2_4, +1), ELASTIC)
    assert len(one.moves) == 1
    two = plan(roles, walking(MEASURED_2_4, +1), replace(ELASTIC, max_rollout_moves_per_step=2))
    assert len(two.moves) == 2 and {m.to_role for m in two.moves} == {R} and count(two.roles, R) == 5
    # The trainer's scale-up keeps max_moves_per_step.
    q = plan((R, R, R, R, A, A), SLOW_TRAINER, replace(ELASTIC, max_rollout_moves_per_step=3))
    assert q.reason is ErsReason.RATE_TO_TRAINER and len(q.moves) == 1
    with pytest.raises(ValueError, match="max_rollout_moves_per_step"):
        replace(ELASTIC, max_rollout_moves_per_step=0)


def test_a_step_bound_by_arrivals_keeps_its_duration_and_the_others_take_the_splits_compute():
    """Steps priced one by one (the module docstring's goodput): in a window alternating between a step
    the trainer waited out (bound by arrivals) and one it worked through (bound by its compute), more actor
    ranks shorten only the second kind, and the prediction says so where the window's means would not."""
    alternating = signals(obs(2, 2, wait_s=6.0, duration_s=16.0), obs(2, 2, wait_s=0.0, duration_s=8.0),
                          obs(2, 2, wait_s=6.0, duration_s=16.0), obs(2, 2, wait_s=0.0, duration_s=8.0))
    model = estimate(alternating, LIMITS)
    assert model is not None and len(model.window) == 4
    two, three = predict_tok_s(Split(2, 2, 0), model), predict_tok_s(Split(2, 3, 0), model)
    assert two[0] == three[0] or abs(two[0] - three[0]) < 0.05 * two[0]  # about the same supply
    step_two = model.limits.groups_ideal * model.tokens_per_group / two[1]
    # The waited steps keep their 16 s (the same supply); the others take the 2-actor compute and overhead.
    assert step_two > (16.0 + 0.0) / 2
    assert three[1] > two[1]  # more actors: the compute-bound steps shorten
    # A window with no wait prices every step at the split's compute: demand scales as before.
    busy = estimate(signals(obs(2, 2), obs(2, 2)), LIMITS)
    assert busy is not None
    assert predict_tok_s(Split(2, 3, 0), busy)[1] > predict_tok_s(Split(2, 2, 0), busy)[1]
    # Fewer rollout ranks than the window's slow the arrivals of the waited steps in proportion.
    one = predict_tok_s(Split(1, 2, 0), model)
    assert one[1] < two[1]


def test_a_split_is_priced_with_the_readiness_each_window_step_measured():
    """The module docstring's consumption: each window step regrouped for the split's actors with the readiness
    it measured; its own split keeps the measured step times, a colocated split pays a swap pair for every burst
    the arrivals make, a decoupled one does not."""
    times = StageTimes(t_ref_s=0.5, t_act_f_s=0.5, t_act_b_s=1.0, t_swap_s=2.0)
    # 2,000 tokens on 4 actors of 250-token shares: 2 micro-batches, arriving at 4 and 8 s; 19 s a step.
    step = replace(obs(2, 4, duration_s=19.0, wait_s=3.0), consumed_tokens=2000, tprm_s=4.0)
    model = estimate(signals(step, step, times=times), ELASTIC)
    assert model is not None
    # Colocated, the readiness makes two bursts of 2 + 0.5 + 2 + 1.5 = 6 s (4-10 s and 10-16 s): its waits
    # (8 s beyond the one burst of an all-ready step) hold the 3 s measured; the other 3 s are the rest.
    assert model.waits_s == (0.0, 0.0) and model.overhead_s == pytest.approx(3.0)
    assert predict_tok_s(Split(2, 4, 0), model)[1] == pytest.approx(2000 / 19.0)  # as measured
    # One actor as a ref rank: 3 micro-batches of 750 tokens at 3, 6 and 9 s, each done 3 s later (the ref's
    # 3 shares, then the actor's 1.5 s): 12 s, no swap pair, 15 s a step with the rest; its shorter tail
    # (the last micro-batch's work) raises the supply, so the arrivals come `slower` times later.
    (s_now, _, _), (s_new, d_new, _) = predict_tok_s(Split(2, 4, 0), model), predict_tok_s(Split(2, 3, 1), model)
    slower = s_now / s_new
    assert slower < 1.0
    assert step_compute_s([3.0, 6.0, 9.0], 3, 1, times) == pytest.approx(12.0)
    assert d_new == pytest.approx(2000 / (step_compute_s([3.0 * slower, 6.0 * slower, 9.0 * slower], 3, 1, times) + 3.0))
    assert d_new > 2000 / 15.0 > 2000 / 19.0
    # The same tokens all ready at the start: one burst (8 s) and 3 s of waits the readiness does not show,
    # arrivals' (scaled with the supply); the rest is 19 - 8 - 3.
    ready = replace(step, tprm_s=None)
    model = estimate(signals(ready, ready, times=times), ELASTIC)
    assert model is not None and model.waits_s == (3.0, 3.0) and model.overhead_s == pytest.approx(8.0)
    assert predict_tok_s(Split(2, 4, 0), model)[1] == pytest.approx(2000 / 19.0)


def test_a_split_with_ref_ranks_pays_the_decoupled_steps_coordination_and_one_without_is_spared_it():
    times = StageTimes(t_ref_s=0.5, t_act_f_s=0.5, t_act_b_s=1.0, t_swap_s=2.0)
    step = replace(obs(2, 4, duration_s=19.0, wait_s=3.0), consumed_tokens=2000, tprm_s=4.0)
    coordinated = replace(ELASTIC, decoupled_step_s=2.0)
    # A colocated window: its own split is priced as measured; the decoupled one pays 2 s more a step.
    free, paid = (estimate(signals(step, step, times=times), lim) for lim in (ELASTIC, coordinated))
    assert predict_tok_s(Split(2, 4, 0), paid)[1] == pytest.approx(2000 / 19.0)
    slower = predict_tok_s(Split(2, 4, 0), paid)[0] / predict_tok_s(Split(2, 3, 1), paid)[0]
    assert predict_tok_s(Split(2, 3, 1), paid)[1] == pytest.approx(
        2000 / (step_compute_s([3.0 * slower, 6.0 * slower, 9.0 * slower], 3, 1, times) + 3.0 + 2.0))
    assert predict_tok_s(Split(2, 3, 1), paid)[0] < predict_tok_s(Split(2, 3, 1), free)[0]  # groups held longer
    # A decoupled window measured with its coordination in: its own split as measured, a colocated one without.
    dec = replace(step, actor_ranks=3, ref_ranks=1)
    free, paid = (estimate(signals(dec, dec, times=times), lim) for lim in (ELASTIC, coordinated))
    assert predict_tok_s(Split(2, 3, 1), paid)[1] == pytest.approx(predict_tok_s(Split(2, 3, 1), free)[1])
    assert predict_tok_s(Split(2, 4, 0), paid)[1] > predict_tok_s(Split(2, 4, 0), free)[1]
    assert ErsLimits.from_config(ErsConfig(decoupled_step_s=0.13), 2, 4).decoupled_step_s == 0.13
    with pytest.raises(ValueError, match="decoupled_step_s"):
        replace(ELASTIC, decoupled_step_s=-1.0)


def test_describe_shows_a_split_as_the_planner_prices_it_in_trajectory_tokens():
    from tiderl.policy.ers.model import describe, predict_tok_s, split_of

    roles = (R, R, A, A)
    seen = describe(SHORT, ELASTIC, roles)
    supply, demand, trained = predict_tok_s(split_of(roles), estimate(SHORT, ELASTIC))
    assert seen == {"supply_tok_s": supply, "demand_tok_s": demand, "predicted_trained_tok_s": trained}
    assert trained == min(supply, demand) > 0
    assert describe(replace(SHORT, window=()), ELASTIC, roles) is None  # nothing measured yet


# ---- full task slots ------------------------------------------------------------------------------------
SLOTTED = replace(LIMITS, rank_tasks=8, group_size=8)  # a rollout rank plays one group at a time


def slotted(rollout: int, *, slot_s: float = 2.5, env_s: float = 2.0) -> StepObservation:
    """A 10 s step whose 4 groups (32 tasks) each spent `slot_s` in a slot, `env_s` of it the environment's,
    after 1.5 s waiting for it; group latency 12 s, 10 s of it the slowest task's environment; the trainer
    waited half the step."""
    return replace(obs(rollout, 2, 1, latency_s=12.0, env_s=10.0, wait_s=5.0),
                   tasks_completed=32, task_env_sum_s=32 * env_s, task_slot_sum_s=32 * slot_s, task_wait_sum_s=32 * 1.5)


def test_11_a_split_supplies_at_most_what_its_task_slots_play():
    # One rank's 8 slots, each task 2.5 s in one: 3.2 tasks, 400 tokens a second; two ranks 800.
    window = (slotted(1), slotted(1))
    sig = replace(signals(*window), slot_wait_s=1.5, gen_latency_by_rollout=((1, 0.5),))
    model = estimate(sig, SLOTTED)
    assert (model.task_slot_s, model.task_env_s) == (pytest.approx(2.5), pytest.approx(2.0))
    assert slot_tok_s(1, model) == pytest.approx(400.0) and slot_tok_s(2, model) == pytest.approx(800.0)
    assert slot_tok_s(1, model, 0.5) == pytest.approx(8 * 1000 / 8 / 3.0)  # only the non-environment part slows
    # The staleness bound would let one rank's groups go faster (the slot wait is out of its latency):
    # the slots bind, and a second rollout rank is worth a move.
    assert predict_tok_s(Split(1, 2, 1), model)[0] == pytest.approx(400.0)
    assert predict_tok_s(Split(2, 2, 0), model)[0] > 1.3 * 400.0
    p = plan((R, F, A, A), sig, SLOTTED)
    assert [(m.from_role, m.to_role) for m in p.moves] == [(F, R)] and p.reason is ErsReason.RATE_TO_ROLLOUT
    # Without a slot measurement the same latencies read as the engines': 12 s against 11.5 s with two
    # ranks, below the margin, so no move.
    bare = signals(*[obs(1, 2, 1, latency_s=12.0, env_s=10.0, wait_s=5.0)] * 2)
    assert estimate(bare, SLOTTED).task_slot_s is None and slot_tok_s(1, estimate(bare, SLOTTED)) == float("inf")
    assert plan((R, F, A, A), bare, SLOTTED).moves == ()
    # No slot bound (rank_tasks unknown): the slots never cap a split.
    assert slot_tok_s(1, estimate(sig, LIMITS)) == float("inf")


def evaluation_signals(*seen: StepObservation) -> ErsSignals:
    window = (obs(2, 4, latency_s=20.0, env_s=10.0), obs(2, 4, latency_s=20.0, env_s=10.0))
    return replace(signals(*window), is_eval_next=True, evaluation_steps=seen)


def test_15_an_evaluation_takes_the_actors_its_measured_steps_predict_to_pay():
    from tiderl.policy.ers.overrides import evaluation_step_s

    # The last evaluation step took 100 s at 2 rollout / 4 actor ranks, the rollout ranks busy throughout (a
    # 100 s span) and the actors waiting 70 s of it: 30 s of work.
    seen = replace(obs(2, 4, duration_s=100.0, wait_s=70.0), evaluation=True)
    sig = evaluation_signals(seen)
    roles = (R, R, A, A, A, A)

    def expected(rollout: int, actors: int) -> float:
        # The span divides among the rollout ranks (the round's tasks keep every rank busy), the work among
        # the actor ranks, and the two overlap.
        return max(100.0 * 2 / rollout, 30.0 * 4 / actors)

    assert evaluation_step_s(roles, sig, ELASTIC) == pytest.approx(100.0)
    for rollout in (3, 4, 5):
        assert evaluation_step_s((R,) * rollout + (A,) * (6 - rollout), sig, ELASTIC) == pytest.approx(
            expected(rollout, 6 - rollout))
    best = min((3, 4, 5), key=lambda n: expected(n, 6 - n))
    assert best == 4 and expected(best, 6 - best) * 1.05 < 100.0
    p = plan(roles, sig, ELASTIC)
    assert p.reason is ErsReason.EVALUATION and count(p.roles, R) == best and p.roles[:best] == (R,) * best
    # A second count measured: between the two the span is linear in 1 / n; the newest step's work counts.
    at4 = replace(obs(4, 2, duration_s=70.0, wait_s=10.0), evaluation=True)
    span3 = 70.0 + (100.0 - 70.0) * (1 / 3 - 1 / 4) / (1 / 2 - 1 / 4)
    assert evaluation_step_s((R, R, R, A, A, A), evaluation_signals(seen, at4), ELASTIC) == pytest.approx(
        max(span3, 60.0 * 2 / 3))
    # A busy trainer in the evaluation step (it waited 10 s of 100): no actor pays; the preemptive rule's plan.
    busy = evaluation_signals(replace(seen, trainer_wait_s=10.0))
    assert plan(roles, busy, ELASTIC).roles == roles and plan(roles, busy, ELASTIC).reason is ErsReason.EVALUATION
    # Without elastic actors, without the evaluation rule, at min_actor_ranks: no actor moves.
    assert plan(roles, sig, LIMITS).roles == roles
    assert plan(roles, sig, replace(ELASTIC, evaluation_actors=False)).roles == roles
    assert count(plan(roles, sig, replace(ELASTIC, min_actor_ranks=4)).roles, A) == 4
    # Ref ranks go to rollout first, as the preemptive rule sends them; then the actors that pay.
    assert plan((R, R, F, A, A, A, A), sig, ELASTIC).roles == (R, R, R, R, A, A, A)  # 4/3: 50 s against 66.7
    # A cold start that plays an evaluation round is that round's plan; measured evaluation steps still price it.
    cold = plan(roles, replace(sig, step_history_s=()), ELASTIC)
    assert cold.reason is ErsReason.EVALUATION and count(cold.roles, R) == best
    assert plan(roles, replace(sig, step_history_s=(), is_eval_next=False), ELASTIC).reason is ErsReason.COLD_START


def test_15_a_cold_start_with_an_evaluation_round_takes_the_actors_its_first_map_predicts_to_pay():
    from tiderl.policy.ers.overrides import evaluation_step_s
    from tiderl.policy.ers.signals import EvaluationMemory

    # Nothing measured. The first map, 2 rollout / 6 actor ranks, taken as balanced: its rollout ranks generate a
    # step's 8 x 4 tasks as long as its actors train them. The round's 96 tasks, 3 steps of generation, go first
    # and nothing is ready before them: n rollout ranks take 3 x 2 / n steps for the round, then 2 / n for the
    # step's own tasks, which 8 - n actors train in 6 / (8 - n) as they arrive.
    cold = ErsSignals(ras_microbatches=0, ready_groups=0, hol_latency_s=0.0, tprm_s=None, is_eval_next=True)
    limits = replace(ELASTIC, groups_min=8, groups_ideal=8, group_size=4, evaluation_tasks=96)
    start = (R, R) + (A,) * 6
    for n in range(2, 8):
        roles = (R,) * n + (A,) * (8 - n)
        assert evaluation_step_s(roles, cold, limits, start) == pytest.approx(6 / n + max(2 / n, 6 / (8 - n)))
    p = plan(start, cold, limits)
    assert p.reason is ErsReason.EVALUATION and count(p.roles, R) == 4  # 3 steps' time against 4
    assert [m.rank for m in p.moves] == [2, 3]  # the lowest-index actor ranks
    # The first map is remembered, and the ranks go back once the round is over.
    memory = EvaluationMemory()
    memory.note(start, p.reason)
    assert memory.roles == start
    after = replace(signals(obs(4, 4), obs(4, 4)), pre_evaluation_roles=memory.roles)
    back = plan(p.roles, after, limits)
    assert back.reason is ErsReason.EVALUATION_END and back.roles == start
    # No round at the cold start, no round size, no actor to spare, or no elastic actors: no actor moves.
    assert plan(start, replace(cold, is_eval_next=False), limits).roles == start
    assert plan(start, replace(cold, is_eval_next=False), limits).reason is ErsReason.COLD_START
    assert plan(start, cold, replace(limits, evaluation_tasks=0)).roles == start
    assert plan(start, cold, replace(limits, min_actor_ranks=6)).roles == start
    assert plan(start, cold, replace(limits, elastic_actors=False)).roles == start
    # A first map heavy on rollout: an actor less would slow the step's training more than a rollout rank more
    # shortens the round (3 x 6 / 7 + 2 = 4.6 against 3 + 1). Were the trainer's work to overlap the round too,
    # it would move (max(4 x 6 / 7, 2) = 3.4 against 4).
    heavy = (R,) * 6 + (A,) * 2
    assert evaluation_step_s(heavy, cold, limits, heavy) == pytest.approx(4.0)
    assert plan(heavy, cold, limits).roles == heavy


def test_15_a_measured_evaluation_step_whose_trainer_never_waited_still_prices_fewer_rollout_ranks():
    from tiderl.policy.ers.overrides import evaluation_step_s

    # 5 rollout / 3 actor ranks: the round took 60 s of generation a rank, then the rollout ranks idled while
    # the trainer worked all 82 s. The trainer's wait (none) says nothing of fewer rollout ranks; the span does.
    seen = replace(obs(5, 3, duration_s=82.0, idle_rank_s=5 * 22.0), evaluation=True)
    sig = evaluation_signals(seen)
    roles = (R, R) + (A,) * 6
    assert evaluation_step_s(roles, sig, ELASTIC) == pytest.approx(60.0 * 5 / 2)
    assert evaluation_step_s((R,) * 4 + (A,) * 4, sig, ELASTIC) == pytest.approx(max(75.0, 82.0 * 3 / 4))
    assert count(plan(roles, sig, ELASTIC).roles, R) == 4


def test_15_before_any_evaluation_step_is_measured_the_window_prices_the_round():
    from tiderl.policy.ers.overrides import evaluation_step_s

    # Normal steps of 10 s on 2 rollout / 4 actor ranks: 4,000 tokens of 32 tasks a step from 20 busy
    # rank-seconds (200 tokens a rank-second), the trainer waiting 5 s (20 actor-seconds of work).
    step = replace(obs(2, 4, wait_s=5.0), tasks_completed=32)
    sig = replace(signals(step, step), is_eval_next=True)
    limits = replace(ELASTIC, evaluation_tasks=64)  # 64 tasks of 125 tokens beside a step's 4,000: 12,000 tokens
    roles = (R, R, A, A, A, A)
    for rollout in (2, 3, 4, 5):
        assert evaluation_step_s((R,) * rollout + (A,) * (6 - rollout), sig, limits) == pytest.approx(
            max(12_000 / 200 / rollout, 20.0 / (6 - rollout)))
    p = plan(roles, sig, limits)
    assert p.reason is ErsReason.EVALUATION and count(p.roles, R) == 4  # 15 s against 30
    # No evaluation size known, or no task measured in the window: nothing to price; the preemptive rule's plan.
    assert evaluation_step_s(roles, sig, ELASTIC) is None and plan(roles, sig, ELASTIC).roles == roles
    with pytest.raises(ValueError, match="evaluation_tasks"):
        replace(ELASTIC, evaluation_tasks=-1)
    bare = replace(signals(obs(2, 4, wait_s=5.0), obs(2, 4, wait_s=5.0)), is_eval_next=True)
    assert evaluation_step_s(roles, bare, limits) is None and plan(roles, bare, limits).roles == roles
    # A move at the boundary before the round left the current split unmeasured: the walk's window (the newest
    # measured split's) prices the round, and the actors still go.
    moved = replace(sig, window=(), walk=sig)
    assert moved.window == () and evaluation_step_s(roles, moved, limits) == evaluation_step_s(roles, sig, limits)
    assert count(plan(roles, moved, limits).roles, R) == 4
    # Once an evaluation step is measured, it replaces the prior.
    seen = replace(obs(2, 4, duration_s=100.0, wait_s=70.0), evaluation=True)
    assert evaluation_step_s(roles, replace(sig, evaluation_steps=(seen,)), limits) == pytest.approx(100.0)


def test_the_evaluation_steps_are_the_newest_of_each_rollout_count_after_the_fill():
    from tiderl.policy.ers.signals import ErsSnapshot, build_signals, evaluation_steps

    steps = tuple(replace(obs(n, 4), version=v, evaluation=e)
                  for v, n, e in [(1, 2, True), (5, 2, False), (10, 2, True), (20, 3, True), (30, 2, True)])
    assert [s.version for s in evaluation_steps(steps)] == [20, 30]
    snapshot = ErsSnapshot(roles=(R, R, A, A, A, A), micro_batch_tokens=250, ready_tokens=0, ready_groups=0,
                           oldest_ready_age_s=None, steps=steps, fill_steps=2)
    assert [s.version for s in build_signals(snapshot, 5).evaluation_steps] == [20, 30]
    assert [s.version for s in build_signals(replace(snapshot, steps=steps[:3]), 5).evaluation_steps] == [10]


def test_each_ablation_switches_off_its_rule_and_an_unknown_one_is_refused():
    """`ErsLimits.ablate` (tiderl sim's `tiderl~RULE`): each rule's own scenario above plans differently
    without it."""
    from tiderl.policy.ers.inputs import ABLATIONS

    def off(limits: ErsLimits, rule: str) -> ErsLimits:
        return replace(limits, ablate=frozenset({rule}))

    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        replace(LIMITS, ablate=frozenset({"nope"}))
    # walk: an unmeasured split waits for its measurement
    first = plan((R, R, A, A, A, A), MEASURED_2_4, ELASTIC)
    assert plan(first.roles, walking(MEASURED_2_4, +1), ELASTIC).moves
    assert plan(first.roles, walking(MEASURED_2_4, +1), off(ELASTIC, "walk")).moves == ()
    # valley: without it, one move toward the best split (3/8/0) from two ref ranks feeding eight actors leaves
    # one feeding them all, predicted slower than staying
    sig, roles = VALLEY
    assert split_of(plan(roles, sig, off(ELASTIC, "valley")).roles) == Split(2, 8, 1)
    assert split_of(plan(roles, sig, ELASTIC).roles) != Split(2, 8, 1)
    # slot_bound: the slots no longer cap one rank's supply
    window = (slotted(1), slotted(1))
    slots = replace(signals(*window), slot_wait_s=1.5, gen_latency_by_rollout=((1, 0.5),))
    assert slot_tok_s(1, estimate(slots, off(SLOTTED, "slot_bound"))) == float("inf")
    assert plan((R, F, A, A), slots, SLOTTED).moves and plan((R, F, A, A), slots, off(SLOTTED, "slot_bound")).moves == ()
    # latency_memory: only the current split's latency is known
    assert estimate(sig, off(ELASTIC, "latency_memory")).gen_curve == ((1, pytest.approx(7.8 - 2.1)),)
    assert dict(estimate(sig, ELASTIC).gen_curve)[3] == 4.0  # with it, the split measured before
    # regime: the window's measured starvation no longer overrules the model
    starving = signals(obs(3, 3, wait_s=5.0, latency_s=10.0, env_s=9.9), obs(3, 3, wait_s=5.0, latency_s=10.0, env_s=9.9))
    kept = plan((R, R, R, A, A, A), starving, ELASTIC)
    freed = plan((R, R, R, A, A, A), starving, off(ELASTIC, "regime"))
    assert count(kept.roles, R) >= 3 > count(freed.roles, R)
    # idle_moves: the rollout ranks the window measured idle go one a step (test_3 above)
    far = signals(*[obs(7, 1, idle_rank_s=60.0, latency_s=4.0, env_s=3.0)] * 2)
    assert len(plan((R,) * 7 + (A,), far, ELASTIC).moves) == 3
    assert len(plan((R,) * 7 + (A,), far, off(ELASTIC, "idle_moves")).moves) == 1
    assert set(ABLATIONS) == {"regime", "walk", "repartition", "slot_bound", "latency_memory", "valley", "idle_moves"}
