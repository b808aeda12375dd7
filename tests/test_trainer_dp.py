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
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.local import LocalGroupJob, SyntheticSource, run_local_group
from tiderl.trainer.modes import TrainerComm
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
        # token-weighted over both actors' shares, as the loss: the one process's mean over every trained token
        assert stats["entropy"] == pytest.approx(single.entropy, rel=1e-5), mode
    # the decoupled ref rank served every share of both actors, and no actor swapped
    dec = [records[r]["decoupled"][0] for r in range(3)]
    assert dec[2]["num_served"] == dec[0]["num_micro_batches"] and dec[0]["num_swaps"] == 0
    assert records[2]["colocated"] == []
    # colocated: one swap pair per burst on each rank; vanilla with offload: one pair per micro-batch
    col, van = records[0]["colocated"][0], records[0]["vanilla_stream_offload"][0]
    assert col["num_swaps"] == 2 * 2
    assert van["num_swaps"] == 2 * van["num_micro_batches"]


def _catch_up_rank(rank: int, base: Path, root: Path, joiner: str) -> None:
    """Rank 0 trains version 0 alone and publishes it; rank 1 joins the group for version 1 (an
    elastic-actor move): either "fresh" (it loads the published version 1 with fresh optimizer
    moments, as a rank new to the actor role does) or "stale" (it still holds version 0, as a rank
    returning to the actor role does). Both then train version 1 data parallel."""
    from tiderl.trainer.group import init_trainer_group, leave_trainer_group

    torch.set_num_threads(1)

    def actor(resume: bool) -> ActorRank:
        return ActorRank(CONFIG, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base, weights_root=root / "weights",
                         ckpt_root=root / f"ckpt{rank}", with_ref=True, resume=resume)

    node = actor(False) if rank == 0 or joiner == "stale" else None
    if rank == 0:
        node.train_step(SOURCE.next_step(0, Ra2pMode.COLOCATED))
    comm = init_trainer_group(rank, 2, 0, root / "rendezvous")  # rank 0 has published version 1 by now
    try:
        node = node or actor(True)
        held = (node.version, node.exact)
        node.comm, node.actor.dp_group = comm, comm.dp_group
        replaced = node.catch_up(1)
        node.train_step(SOURCE.next_step(1, Ra2pMode.COLOCATED))
        torch.save({"held": held, "replaced": replaced, "version": node.version,
                    "model": node.actor.model.state_dict(), "optimizer": node.actor.optimizer.state_dict()["state"]},
                   root / f"rank{rank}.pt")
    finally:
        leave_trainer_group()


@pytest.mark.parametrize("joiner", ["fresh", "stale"])
def test_a_joining_actor_takes_weights_and_optimizer_state_from_the_group(base, tmp_path, joiner):
    import torch.multiprocessing as tmp

    torch.set_num_threads(1)
    single = ActorRank(CONFIG, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base,
                       weights_root=tmp_path / "single" / "weights", ckpt_root=tmp_path / "single" / "ckpt",
                       with_ref=True, resume=False)
    for v in (0, 1):
        single.train_step(SOURCE.next_step(v, Ra2pMode.COLOCATED))
    tmp.spawn(_catch_up_rank, args=(base, tmp_path, joiner), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r1["held"] == ((1, False) if joiner == "fresh" else (0, True))
    assert (r0["replaced"], r1["replaced"]) == (False, True)
    assert r0["version"] == r1["version"] == 2
    # identical replicas, and the same update as one actor that trained both steps: the joiner's
    # Adam moments came from rank 0 (fresh moments would give a different second update)
    assert all(torch.equal(r0["model"][k], r1["model"][k]) for k in r0["model"])
    assert _close(r0["model"], single.actor.model.state_dict())
    for i, st in r0["optimizer"].items():
        assert torch.equal(st["exp_avg"], r1["optimizer"][i]["exp_avg"])


def test_catch_up_without_a_group_names_the_versions(base, tmp_path):
    node = ActorRank(CONFIG, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base, weights_root=tmp_path / "w",
                     ckpt_root=tmp_path / "c", with_ref=True, resume=False)
    assert node.catch_up(0) is False
    with pytest.raises(RuntimeError, match="holds version 0, the step trains version 3"):
        node.catch_up(3)
