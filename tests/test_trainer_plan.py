"""Step plans: every trajectory trained exactly once, placement per RA2P mode."""

import pytest

from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.plan import plan_step
from tiderl.trainer.synthetic import random_samples

SAMPLES = random_samples(5, 4, min_tokens=8, max_tokens=80, seed=7)


def _members(plan):
    return [t for mb in plan.micro_batches for t in mb.trajectory_ids]


@pytest.mark.parametrize("mode", list(Ra2pMode))
@pytest.mark.parametrize("num_actors", [1, 2, 3])
def test_every_trajectory_exactly_once_and_every_share_placed(mode, num_actors):
    plan = plan_step(SAMPLES, version=4, mode=mode, num_actors=num_actors, micro_batch_tokens=160)
    assert sorted(_members(plan)) == sorted(s.trajectory_id for s in SAMPLES)
    placed = sorted(i for a in plan.assignment for i in a)
    assert placed == list(range(len(plan.micro_batches)))
    assert sorted(plan.ref_order) == placed
    assert plan.normalizer == sum(s.num_model_tokens for s in SAMPLES)
    assert [mb.index for mb in plan.micro_batches] == placed


def test_colocated_balances_tokens_across_ranks():
    plan = plan_step(SAMPLES, version=0, mode=Ra2pMode.COLOCATED, num_actors=2, micro_batch_tokens=160)
    loads = [sum(int(plan.micro_batches[i].attention_mask.sum()) for i in a) for a in plan.assignment]
    assert abs(loads[0] - loads[1]) <= max(s.num_tokens for s in SAMPLES)


def test_decoupled_feeds_the_smallest_sequence_last():
    plan = plan_step(SAMPLES, version=0, mode=Ra2pMode.DECOUPLED, num_actors=2, micro_batch_tokens=160)
    last = plan.micro_batches[plan.ref_order[-1]]
    assert last.input_ids.shape[0] == 1
    assert int(last.attention_mask.sum()) == min(s.num_tokens for s in SAMPLES)


def test_ready_times_order_the_feed():
    ready = [0.0] * 10 + [5.0] * 10
    plan = plan_step(SAMPLES, version=0, mode=Ra2pMode.VANILLA_STREAM, num_actors=1, micro_batch_tokens=160,
                     sample_ready_s=ready)
    times = [plan.ready_at_s[i] for i in plan.ref_order]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] == 5.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no samples"):
        plan_step([], version=0, mode=Ra2pMode.COLOCATED, num_actors=1, micro_batch_tokens=64)
    with pytest.raises(ValueError, match="ready times"):
        plan_step(SAMPLES, version=0, mode=Ra2pMode.COLOCATED, num_actors=1, micro_batch_tokens=64,
                  sample_ready_s=[0.0])
    with pytest.raises(ValueError, match="unknown RA2P mode 'fast'"):
        Ra2pMode.parse("fast")


def test_flat_groups_are_dropped_unless_every_group_is_flat():
    import dataclasses

    from tiderl.trainer.plan import drop_flat_groups

    base = random_samples(3, 2, seed=3)
    # Groups a (signal), b (flat), c (flat): two samples each.
    advantages = [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    samples = [dataclasses.replace(s, group_id="abc"[i // 2], advantage=a) for i, (s, a) in
               enumerate(zip(base, advantages))]
    kept, ready, dropped = drop_flat_groups(samples, [float(i) for i in range(6)])
    assert [s.group_id for s in kept] == ["a", "a"] and ready == [0.0, 1.0] and dropped == 2
    flat = [dataclasses.replace(s, advantage=0.0) for s in samples]
    kept, ready, dropped = drop_flat_groups(flat)
    assert kept == flat and ready is None and dropped == 0
    # A group with one non-zero advantage has signal.
    mixed = samples[:2] + [dataclasses.replace(samples[2], advantage=0.25), samples[3]]
    assert [s.group_id for s in drop_flat_groups(mixed)[0]] == ["a", "a", "b", "b"]


def test_the_step_plan_leaves_flat_groups_out_of_the_token_mean_when_asked():
    import dataclasses

    from tiderl.config.trainer import TrainerConfig
    from tiderl.trainer.modes import TrainerComm
    from tiderl.trainer.rank import StepInput, build_plan

    base = random_samples(2, 2, seed=4)
    samples = [dataclasses.replace(s, group_id=i // 2, advantage=(0.5, -0.5, 0.0, 0.0)[i]) for i, s in enumerate(base)]
    inp = StepInput(version=0, samples=tuple(samples), mode=Ra2pMode.COLOCATED)
    comm = TrainerComm(rank=0, actor_ranks=(0,))
    everything = build_plan(inp, TrainerConfig(), comm).normalizer
    signal = build_plan(inp, TrainerConfig(skip_flat_groups=True), comm).normalizer
    assert everything == sum(s.num_model_tokens for s in samples)
    assert signal == sum(s.num_model_tokens for s in samples[:2]) < everything


def test_overlong_masking_leaves_cut_trajectories_out_unless_every_one_was_cut():
    """`trainer.mask_truncated` (DAPO's overlong masking): a trajectory its turn or context limit cut trains
    none of its tokens; a step of cut trajectories only trains them all."""
    import dataclasses

    from tiderl.config.trainer import TrainerConfig
    from tiderl.trainer.modes import TrainerComm
    from tiderl.trainer.plan import drop_truncated
    from tiderl.trainer.rank import StepInput, build_plan

    base = random_samples(2, 2, seed=5)
    samples = [dataclasses.replace(s, truncated=i in (1, 2)) for i, s in enumerate(base)]
    kept, ready, dropped = drop_truncated(samples, [0.0, 1.0, 2.0, 3.0])
    assert kept == [samples[0], samples[3]] and ready == [0.0, 3.0] and dropped == 2
    cut = [dataclasses.replace(s, truncated=True) for s in base]
    assert drop_truncated(cut) == (cut, None, 0)
    inp = StepInput(version=0, samples=tuple(samples), mode=Ra2pMode.COLOCATED)
    comm = TrainerComm(rank=0, actor_ranks=(0,))
    assert build_plan(inp, TrainerConfig(), comm).normalizer == sum(s.num_model_tokens for s in samples)
    masked = build_plan(inp, TrainerConfig(mask_truncated=True), comm)
    assert masked.normalizer == samples[0].num_model_tokens + samples[3].num_model_tokens
    assert sorted(t for mb in masked.micro_batches for t in mb.trajectory_ids) == sorted(
        [samples[0].trajectory_id, samples[3].trajectory_id])
