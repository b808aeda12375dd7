"""The trainer against a real run store: claims the elastic batch, publishes the version row."""

import random
from pathlib import Path

import torch

from tiderl.config.trainer import TrainerConfig
from tiderl.policy.ra2p import Ra2pMode
from tiderl.store import FinishedTrajectory, NewGroup, RankReport, Role, RunStore, TaskKind
from tiderl.trainer.modes import TrainerComm
from tiderl.trainer.rank import ActorRank
from tiderl.trainer.store_io import StoreStepSource, StoreVersionSink
from tiderl.trainer.synthetic import make_model_dir

torch.set_num_threads(1)
TRAINER = 3


def _store(tmp_path: Path) -> RunStore:
    s = RunStore.for_run_dir(tmp_path)
    s.create_schema()
    s.init_run(name="t", system="tiderl", config_yaml="system: tiderl\n")
    s.register_initial_version("weights/v0", "sum0")
    s.register_rank(0, Role.ROLLOUT)
    s.register_rank(TRAINER, Role.ACTOR)
    return s


def _finish_groups(s: RunStore, n: int, seed: int) -> None:
    rng = random.Random(seed)
    s.add_groups([NewGroup(TaskKind.TRAIN, seed * 100 + g, 4) for g in range(n)])
    finished = []
    for c in s.claim_tasks(0, 4 * n):
        k = rng.randint(8, 20)
        mask = [0, 0, 0] + [1] * (k - 3)
        finished.append(FinishedTrajectory(
            task_id=c.task_id, token_ids=[rng.randrange(3, 300) for _ in range(k)], loss_mask=mask,
            logprobs=[-1.5 * m for m in mask], token_versions=[0 if m else -1 for m in mask],
            num_turns=2, reward=float(rng.random() < 0.5), success=False))
    s.report(RankReport(rank=0, finished=finished))


def test_store_source_and_sink_train_each_trajectory_once(tmp_path):
    base = make_model_dir(tmp_path / "base")
    s = _store(tmp_path)
    _finish_groups(s, 3, seed=1)
    source = StoreStepSource(s, TRAINER, groups_min=2, groups_ideal=2, choose_mode=lambda ready: Ra2pMode.COLOCATED,
                             poll_s=0.01)
    config = TrainerConfig(micro_batch_tokens=64, groups_min=2, groups_ideal=2)
    node = ActorRank(config, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base,
                     weights_root=tmp_path / "weights", ckpt_root=tmp_path / "ckpt", with_ref=True, resume=False)
    sink = StoreVersionSink(s, TRAINER)
    node.run(source, sink, num_steps=1)
    assert s.run_info()["version"] == 1
    (step,) = s.steps()
    assert step["num_trajectories"] == 8  # B_ideal = 2 groups of 4
    # one group is left; below B_min the source waits, and gives its claims back when told to stop
    stop = iter([False, False, True])
    waiting = StoreStepSource(s, TRAINER, 2, 2, lambda ready: Ra2pMode.COLOCATED, poll_s=0.01,
                              should_stop=lambda: next(stop))
    assert waiting.next_step(1) is None
    assert s.buffer_state()["groups_ready"] == 1 and s.buffer_state()["traj_claimed"] == 0
    _finish_groups(s, 1, seed=2)
    node.run(source, sink, num_steps=2)
    assert s.run_info()["version"] == 2
    assert s.buffer_state()["traj_consumed"] == 16 and s.buffer_state()["traj_ready"] == 0
    assert sum(r["num_trajectories"] for r in s.steps()) == 16
