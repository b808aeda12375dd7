"""One test per invariant of the ERS plan (docs/ers.md, "Invariants", numbered as there)."""

from __future__ import annotations

import random
from dataclasses import replace

from tiderl.policy.ers import ErsLimits, ErsReason, ErsSignals, Role, RoleMove, plan
from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import Ra2pMode, StageTimes

R, A, F, I = Role.ROLLOUT, Role.ACTOR, Role.REF, Role.IDLE
LIMITS = ErsLimits(groups_min=4, groups_ideal=8)
HISTORY = (100.0, 100.0)
STEADY = ErsSignals(ras_microbatches=2, ready_groups=8, hol_latency_s=10.0, tprm_s=5.0, step_history_s=HISTORY)
CONSUMPTION = ErsSignals(ras_microbatches=6, ready_groups=20, hol_latency_s=250.0, tprm_s=1.0, step_history_s=HISTORY)
GENERATION = ErsSignals(ras_microbatches=0, ready_groups=2, hol_latency_s=0.0, tprm_s=30.0, step_history_s=HISTORY)
TIMES = StageTimes(t_ref_s=0.5, t_act_f_s=1.0, t_act_b_s=2.0, t_swap_s=0.5)


def random_case(rng: random.Random):
    n = rng.randint(2, 12)
    roles = [rng.choice([R, R, A, F, I]) for _ in range(n)]
    signals = ErsSignals(
        ras_microbatches=rng.randint(0, 20),
        ready_groups=rng.randint(0, 16),
        hol_latency_s=rng.uniform(0, 300),
        tprm_s=rng.choice([None, rng.uniform(0, 40)]),
        step_history_s=tuple(rng.uniform(20, 200) for _ in range(rng.randint(0, 4))),
        is_eval_next=rng.random() < 0.15,
        fetch_groups=rng.randint(4, 8),
        last_rollout_change=rng.randint(-2, 2),
        stage_times=rng.choice([None, TIMES]),
        microbatches_per_step=rng.randint(0, 16),
        rollout_idle_ranks=rng.choice([0.0, 0.5, 2.0]),
    )
    limits = ErsLimits(
        groups_min=4,
        groups_ideal=8,
        hol_tau=rng.choice([0.5, 1.0, 2.0]),
        max_moves_per_step=rng.randint(0, 3),
        min_rollout_ranks=rng.randint(1, 3),
        max_ref_ranks=rng.choice([None, 1, 2]),
        preemptive_rollout=rng.random() < 0.8,
        adaptive_retention=rng.random() < 0.8,
        min_actor_ranks=rng.randint(1, 2),
        elastic_actors=rng.random() < 0.5,
    )
    return tuple(roles), signals, limits


def cases(n: int = 600):
    rng = random.Random(11)
    for _ in range(n):
        roles, signals, limits = random_case(rng)
        yield roles, signals, limits, plan(roles, signals, limits)


def count(roles, role) -> int:
    return sum(1 for r in roles if r is role)


def test_1_same_size_actors_fixed_or_above_minimum():
    elastic = ErsLimits(groups_min=4, groups_ideal=8, elastic_actors=True, min_actor_ranks=2)
    p = plan((R, R, A, A, A), GENERATION, elastic)
    assert p.roles == (R, R, R, A, A)  # an actor (the lowest-index one) goes to rollout
    assert plan((R, R, A, A), GENERATION, elastic).roles == (R, R, A, A)  # min_actor_ranks holds
    for roles, _, limits, p in cases():
        assert len(p.roles) == len(roles)
        if not limits.elastic_actors:
            assert all((a is A) == (b is A) for a, b in zip(roles, p.roles))
        elif count(p.roles, A) < count(roles, A):
            assert count(p.roles, A) >= limits.min_actor_ranks


