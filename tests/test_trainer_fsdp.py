"""The FSDP2 backend on 2 gloo ranks against one process (`trainer.backend: fsdp`).

One step from the same weights on the same micro-batches gives the same weights whichever rank trains
which micro-batch: split 2-2, 3-1 and 0-2 (the rank with fewer runs zero-loss padding passes, the rank
with none only those), with activation checkpointing on the sharded side; every RA2P mode of a trainer group; a checkpoint that
each rank writes its shards of continues exactly where the group stopped; and the state re-sharded from two
ranks to one and back (ERS moving an actor) is the same, bit for bit, and trains on as a group that never
moved. Each rank holds half of the actor's state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tiderl.config.trainer import TrainerConfig
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.backend import OptimConfig, make_backend
from tiderl.trainer.local import LocalGroupJob, SyntheticSource, run_local_group
from tiderl.trainer.modes import TrainerComm, run_actor_share
from tiderl.trainer.plan import StepPlan, plan_step
from tiderl.trainer.publish import Checkpointer
from tiderl.trainer.state import state_dicts
from tiderl.trainer.step import LossConfig, StepAccumulator
from tiderl.trainer.synthetic import make_model_dir, random_samples

pytestmark = pytest.mark.slow

OPTIM = OptimConfig(lr=1e-3)
LOSS = LossConfig(kl_coef=0.05)
ATOL = 2e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("base"))


def _plan(version: int, num_micro_batches: int, assignment: tuple[tuple[int, ...], ...]) -> StepPlan:
    """A colocated plan of `num_micro_batches` one-sequence micro-batches, shared out as `assignment`."""
    samples = random_samples(num_micro_batches, 1, min_tokens=24, max_tokens=48, version=version, seed=version)
    plan = plan_step(samples, version=version, mode=Ra2pMode.COLOCATED, num_actors=1, micro_batch_tokens=48)
    assert len(plan.micro_batches) == num_micro_batches
    return dataclasses.replace(plan, assignment=assignment)


def _step(actor, ref, comm: TrainerComm, plan: StepPlan) -> float:
    acc = StepAccumulator(version=plan.version)
    run_actor_share(plan, actor, ref, comm, LOSS, acc, normalizer=plan.normalizer)
    return actor.step().grad_norm


def _one_process(base: Path, plans: list[StepPlan]) -> tuple[dict[str, torch.Tensor], list[float], int]:
    torch.manual_seed(0)
    actor = make_backend("torch", "actor", base, optim=OPTIM)
    ref = make_backend("torch", "ref", base)
    comm = TrainerComm(rank=0, actor_ranks=(0,))
    norms = [_step(actor, ref, comm, dataclasses.replace(p, assignment=(tuple(range(len(p.micro_batches))),)))
             for p in plans]
    return actor.full_weights(), norms, sum(p.numel() for p in actor.model.parameters())


def _group_rank(rank: int, base: Path, out: Path, splits: list[tuple[int, tuple[tuple[int, ...], ...]]],
                checkpoint_after: int | None, recompute: bool) -> None:
    """Both ranks train `splits` (one step each); with `checkpoint_after`, the group checkpoints after that
    many steps, every rank builds a fresh actor from the base model and loads the checkpoint, and the
    remaining steps run on the fresh actors. `recompute`: activation checkpointing."""
    from tiderl.trainer.group import init_trainer_group, leave_trainer_group

    torch.set_num_threads(1)
    comm = init_trainer_group(rank, 2, 0, out / "rendezvous")
    try:
        def fresh():
            return make_backend("fsdp", "actor", base, optim=OPTIM, dp_group=comm.dp_group,
                                activation_checkpointing=recompute)

        actor, ref = fresh(), make_backend("fsdp", "ref", base)
        assert actor.read_weights == (rank == 0)  # the second rank built a skeleton and got its shards sent
        local = sum(p.to_local().numel() for p in actor.model.parameters())
        norms = []
        for k, (n, assignment) in enumerate(splits):
            if k == checkpoint_after:
                checkpointer = Checkpointer(out / "ckpt", every=1)
                path = checkpointer.save(actor, step=k, version=k)  # every rank writes its shards
                assert (path is not None) == (rank == 0)
                actor = fresh()
                checkpointer.restore(actor, checkpointer.latest())
            norms.append(_step(actor, ref, comm, _plan(k, n, assignment)))
        weights = actor.full_weights()
        if rank == 0:
            actor.save_weights(out / "published")
            torch.save({"weights": weights, "norms": norms, "local": local}, out / "rank0.pt")
        else:
            assert weights == {}
            actor.save_weights(None)
            torch.save({"local": local}, out / "rank1.pt")
    finally:
        leave_trainer_group()


def _run_group(base: Path, out: Path, splits, checkpoint_after: int | None = None, recompute: bool = False) -> dict:
    import torch.multiprocessing as tmp

    out.mkdir(parents=True, exist_ok=True)
    tmp.spawn(_group_rank, args=(base, out, splits, checkpoint_after, recompute), nprocs=2, join=True)
    return torch.load(out / "rank0.pt") | {"local1": torch.load(out / "rank1.pt")["local"]}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= ATOL, worst


SPLITS = [(4, ((0, 1), (2, 3))), (4, ((0, 1, 2), (3,))), (2, ((), (0, 1)))]


def test_a_sharded_step_equals_one_process_whatever_the_split(base: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    group = _run_group(base, tmp_path / "group", SPLITS, recompute=True)  # and activation checkpointing
    weights, norms, total = _one_process(base, [_plan(k, n, a) for k, (n, a) in enumerate(SPLITS)])
    _close(group["weights"], weights)
    assert group["norms"] == pytest.approx(norms, rel=1e-4)
    # Each rank holds half of every parameter (dim 0 split in two; the tied output layer is the embedding).
    assert group["local"] + group["local1"] == total and abs(group["local"] - total / 2) < total * 0.05
    # The first rank published the gathered weights as a model directory.
    published = AutoModelForCausalLM.from_pretrained(tmp_path / "group" / "published").state_dict()
    _close({k: published[k] for k in weights}, weights)


def test_a_checkpoint_of_the_shards_continues_the_group_exactly(base: Path, tmp_path: Path) -> None:
    steps = [SPLITS[1], SPLITS[0], SPLITS[1]]
    straight = _run_group(base, tmp_path / "straight", steps)
    resumed = _run_group(base, tmp_path / "resumed", steps, checkpoint_after=2)
    for k in straight["weights"]:
        assert torch.equal(straight["weights"][k], resumed["weights"][k]), k
    assert straight["norms"] == resumed["norms"]


def test_every_ra2p_mode_of_a_sharded_group_gives_the_one_process_step(base: Path, tmp_path: Path) -> None:
    config = TrainerConfig(micro_batch_tokens=96, lr=1e-3, kl_coef=0.05, checkpoint_every=100, backend="fsdp")
    source = SyntheticSource(num_groups=3, group_size=4)
    modes = (Ra2pMode.COLOCATED, Ra2pMode.DECOUPLED, Ra2pMode.VANILLA_STREAM)
    job = LocalGroupJob(config=config, base_model=base, run_dir=tmp_path / "run", out_dir=tmp_path / "out",
                        source=source, modes=modes, num_actors=2, num_refs=1, num_steps=1)
    records = run_local_group(job, timeout_s=600)
    from tiderl.trainer.rank import ActorRank

    single = ActorRank(dataclasses.replace(config, backend="torch"), TrainerComm(rank=0, actor_ranks=(0,)),
                       base_model=base, weights_root=tmp_path / "single" / "w", ckpt_root=tmp_path / "single" / "c",
                       with_ref=True, resume=False)
    stats = single.train_step(source.next_step(0, Ra2pMode.COLOCATED)).stats
    for mode in modes:
        _close(torch.load(tmp_path / "out" / f"rank0-{mode.value}.pt"), single.actor.full_weights())
        assert not (tmp_path / "out" / f"rank1-{mode.value}.pt").exists()  # only the first rank gathers
        assert records[0][mode.value][0]["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-4), mode
        # the padding passes of the lockstep count no entropy
        assert records[0][mode.value][0]["entropy"] == pytest.approx(stats.entropy, rel=1e-5), mode
        assert (tmp_path / "run" / mode.value / "weights" / "v1").is_dir(), mode


def _full_state(actor) -> dict:
    """The actor's weights and AdamW state, whole, by parameter name (gathered from the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, optim = state_dicts(actor.model, actor.optimizer, StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Whole on the first rank, empty elsewhere; copies (unsharded, torch hands out the live tensors).
    return {"model": {k: v.clone() for k, v in model.items()},
            "optim": {n: {k: v.clone() for k, v in st.items()} for n, st in optim.get("state", {}).items()}}


