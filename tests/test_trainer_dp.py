"""Data parallel over gloo processes and the RA2P modes: every mode computes the same update.

The GRPO loss is divided by the global token count and gradients are summed
across ranks, so however a mode splits, orders or places the micro-batches
(decoupled with a ref rank, colocated with aggregation, vanilla streaming),
one step from the same weights on the same batch gives the same weights.
"""

from pathlib import Path

import pytest
import torch

from tiderl.config.trainer import TrainerConfig
from tiderl.trainer.local import LocalGroupJob, SyntheticSource, run_local_group
from tiderl.trainer.modes import TrainerComm
from tiderl.trainer.plan import Ra2pMode
from tiderl.trainer.rank import ActorRank
from tiderl.trainer.synthetic import make_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("base"))


CONFIG = TrainerConfig(micro_batch_tokens=96, lr=1e-3, kl_coef=0.05, checkpoint_every=100)
SOURCE = SyntheticSource(num_groups=3, group_size=4)
MODES = (Ra2pMode.COLOCATED, Ra2pMode.DECOUPLED, Ra2pMode.VANILLA_STREAM_OFFLOAD)


def _single_process_step(base: Path, root: Path):
    torch.set_num_threads(1)
    node = ActorRank(CONFIG, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base, weights_root=root / "weights",
                     ckpt_root=root / "ckpt", with_ref=True, resume=False)
    result = node.train_step(SOURCE.next_step(0, Ra2pMode.COLOCATED))
    return result.stats, node.actor.model.state_dict()


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4) for k in a)


def test_all_modes_and_dp_layouts_give_the_same_step(base, tmp_path):
    single, w_single = _single_process_step(base, tmp_path / "single")
    job = LocalGroupJob(config=CONFIG, base_model=base, run_dir=tmp_path / "run", out_dir=tmp_path / "out",
                        source=SOURCE, modes=MODES, num_actors=2, num_refs=1, num_steps=1)
    records = run_local_group(job, timeout_s=600)
    for mode in MODES:
        w0, w1 = (torch.load(tmp_path / "out" / f"rank{r}-{mode.value}.pt") for r in (0, 1))
        # data parallel: both actor ranks hold identical weights after the step
        assert all(torch.equal(w0[k], w1[k]) for k in w0), mode
        assert _close(w0, w_single), mode
        stats = records[0][mode.value][0]
        assert stats["num_sequences"] == 12, mode
        assert stats["loss"] == pytest.approx(single.loss, abs=1e-4), mode
        assert stats["grad_norm"] == pytest.approx(single.grad_norm, rel=1e-4), mode
    # the decoupled ref rank served every share of both actors, and no actor swapped
    dec = [records[r]["decoupled"][0] for r in range(3)]
    assert dec[2]["num_served"] == dec[0]["num_micro_batches"] and dec[0]["num_swaps"] == 0
    assert records[2]["colocated"] == []
    # colocated: one swap pair per burst on each rank; vanilla with offload: one pair per micro-batch
    col, van = records[0]["colocated"][0], records[0]["vanilla_stream_offload"][0]
    assert col["num_swaps"] == 2 * 2
    assert van["num_swaps"] == 2 * van["num_micro_batches"]