def test_2_only_rollout_trainer_moves_and_moves_match_the_map():
    for roles, _, limits, p in cases():
        changed = [RoleMove(i, a, b) for i, (a, b) in enumerate(zip(roles, p.roles)) if a is not b]
        assert list(p.moves) == changed
        for m in p.moves:
            allowed = {(R, F), (F, R)} | ({(R, A), (A, R)} if limits.elastic_actors else set())
            assert (m.from_role, m.to_role) in allowed or (
                (m.from_role, m.to_role) == (I, R) and p.reason in (ErsReason.COLD_START, ErsReason.EVALUATION)
            )


def test_3_move_limit_except_preemptive():
    roles = (R, R, R, R, A, A)
    p = plan(roles, CONSUMPTION, ErsLimits(groups_min=4, groups_ideal=8, max_moves_per_step=1))
    assert p.moves == (RoleMove(3, R, F),)  # highest-index rollout rank, one move
    for _, _, limits, p in cases():
        if p.reason not in (ErsReason.COLD_START, ErsReason.EVALUATION):
            assert len(p.moves) <= limits.max_moves_per_step


def test_4_min_rollout_and_max_ref():
    p = plan((R, F, A, A), CONSUMPTION, ErsLimits(groups_min=4, groups_ideal=8, max_moves_per_step=3))
    assert p.roles == (R, F, A, A)  # the only rollout rank stays
    p = plan((R, R, R, F, A), CONSUMPTION, ErsLimits(groups_min=4, groups_ideal=8, max_ref_ranks=1))
    assert count(p.roles, F) == 1
    for roles, _, limits, p in cases():
        if count(roles, R) >= limits.min_rollout_ranks:
            assert count(p.roles, R) >= limits.min_rollout_ranks
        if limits.max_ref_ranks is not None and count(p.roles, F) > count(roles, F):
            assert count(p.roles, F) <= limits.max_ref_ranks


def test_5_mode_follows_ref_ranks():
    assert plan((R, R, R, A, A), CONSUMPTION, LIMITS).mode is Ra2pMode.DECOUPLED
    assert plan((R, F, A, A), GENERATION, LIMITS).mode is Ra2pMode.COLOCATED
    for _, _, _, p in cases():
        assert (p.mode is Ra2pMode.DECOUPLED) == (F in p.roles)


def test_6_preemptive_max_rollout_at_cold_start_and_evaluation():
    cold = ErsSignals(ras_microbatches=0, ready_groups=0, hol_latency_s=0.0, tprm_s=None)
    p = plan((R, F, F, I, A, A), cold, ErsLimits(groups_min=4, groups_ideal=8, max_moves_per_step=1))
    assert p.roles == (R, R, R, R, A, A) and p.mode is Ra2pMode.COLOCATED and p.reason is ErsReason.COLD_START
    evaluation = ErsSignals(ras_microbatches=9, ready_groups=20, hol_latency_s=999.0, tprm_s=1.0,
                            step_history_s=HISTORY, is_eval_next=True)
    assert plan((R, F, A), evaluation, LIMITS).reason is ErsReason.EVALUATION
    for _, signals, limits, p in cases():
        if limits.preemptive_rollout and (not signals.step_history_s or signals.is_eval_next):
            assert F not in p.roles and I not in p.roles and p.mode is Ra2pMode.COLOCATED
    # A shared host without room for a further busy rollout rank: the spare ranks idle.
    full = ErsLimits(groups_min=2, groups_ideal=4, group_size=8, host=HostShare(slots=1.0, rollout_weight=2.0),
                     rank_tasks=16)
    assert plan((R, F, I, A), cold, full).roles == (R, I, I, A)


