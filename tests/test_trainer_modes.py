"""RA2P executors in one process: ready-batch aggregation follows arrivals, swaps are real."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tiderl.config.trainer import TrainerConfig
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.modes import TrainerComm
from tiderl.trainer.rank import ActorRank, StepInput
from tiderl.trainer.synthetic import make_model_dir, random_samples

torch.set_num_threads(1)
CONFIG = TrainerConfig(micro_batch_tokens=64, lr=1e-3)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("base"))


def _step(base: Path, root: Path, mode: Ra2pMode, ready: tuple[float, ...] | None = None):
    node = ActorRank(CONFIG, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base, weights_root=root / "w",
                     ckpt_root=root / "c", with_ref=True, resume=False)
    samples = tuple(random_samples(2, 4, min_tokens=12, max_tokens=30, seed=11))
    result = node.train_step(StepInput(0, samples, mode, ready))
    return result.stats, node.actor.model.state_dict()


def test_colocated_aggregates_each_wave_of_ready_micro_batches(base, tmp_path):
    # the first group is ready at the start, the second 0.3 s later: two bursts, one swap pair each
    stats, _ = _step(base, tmp_path, Ra2pMode.COLOCATED, ready=(0.0,) * 4 + (0.3,) * 4)
    assert stats.num_swaps == 4
    assert stats.num_micro_batches >= 2
    assert stats.t_swap_s > 0
    all_ready, _ = _step(base, tmp_path / "b", Ra2pMode.COLOCATED)
    assert all_ready.num_swaps == 2 and all_ready.wait_data_s == 0.0


def test_vanilla_stream_without_offload_never_swaps_and_matches_colocated(base, tmp_path):
    vanilla, w_vanilla = _step(base, tmp_path / "v", Ra2pMode.VANILLA_STREAM)
    colocated, w_colocated = _step(base, tmp_path / "c", Ra2pMode.COLOCATED)
    offload, _ = _step(base, tmp_path / "o", Ra2pMode.VANILLA_STREAM_OFFLOAD)
    assert vanilla.num_swaps == 0
    assert offload.num_swaps == 2 * offload.num_micro_batches
    assert vanilla.loss == pytest.approx(colocated.loss, abs=1e-5)
    assert all(torch.allclose(w_vanilla[k], w_colocated[k], atol=2e-5) for k in w_vanilla)


def test_decoupled_without_ref_rank_is_refused(base, tmp_path):
    node = ActorRank(CONFIG, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base, weights_root=tmp_path / "w",
                     ckpt_root=tmp_path / "c", with_ref=False, resume=False)
    samples = tuple(random_samples(1, 4, seed=2))
    with pytest.raises(ValueError, match="ref rank"):
        node.train_step(StepInput(0, samples, Ra2pMode.DECOUPLED))
    with pytest.raises(ValueError, match="holds version 0"):
        node.train_step(StepInput(3, samples, Ra2pMode.COLOCATED))


def _node(base: Path, root: Path, config: TrainerConfig = CONFIG) -> ActorRank:
    return ActorRank(config, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base, weights_root=root / "w",
                     ckpt_root=root / "c", with_ref=True, resume=False)


@pytest.mark.parametrize("mode", [Ra2pMode.COLOCATED, Ra2pMode.VANILLA_STREAM])
def test_a_step_streamed_in_chunks_updates_the_weights_as_the_batch_step(base, tmp_path, mode):
    # Three chunks of complete groups, trained as they come, then one optimizer step: the gradients
    # were divided by the first chunk's tokens and rescaled to the batch's, so the update (and the
    # reported loss) is the batch step's over the same samples.
    samples = tuple(random_samples(6, 4, min_tokens=12, max_tokens=30, seed=5))
    batch = _node(base, tmp_path / "batch")
    whole = batch.train_step(StepInput(0, samples, mode))
    streamed = _node(base, tmp_path / "streamed")
    streamed.begin_step(0, mode)
    for chunk in (samples[:4], samples[4:16], samples[16:]):
        streamed.feed(chunk)
    result = streamed.finish_step()
    assert result.stats.num_sequences == whole.stats.num_sequences
    assert result.stats.num_tokens == whole.stats.num_tokens
    assert result.stats.loss == pytest.approx(whole.stats.loss, rel=1e-4, abs=1e-6)
    assert result.stats.grad_norm == pytest.approx(whole.stats.grad_norm, rel=1e-4)
    a, b = batch.actor.model.state_dict(), streamed.actor.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=2e-6) for k in a)
    assert streamed.version == 1 and result.published.path.is_dir()
    assert set(result.trajectory_ids) == {s.trajectory_id for s in samples}


def test_a_streamed_step_holds_back_flat_groups_and_trains_them_only_if_nothing_else(base, tmp_path):
    config = TrainerConfig(micro_batch_tokens=64, lr=1e-3, skip_flat_groups=True)
    samples = random_samples(4, 4, min_tokens=12, max_tokens=30, seed=5)
    flat = tuple(replace(s, advantage=0.0) for s in samples[:8])  # two groups without signal
    live = tuple(s for s in samples[8:] if abs(s.advantage) > 0)
    assert live
    node = _node(base, tmp_path / "a", config)
    node.begin_step(0, Ra2pMode.COLOCATED)
    node.feed(flat)  # a chunk of flat groups alone trains nothing now
    node.feed(tuple(samples[8:]))
    stats = node.finish_step().stats
    assert stats.num_sequences == sum(1 for s in samples[8:] if _group_live(samples[8:], s))
    only_flat = _node(base, tmp_path / "b", config)
    only_flat.begin_step(0, Ra2pMode.COLOCATED)
    only_flat.feed(flat[:4])
    only_flat.feed(flat[4:])
    assert only_flat.finish_step().stats.num_sequences == 8  # every group flat: the batch rule trains them all


def _group_live(samples, s) -> bool:
    return any(abs(o.advantage) > 0 for o in samples if o.group_id == s.group_id)


def test_a_streamed_step_must_begin_and_train_the_held_version(base, tmp_path):
    node = _node(base, tmp_path)
    with pytest.raises(RuntimeError, match="begin_step first"):
        node.feed(tuple(random_samples(1, 4, seed=2)))
    with pytest.raises(ValueError, match="holds version 0"):
        node.begin_step(2, Ra2pMode.COLOCATED)
