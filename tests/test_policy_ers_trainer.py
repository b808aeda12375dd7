"""The trainer's side of ERS (tiderl.policy.ers.choose.repartition, tiderl.policy.ers.model's step model): one test
per invariant in docs/ers.md, with hand-worked timelines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tiderl.policy.ers import ErsLimits, ErsPolicy, ErsReason, ErsSignals, StepObservation, plan
from tiderl.policy.ers.choose import repartition
from tiderl.policy.ers.model import Split, readiness, split_of, step_compute_s
from tiderl.policy.ra2p import StageTimes, colocated_cost_s, refs_needed
from tiderl.roles import Role

R, A, F = Role.ROLLOUT, Role.ACTOR, Role.REF
# Costly swaps: the colocated loop pays a swap pair per burst while data trickles in.
TIMES = StageTimes(t_ref_s=0.5, t_act_f_s=0.5, t_act_b_s=1.0, t_swap_s=1.0)
SHARE = 100  # tokens of one actor rank's share of a micro-batch
ELASTIC = ErsLimits(groups_min=2, groups_ideal=4, policy=ErsPolicy.RATE, elastic_actors=True)


def trickle(actors: int = 4, refs: int = 0, *, tprm_s: float | None = 2.0, ras: int = 0) -> StepObservation:
    """A step of 2,000 tokens on `actors` actor ranks: 5 micro-batches of 4 shares, one every `tprm_s`."""
    return StepObservation(version=10, duration_s=20.0, consumed_tokens=2000, rollout_ranks=2, actor_ranks=actors,
                           ref_ranks=refs, tprm_s=tprm_s, ras_microbatches=ras)


def signals(*window: StepObservation, times: StageTimes | None = TIMES) -> ErsSignals:
    return ErsSignals(ras_microbatches=0, ready_groups=4, hol_latency_s=0.0, tprm_s=window[-1].tprm_s if window else None,
                      step_history_s=(20.0,) * max(1, len(window)), stage_times=times, microbatches_per_step=5,
                      window=window, micro_batch_tokens=SHARE)


def test_4_readiness_keeps_the_tokens_and_their_rate():
    assert readiness(trickle(), 4, SHARE) == [2.0, 4.0, 6.0, 8.0, 10.0]
    # Three actors: micro-batches of 300 tokens, ceil(2000 / 300) = 7 of them, one every 1.5 s (same tokens/s).
    assert readiness(trickle(), 3, SHARE) == pytest.approx([1.5, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5])
    # Two micro-batches of 400 tokens ready at the start are two of 800 with eight actors, four of 200 with two.
    assert readiness(trickle(ras=2), 8, SHARE)[:1] == [0.0] and readiness(trickle(ras=2), 8, SHARE)[1] > 0
    assert readiness(trickle(ras=2), 2, SHARE)[:4] == [0.0] * 4
    assert readiness(trickle(tprm_s=None), 3, SHARE) == [0.0] * 7  # nothing arrived after the start


def test_5_the_compute_of_a_step_by_mode():
    ready = [2.0, 4.0, 6.0, 8.0, 10.0]
    # Colocated: the RA2P cost model's loop (bursts at 2 [1], 6 [2], 12 [2]: 6, 12, 18).
    assert step_compute_s(ready, 4, 0, TIMES) == colocated_cost_s(ready, TIMES) == pytest.approx(18.0)
    # Decoupled, 3 actors and 1 ref: period max(1.5, 3 x 0.5) = 1.5, latency 3 x 0.5 + 1.5 = 3.0;
    # each micro-batch ends 3 s after its arrival (they come every 1.5 s): the last at 10.5 + 3.0.
    assert step_compute_s(readiness(trickle(), 3, SHARE), 3, 1, TIMES) == pytest.approx(13.5)
    # All ready at the start: the fill and one micro-batch's work, then a period for each of the rest.
    assert step_compute_s([0.0] * 7, 3, 1, TIMES) == pytest.approx(3.0 + 6 * 1.5)
    for ready in ([0.0] * 3, [1.0, 5.0, 9.0], [0.0, 0.0, 7.0]):
        for actors, refs in ((3, 1), (6, 2), (6, 1)):
            end = step_compute_s(ready, actors, refs, TIMES)
            period = max(1.5, actors * 0.5 / refs)
            assert end >= max(ready) + (-(-actors // refs)) * 0.5 + 1.5 - 1e-9
            assert end >= len(ready) * period - 1e-9


def test_3_a_re_partition_only_for_a_saving_above_the_margin():
    sig = signals(trickle(), trickle())
    assert repartition(Split(2, 4, 0), sig, ELASTIC) == 1  # 13.5 s against 18 s a step
    assert repartition(Split(2, 4, 0), sig, replace(ELASTIC, rate_margin=0.4)) is None  # 18 / 13.5 < 1.4
    assert repartition(Split(2, 3, 1), signals(trickle(3, 1), trickle(3, 1)), ELASTIC) is None  # already there
    # Everything ready at the start: one colocated burst (2 x 1 + 5 x 2 = 12 s) costs what the pipeline
    # does (3 + 6 x 1.5 = 12 s): a tie keeps the current partition, either way.
    ready = signals(trickle(tprm_s=None), trickle(tprm_s=None))
    assert repartition(Split(2, 4, 0), ready, ELASTIC) is None
    assert repartition(Split(2, 3, 1), signals(trickle(3, 1, tprm_s=None), trickle(3, 1, tprm_s=None)), ELASTIC) is None
    # Cheap swaps make the colocated burst the cheaper (2 x 0.01 + 5 x 2 = 10.02 s): back to no ref rank.
    cheap = replace(TIMES, t_swap_s=0.01)
    back = signals(trickle(3, 1, tprm_s=None), trickle(3, 1, tprm_s=None), times=cheap)
    assert repartition(Split(2, 3, 1), back, ELASTIC) == 0
    # A decoupled step's coordination paid every step: 13.5 + 4 s against 18 s is under the margin; and with
    # the ref there it goes (12 + 4 s with it, 12 s without, all ready).
    assert repartition(Split(2, 4, 0), sig, replace(ELASTIC, decoupled_step_s=4.0)) is None
    assert repartition(Split(2, 3, 1), signals(trickle(3, 1, tprm_s=None), trickle(3, 1, tprm_s=None)),
                       replace(ELASTIC, decoupled_step_s=4.0)) == 0


def test_2_the_trainer_keeps_its_ranks_within_the_limits():
    sig = signals(trickle(8), trickle(8))
    for limits in (ELASTIC, replace(ELASTIC, max_ref_ranks=1), replace(ELASTIC, min_actor_ranks=7)):
        refs = repartition(Split(2, 8, 0), sig, limits)
        if refs is None:
            continue
        assert 0 <= refs <= refs_needed(8 - refs, TIMES)
        assert 8 - refs >= limits.min_actor_ranks
        assert limits.max_ref_ranks is None or refs <= limits.max_ref_ranks
    # 8 actors colocated: 12 s; 6 + 2 refs: 9 s (the best); 7 + 1 ref: 13.75 s (one ref feeds 7 too slowly).
    assert repartition(Split(2, 8, 0), sig, ELASTIC) == 2
    assert repartition(Split(2, 8, 0), sig, replace(ELASTIC, max_ref_ranks=1)) is None
    assert repartition(Split(2, 8, 0), sig, replace(ELASTIC, min_actor_ranks=7)) is None


def test_1_no_re_partition_without_elastic_actors_stage_times_or_a_window():
    sig = signals(trickle(), trickle())
    assert repartition(Split(2, 4, 0), sig, replace(ELASTIC, elastic_actors=False)) is None
    assert repartition(Split(2, 4, 0), signals(trickle(), trickle(), times=None), ELASTIC) is None
    assert repartition(Split(2, 4, 0), replace(sig, window=()), ELASTIC) is None


def test_the_split_planner_and_the_re_partition_divide_the_trainer_alike():
    # The rollout ranks idle a rank's worth (no more rollout) and the trainer waits (no fewer). With groups of
    # 20 s the trainer's partition decides the goodput: the split planner prices the step with its readiness,
    # as the re-partition does, and moves the same rank from actor to ref (one move, within its limit).
    step = replace(trickle(), rollout_idle_rank_s=30.0, trainer_wait_s=8.0, produced_tokens=2000,
                   groups_completed=4, group_latency_sum_s=80.0, group_env_sum_s=40.0, rollout_busy_rank_s=10.0)
    sig = replace(signals(step, step), group_latency_s=20.0, group_env_s=10.0, tokens_per_group=500.0)
    roles = (R, R, A, A, A, A)
    p = plan(roles, sig, replace(ELASTIC, max_moves_per_step=1))
    assert p.reason is ErsReason.RATE_REBALANCE
    assert split_of(p.roles) == Split(2, 3, 1) and [(m.from_role, m.to_role) for m in p.moves] == [(A, F)]
    assert repartition(split_of(roles), sig, ELASTIC) == 1
    # Groups of 200 s: the supply binds every partition alike, so no split is worth a move; the trainer's
    # compute still shortens by more than the margin (13.5 s against 18 s), and the re-partition moves.
    step = replace(step, group_latency_sum_s=800.0)
    sig = replace(signals(step, step), group_latency_s=200.0, group_env_s=10.0, tokens_per_group=500.0)
    p = plan(roles, sig, replace(ELASTIC, max_moves_per_step=1))
    assert p.reason is ErsReason.RATE_REPARTITION
    assert p.roles == (R, R, A, A, A, F) and [(m.from_role, m.to_role) for m in p.moves] == [(A, F)]
    assert plan(roles, sig, replace(ELASTIC, elastic_actors=False)).reason is not ErsReason.RATE_REPARTITION
    assert plan(roles, sig, replace(ELASTIC, ablate=frozenset({"repartition"}))).moves == ()  # the ablation
    assert plan(roles, sig, ELASTIC) == plan(list(roles), sig, ELASTIC)  # pure (invariant 6)


def test_the_split_planner_prices_a_step_as_the_re_partition_does():
    from tiderl.policy.ers.model import _compute_s
    # 2,000 tokens on 6 actors of 100-token shares: 4 micro-batches, all ready at the start.
    for actors, refs in ((6, 1), (6, 2), (3, 1), (4, 0)):
        n = -(-2000 // (SHARE * actors))
        assert _compute_s(2000, actors, refs, TIMES, SHARE) == step_compute_s([0.0] * n, actors, refs, TIMES)
    # Ref-bound (6 x 0.5 / 1 = 3 s a period against 1.5 s of actor work): the fill of 6 ref shares and
    # one micro-batch's actor work, then a period for each of the other 3 (the last actor work is not
    # paid a period for).
    assert _compute_s(2000, 6, 1, TIMES, SHARE) == pytest.approx(6 * 0.5 + 1.5 + 3 * 3.0)