def test_13_the_evaluations_end_puts_its_ranks_back():
    before = (R, F, F, I, A, A)  # the planner's split before the evaluation
    during = (R, R, R, R, A, A)  # the evaluation's preemptive maximum rollout
    over = ErsSignals(ras_microbatches=0, ready_groups=8, hol_latency_s=0.0, tprm_s=None, step_history_s=HISTORY,
                      pre_evaluation_roles=before)
    p = plan(during, over, LIMITS)  # LIMITS: one move a step; the return is exempt like the preemptive move
    assert p.reason is ErsReason.EVALUATION_END and p.roles == before and p.mode is Ra2pMode.DECOUPLED
    # Only rollout ranks move back: a rank that another rule moved meanwhile keeps its role.
    moved = plan((R, R, F, R, A, R), over, LIMITS)
    assert moved.roles == (R, F, F, I, A, R) and {(m.from_role, m.to_role) for m in moved.moves} <= {(R, F), (R, I)}
    # Actors the evaluation took (invariant 15) go back too.
    back = plan((R, R, R, R, R, A), over, replace(LIMITS, elastic_actors=True))
    assert back.reason is ErsReason.EVALUATION_END and back.roles == before
    # Nothing to put back, no preemptive rule, or still evaluating: the other rules plan as before.
    assert plan(before, over, LIMITS).reason is not ErsReason.EVALUATION_END
    assert plan(during, over, replace(LIMITS, preemptive_rollout=False)).reason is not ErsReason.EVALUATION_END
    assert plan(during, replace(over, is_eval_next=True), LIMITS).reason is ErsReason.EVALUATION


def test_the_evaluation_memory_keeps_the_map_the_first_evaluation_plan_replaced():
    from tiderl.policy.ers.signals import ErsSnapshot, EvaluationMemory, build_signals

    memory = EvaluationMemory()
    memory.note((R, F, A), ErsReason.STEADY)
    assert memory.roles is None
    memory.note((R, F, A), ErsReason.EVALUATION)
    memory.note((R, R, A), ErsReason.EVALUATION)  # a second evaluation step: the first map stays
    assert memory.roles == (R, F, A)
    snapshot = ErsSnapshot(roles=(R, R, A), micro_batch_tokens=64, ready_tokens=0, ready_groups=0,
                           oldest_ready_age_s=None, pre_evaluation_roles=memory.roles)
    assert build_signals(snapshot, 5).pre_evaluation_roles == (R, F, A)
    assert build_signals(replace(snapshot, is_eval_open=True), 5).pre_evaluation_roles is None  # not over yet
    memory.note((R, R, A), ErsReason.EVALUATION_END)
    assert memory.roles is None


def test_7_consumption_deficit_never_shrinks_the_trainer():
    # HoL 250 s > 1.0 x 100 s mean step time.
    p = plan((R, R, R, A, A), CONSUMPTION, LIMITS)
    assert p.reason is ErsReason.CONSUMPTION_DEFICIT and p.roles == (R, R, F, A, A)
    # Break-even RAS: 16 micro-batches ready, later ones every 0.5 s, decoupled is cheaper.
    ras = ErsSignals(ras_microbatches=16, ready_groups=20, hol_latency_s=0.0, tprm_s=0.5, step_history_s=HISTORY,
                     stage_times=TIMES, microbatches_per_step=16)
    assert plan((R, R, R, A, A, A, A, A, A), ras, LIMITS).reason is ErsReason.CONSUMPTION_DEFICIT
    # Elastic actors: the new trainer rank is a ref rank only if decoupled then beats colocated.
    # Six actors: C_dec = 7.5 + 16 x 3 = 55.5 < C_col = 57 -> a ref rank.
    elastic = ErsLimits(groups_min=4, groups_ideal=8, elastic_actors=True)
    assert plan((R, R, R) + (A,) * 6, ras, elastic).roles == (R, R, F) + (A,) * 6
    # Twelve actors, the HoL test fires: one ref cannot keep up (period 12 x 0.5 = 6 > 3) and the
    # fill is 33 s, so decoupled loses -> an actor rank.
    old_data = ErsSignals(**{**{f: getattr(ras, f) for f in ras.__slots__}, "hol_latency_s": 250.0})
    assert plan((R, R, R) + (A,) * 12, old_data, elastic).roles == (R, R, A) + (A,) * 12
    for roles, _, _, p in cases():
        if p.reason is ErsReason.CONSUMPTION_DEFICIT:
            assert count(p.roles, F) + count(p.roles, A) >= count(roles, F) + count(roles, A)


