"""RA2P executors in one process: ready-batch aggregation follows arrivals, swaps are real."""

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