def _reshard_rank(rank: int, base: Path, out: Path, phase: str, steps: list) -> None:
    """Both ranks, a group, train `steps` (see _train_phase)."""
    from tiderl.trainer.group import init_trainer_group, leave_trainer_group

    torch.set_num_threads(1)
    comm = init_trainer_group(rank, 2, 0, out / f"rendezvous-{phase}")
    try:
        _train_phase(rank, base, out, phase, steps, comm)
    finally:
        leave_trainer_group()


def _train_phase(rank: int, base: Path, out: Path, phase: str, steps: list, comm: TrainerComm) -> None:
    """Train `steps` from the newest checkpoint in out/ckpt (the base model without one), then checkpoint;
    the first rank records the whole state it started from and ended with."""
    checkpointer = Checkpointer(out / "ckpt", every=1)
    actor = make_backend("fsdp", "actor", base, optim=OPTIM, dp_group=comm.dp_group)
    ref = make_backend("fsdp", "ref", base)
    latest = checkpointer.latest()
    if latest is not None:
        checkpointer.restore(actor, latest)
    start = _full_state(actor)
    for k, (n, assignment) in steps:
        _step(actor, ref, comm, _plan(k, n, assignment))
    checkpointer.save(actor, step=steps[-1][0] + 1, version=steps[-1][0] + 1)
    end, weights = _full_state(actor), actor.full_weights()  # collectives: gathered onto the first rank
    if rank == 0:
        torch.save({"start": start, "end": end, "weights": weights}, out / f"{phase}.pt")


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _equal(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_the_state_re_shards_from_two_actors_to_one_and_back_exactly(base: Path, tmp_path: Path) -> None:
    """ERS moves an actor away after step 0 and back after step 1: the group's checkpoint of its shards is read
    whole by the lone actor, whose checkpoint is read as shards by the group again."""
    import torch.multiprocessing as tmp

    lone = [(1, (4, ((0, 1, 2, 3),)))]
    tmp.spawn(_reshard_rank, args=(base, tmp_path / "moved", "two", [(0, SPLITS[0])]), nprocs=2, join=True)
    _train_phase(0, base, tmp_path / "moved", "one", lone, TrainerComm(rank=0, actor_ranks=(0,)))
    tmp.spawn(_reshard_rank, args=(base, tmp_path / "moved", "back", [(2, SPLITS[1])]), nprocs=2, join=True)
    two, one, back = (torch.load(tmp_path / "moved" / f"{p}.pt", weights_only=True) for p in ("two", "one", "back"))
    assert one["start"]["optim"] and back["start"]["optim"], "AdamW moments in the checkpoints"
    _equal(one["start"], two["end"])  # weights and moments, two shards read whole
    _equal(back["start"], one["end"])  # and whole read as two shards
    # The steps after the moves within 1e-5 of a group that never moved (one rank summed what two did).
    tmp.spawn(_reshard_rank, args=(base, tmp_path / "still", "two", [(0, SPLITS[0]), (1, (4, ((0, 1), (2, 3)))),
                                                                      (2, SPLITS[1])]), nprocs=2, join=True)
    still = torch.load(tmp_path / "still" / "two.pt", weights_only=True)
    worst = max(float((back["weights"][k] - still["weights"][k]).abs().max()) for k in still["weights"])
    assert worst <= 1e-5, worst


def test_a_checkpoint_of_either_backend_resumes_the_other(base: Path, tmp_path: Path) -> None:
    """Checkpoints are DCP's, keyed by parameter name: a run resumed with the other `trainer.backend` (one
    actor) continues from the same weights and AdamW moments, bit for bit."""
    plan = _plan(0, 2, ((0, 1),))
    for first, second in (("torch", "fsdp"), ("fsdp", "torch")):
        torch.manual_seed(0)
        writer = make_backend(first, "actor", base, optim=OPTIM)
        _step(writer, make_backend(first, "ref", base), TrainerComm(rank=0, actor_ranks=(0,)), plan)
        checkpointer = Checkpointer(tmp_path / f"{first}-ckpt", every=1)
        checkpointer.save(writer, step=1, version=1)
        reader = make_backend(second, "actor", base, optim=OPTIM)
        checkpointer.restore(reader, checkpointer.latest())
        _equal(_full_state(reader), _full_state(writer))