def test_8_generation_deficit_never_grows_the_trainer():
    p = plan((R, F, F, A, A), GENERATION, LIMITS)
    assert p.reason is ErsReason.GENERATION_DEFICIT and p.roles == (R, F, R, A, A)
    # Rollout ranks that idled behind the staleness bound: one more would idle too.
    idle = ErsSignals(**{**{f: getattr(GENERATION, f) for f in GENERATION.__slots__}, "rollout_idle_ranks": 1.5})
    assert plan((R, F, F, A, A), idle, LIMITS).roles == (R, F, F, A, A)
    # A shared host with room for two busy rollout ranks: the second ref rank stays (the host's room,
    # not the move limit, stops it); with room for one, no ref rank rolls out.
    two = replace(LIMITS, host=HostShare(slots=2.0, rollout_weight=1.0), max_rollout_moves_per_step=2)
    assert plan((R, F, F, A, A), GENERATION, two).roles == (R, F, R, A, A)
    assert plan((R, F, F, A, A), GENERATION, replace(two, host=HostShare(slots=1.0))).roles == (R, F, F, A, A)
    assert plan((R, F, F, A, A), GENERATION, replace(two, host=None)).roles == (R, R, R, A, A)
    for roles, signals, _, p in cases():
        if p.reason is ErsReason.GENERATION_DEFICIT:
            trainer_before = count(roles, F) + count(roles, A)
            assert count(p.roles, F) + count(p.roles, A) <= trainer_before
            if signals.rollout_idle_ranks >= 1.0:
                assert count(p.roles, F) + count(p.roles, A) == trainer_before


def test_9_fetch_size_and_adaptive_retention():
    after_scale_down = ErsSignals(ras_microbatches=0, ready_groups=2, hol_latency_s=0.0, tprm_s=30.0,
                                  step_history_s=HISTORY, fetch_groups=8, last_rollout_change=-1)
    assert plan((R, F, A, A), after_scale_down, LIMITS).fetch_groups == 6  # halfway from 8 toward 4
    again = ErsSignals(**{**{f: getattr(after_scale_down, f) for f in after_scale_down.__slots__}, "fetch_groups": 5})
    assert plan((R, F, A, A), again, LIMITS).fetch_groups == 4
    assert plan((R, F, A, A), GENERATION, LIMITS).fetch_groups == 8  # no scale-down before: full fetch
    for _, signals, limits, p in cases():
        assert limits.groups_min <= p.fetch_groups <= limits.groups_ideal
        if p.fetch_groups < limits.groups_ideal:
            assert p.reason is ErsReason.GENERATION_DEFICIT and signals.last_rollout_change < 0


def test_10_disabled_keeps_the_map():
    off = ErsLimits(groups_min=4, groups_ideal=8, enabled=False)
    for roles in [(R, R, A, A), (R, F, A, A)]:
        p = plan(roles, CONSUMPTION, off)
        assert p.roles == roles and p.moves == () and p.reason is ErsReason.DISABLED
        assert p.mode is (Ra2pMode.DECOUPLED if F in roles else Ra2pMode.COLOCATED)


def test_11_pure():
    rng = random.Random(12)
    for _ in range(50):
        roles, signals, limits = random_case(rng)
        assert plan(roles, signals, limits) == plan(list(roles), signals, limits)


def test_from_config_reads_the_ers_section():
    from tiderl.config.ers import ErsConfig

    limits = ErsLimits.from_config(ErsConfig(max_moves_per_step=2, elastic_actors=True), 2, 4)
    assert (limits.groups_min, limits.groups_ideal, limits.max_moves_per_step, limits.elastic_actors) == (2, 4, 2, True)


