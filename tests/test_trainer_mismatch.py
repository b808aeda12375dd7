"""The trainer's engine-mismatch figures: tokens sampled with the weights being trained apart from stale ones."""

from __future__ import annotations

import math

import torch

from tiderl.trainer import step as grpo_step
from tiderl.trainer.batch import TrainSample, collate
from tiderl.trainer.grpo import LossParts


def _parts(n: int, mismatch_sum: float) -> LossParts:
    """What grpo_loss reports of a micro-batch (its mismatch sum is over every trained token)."""
    return LossParts(loss=torch.zeros(()), pg_sum=0.0, kl_sum=0.0, ratio_sum=0.0, clipped_sum=0.0, num_tokens=n,
                     mismatch_sum=mismatch_sum)


def test_on_policy_and_stale_tokens_are_reported_apart() -> None:
    # Prompt of 2 tokens, then 4 sampled: two at version 3 (the weights trained now), two at version 2.
    sample = TrainSample(trajectory_id=1, group_id=1, token_ids=(5, 6, 7, 8, 9, 10), loss_mask=(0, 0, 1, 1, 1, 1),
                         rollout_logprobs=(0.0, 0.0, -1.0, -1.0, -2.0, -2.0), token_versions=(0, 0, 2, 2, 3, 3),
                         advantage=1.0)
    mb = collate([sample])
    trainer = torch.tensor([[0.0, -1.5, -1.5, -2.001, -2.003]])  # tokens 1..5
    acc = grpo_step.StepAccumulator(version=3)
    acc.add(mb, _parts(4, 0.5 + 0.5 + 0.001 + 0.003), trainer)
    stats = grpo_step.reduce_stats(acc, grad_norm=0.0, optimizer_s=0.0, started=0.0, group=None)
    assert math.isclose(stats.logprob_mismatch_on_policy, 0.002, abs_tol=1e-6)
    assert math.isclose(stats.logprob_mismatch_stale, 0.5, abs_tol=1e-6)


def test_a_step_without_tokens_of_a_kind_reports_none_of_it() -> None:
    sample = TrainSample(trajectory_id=1, group_id=1, token_ids=(5, 6, 7), loss_mask=(0, 1, 1),
                         rollout_logprobs=(0.0, -1.0, -1.0), token_versions=(0, 4, 4), advantage=1.0)
    acc = grpo_step.StepAccumulator(version=4)
    acc.add(collate([sample]), _parts(2, 0.0), torch.tensor([[-1.0, -1.0]]))
    stats = grpo_step.reduce_stats(acc, grad_norm=0.0, optimizer_s=0.0, started=0.0, group=None)
    assert stats.logprob_mismatch_on_policy == 0.0 and math.isnan(stats.logprob_mismatch_stale)
