"""The learning-rate schedule: a pure function of the step's version, applied before every step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tiderl.config.schema import ConfigError, build
from tiderl.config.trainer import TrainerConfig
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.modes import TrainerComm
from tiderl.trainer.local import SyntheticSource
from tiderl.trainer.rank import ActorRank, lr_at
from tiderl.trainer.synthetic import make_model_dir


def test_constant_linear_and_cosine_by_hand() -> None:
    const = TrainerConfig(lr=1e-3, num_steps=10)
    assert [lr_at(const, v) for v in (0, 5, 9)] == [1e-3, 1e-3, 1e-3]
    linear = TrainerConfig(lr=1e-3, num_steps=10, lr_schedule="linear")
    assert lr_at(linear, 0) == pytest.approx(1e-3)
    assert lr_at(linear, 5) == pytest.approx(5e-4)
    assert lr_at(linear, 9) == pytest.approx(1e-4)
    floor = TrainerConfig(lr=1e-3, num_steps=10, lr_schedule="linear", lr_final_ratio=0.2)
    assert lr_at(floor, 5) == pytest.approx(1e-3 * (0.2 + 0.8 * 0.5))
    assert lr_at(floor, 10) == pytest.approx(2e-4) == lr_at(floor, 50)  # a run extended past num_steps
    cosine = TrainerConfig(lr=1e-3, num_steps=10, lr_schedule="cosine")
    assert lr_at(cosine, 5) == pytest.approx(5e-4)
    assert lr_at(cosine, 2) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.2)))


def test_warmup_rises_linearly_then_follows_the_schedule() -> None:
    const = TrainerConfig(lr=1e-3, num_steps=10, lr_warmup_steps=4)
    assert [lr_at(const, v) for v in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    linear = TrainerConfig(lr=1e-3, num_steps=10, lr_schedule="linear", lr_warmup_steps=2)
    assert lr_at(linear, 0) == pytest.approx(5e-4)
    assert lr_at(linear, 5) == pytest.approx(5e-4)
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        build(TrainerConfig, {"lr_warmup_steps": -1}, "job.yaml")


def test_bad_schedule_names_the_key() -> None:
    with pytest.raises(ConfigError, match="lr_schedule"):
        build(TrainerConfig, {"lr_schedule": "step"}, "job.yaml")
    with pytest.raises(ConfigError, match="lr_final_ratio"):
        build(TrainerConfig, {"lr_final_ratio": 1.5}, "job.yaml")


def test_each_step_uses_the_scheduled_rate(tmp_path: Path) -> None:
    config = TrainerConfig(micro_batch_tokens=96, lr=1e-3, num_steps=4, lr_schedule="linear", checkpoint_every=100)
    node = ActorRank(config, TrainerComm(rank=0, actor_ranks=(0,)), base_model=make_model_dir(tmp_path / "base"),
                     weights_root=tmp_path / "w", ckpt_root=tmp_path / "c", with_ref=True, resume=False)
    source = SyntheticSource(num_groups=1, group_size=2)
    seen = []
    for v in range(3):
        node.train_step(source.next_step(v, Ra2pMode.COLOCATED))
        seen.append(node.actor.optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([1e-3, 7.5e-4, 5e-4])