def test_12_refs_only_while_they_cannot_keep_up():
    # Three actors, per share t_ref 0.5 vs t_f + t_b 3: one ref keeps up (3 x 0.5 = 1.5 <= 3).
    signals = ErsSignals(ras_microbatches=40, ready_groups=32, hol_latency_s=250.0, tprm_s=0.5,
                         step_history_s=HISTORY, stage_times=TIMES, microbatches_per_step=40)
    fixed = ErsLimits(groups_min=4, groups_ideal=8, max_moves_per_step=3)
    assert count(plan((R, R, R, R, A, A, A), signals, fixed).roles, F) == 1
    assert plan((R, R, R, F, A, A, A), signals, fixed).roles == (R, R, R, F, A, A, A)
    elastic = ErsLimits(groups_min=4, groups_ideal=8, max_moves_per_step=1, elastic_actors=True)
    assert plan((R, R, R, F, A, A, A), signals, elastic).roles == (R, R, A, F, A, A, A)  # an actor instead
    for roles, signals, _, p in cases():
        refs_before, refs_after = count(roles, F), count(p.roles, F)
        if refs_after > refs_before and refs_before > 0:
            t = signals.stage_times
            assert t is not None and count(roles, A) * t.t_ref_s / refs_before > t.t_act_f_s + t.t_act_b_s


def test_14_engines_on_demand_an_idle_rank_joins_rollout_once_its_engine_is_up():
    host = HostShare(slots=4.0, rollout_weight=1.0)  # room for further busy rollout ranks: cold start fills it
    cold = ErsSignals(ras_microbatches=0, ready_groups=0, hol_latency_s=0.0, tprm_s=None)
    on_demand = ErsLimits(groups_min=4, groups_ideal=8, host=host, engines_on_demand=True)
    p = plan((R, I, I, A), replace(cold, engine_ranks=frozenset({0, 1})), on_demand)
    assert p.roles == (R, R, I, A) and p.warm == (2,) and p.reason is ErsReason.COLD_START
    assert p.moves == (RoleMove(1, I, R),)
    p = plan((R, I, I, A), replace(cold, engine_ranks=frozenset({0})), on_demand)
    assert p.roles == (R, I, I, A) and p.warm == (1, 2) and p.moves == () and p.reason is ErsReason.ENGINE_START
    # Parked engines, an accelerator per rank, or engines not tracked: the rules' plan as it is.
    for limits, up in ((replace(on_demand, engines_on_demand=False), frozenset()), (replace(on_demand, host=None), frozenset()),
                       (on_demand, None)):
        p = plan((R, I, I, A), replace(cold, engine_ranks=up), limits)
        assert p.roles == (R, R, R, A) and p.warm == ()
    # Every rule's plan, with engines on demand: the same plan but for the warmed ranks, left idle.
    rng = random.Random(14)
    warmed = 0
    for roles, signals, limits, _ in cases():
        limits = replace(limits, host=HostShare(slots=rng.choice([1.0, 3.0, 8.0])), engines_on_demand=True)
        up = frozenset(i for i in range(len(roles)) if rng.random() < 0.5)
        free = plan(roles, replace(signals, engine_ranks=None), limits)
        p = plan(roles, replace(signals, engine_ranks=up), limits)
        assert all(p.roles[i] is I and roles[i] is I and i not in up for i in p.warm)
        assert not any(m.from_role is I and m.to_role is R and m.rank not in up for m in p.moves)
        assert p.roles == tuple(I if i in p.warm else r for i, r in enumerate(free.roles))
        assert set(p.warm) == {m.rank for m in free.moves if m.from_role is I and m.to_role is R and m.rank not in up}
        assert p.mode is (Ra2pMode.DECOUPLED if F in p.roles else Ra2pMode.COLOCATED)
        warmed += bool(p.warm)
    assert warmed > 20  # the cases reach the rule


def test_engines_on_demand_come_from_the_ers_section_with_a_shared_host():
    from tiderl.config.ers import ErsConfig

    assert ErsLimits.from_config(ErsConfig(host_slots=2.0), 2, 4).engines_on_demand  # the default
    assert not ErsLimits.from_config(ErsConfig(host_slots=2.0, idle_engines="parked"), 2, 4).engines_on_demand
    assert not ErsLimits.from_config(ErsConfig(), 2, 4).engines_on_demand  # an accelerator per rank
