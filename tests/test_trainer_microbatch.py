"""Elastic global batch and micro-batch formation: one test per invariant."""

import random

import pytest
import torch

from tiderl.trainer.batch import TrainSample, collate
from tiderl.trainer.microbatch import form_micro_batches, groups_to_take, padded_tokens


def test_groups_to_take_is_elastic():
    assert groups_to_take(1, groups_min=2, groups_ideal=4) == 0
    assert groups_to_take(3, groups_min=2, groups_ideal=4) == 3
    assert groups_to_take(9, groups_min=2, groups_ideal=4) == 4
    # a planner target toward B_min, clamped into [B_min, B_ideal]
    assert groups_to_take(9, 2, 4, target=2) == 2
    assert groups_to_take(9, 2, 4, target=1) == 2
    assert groups_to_take(9, 2, 4, target=7) == 4
    for ready in range(12):
        n = groups_to_take(ready, 3, 6)
        assert n == 0 or 3 <= n <= min(ready, 6)
    with pytest.raises(ValueError, match="groups_min"):
        groups_to_take(3, 5, 4)


def _random_counts(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]


def test_every_sequence_exactly_once():
    for seed in range(20):
        counts = _random_counts(seed)
        mbs = form_micro_batches(counts, 512)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(counts)))


def test_budget_respected_except_single_oversized():
    for seed in range(20):
        counts = _random_counts(seed) + [900]
        for mb in form_micro_batches(counts, 512):
            size = padded_tokens([counts[i] for i in mb])
            assert size <= 512 or (len(mb) == 1 and counts[mb[0]] > 512)


def test_last_micro_batch_is_smallest():
    for seed in range(20):
        counts = _random_counts(seed)
        sizes = [padded_tokens([counts[i] for i in mb]) for mb in form_micro_batches(counts, 400)]
        assert sizes == sorted(sizes, reverse=True)


def test_deterministic():
    counts = [50, 50, 20, 20, 100, 7]
    assert form_micro_batches(counts, 100) == form_micro_batches(list(counts), 100)
    assert form_micro_batches(counts, 100) == [[4], [0, 1], [2, 3, 5]]


def _sample(tid: str, ids: list[int], mask: list[int], adv: float) -> TrainSample:
    n = len(ids)
    return TrainSample(tid, "g", tuple(ids), tuple(mask), tuple(-0.5 * m for m in mask), (3,) * n, adv)


def test_collate_shifts_and_pads():
    mb = collate([_sample("a", [5, 6, 7], [0, 1, 1], 1.5), _sample("b", [5, 9], [0, 1], -1.0)], index=2)
    assert mb.input_ids.tolist() == [[5, 6, 7], [5, 9, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert mb.loss_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert mb.old_logprobs.tolist() == [[-0.5, -0.5], [-0.5, 0.0]]
    assert torch.equal(mb.token_versions, torch.tensor([[3, 3], [3, -1]]))
    assert mb.num_model_tokens == 3 and mb.index == 2


def test_sample_validation_names_the_trajectory():
    with pytest.raises(ValueError, match="t9: loss_mask"):
        TrainSample("t9", "g", (1, 2, 3), (0, 1), (0.0, 0.0, 0.0), (0, 0, 0), 0.0)
