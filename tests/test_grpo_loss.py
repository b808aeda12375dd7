"""GRPO loss math against hand-computed values."""

import math

import pytest
import torch

from tiderl.trainer.grpo import clipped_policy_loss, grpo_loss, kl_penalty, token_logprobs


def _case(estimator: str, kl_coef: float = 0.1):
    lp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1.2, -1.0]])
    ref = torch.tensor([[-0.5, -1.0, -2.5]])
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    parts = grpo_loss(lp, old, ref, adv, mask, clip_eps=0.2, kl_coef=kl_coef, kl_estimator=estimator, normalizer=2.0)
    return lp, parts


def test_loss_k1_matches_hand_computation():
    # token0: ratio 1, pg -2, k1 0.5 -> -1.95; token1: ratio e^0.2 = 1.2214 clipped to 1.2,
    # pg -2.4, k1 0 -> -2.4; token2 masked. (-1.95 - 2.4) / 2 = -2.175
    lp, parts = _case("k1")
    assert parts.loss.item() == pytest.approx(-2.175, abs=1e-6)
    assert parts.pg_sum == pytest.approx(-4.4, abs=1e-6)
    assert parts.kl_sum == pytest.approx(0.5, abs=1e-6)
    assert parts.clipped_sum == 1.0
    assert parts.num_tokens == 2
    assert parts.ratio_sum == pytest.approx(1.0 + math.exp(0.2), abs=1e-6)


def test_loss_k3_matches_hand_computation():
    # k3 token0: exp(-0.5) + 0.5 - 1 = 0.1065307; (-2 + 0.1*0.1065307 - 2.4) / 2
    _, parts = _case("k3")
    assert parts.loss.item() == pytest.approx((-4.4 + 0.1 * (math.exp(-0.5) - 0.5)) / 2, abs=1e-6)
    assert parts.kl_sum == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-6)


def test_gradient_matches_hand_computation():
    # token0 unclipped: d(-r A)/dlp = -r A = -2, plus kl_coef * dk1/dlp = 0.1; / normalizer 2.
    # token1 clipped: the pg term has no gradient, only the KL term: 0.1 / 2. token2 masked.
    lp, parts = _case("k1")
    parts.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-0.95, 0.05, 0.0], abs=1e-6)


def test_negative_advantage_takes_pessimistic_branch():
    # ratio 0.5 with A = -1: unclipped 0.5, clipped 0.8 -> 0.8 and counted as clipped
    loss, ratio, clipped = clipped_policy_loss(
        torch.tensor([math.log(0.5)]), torch.tensor([0.0]), torch.tensor([-1.0]), 0.2
    )
    assert loss.item() == pytest.approx(0.8)
    assert ratio.item() == pytest.approx(0.5)
    assert bool(clipped.item())


def test_kl_estimators():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    k3 = kl_penalty(lp, ref, "k3")
    assert k3.tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1.0, 0.0])
    assert bool((kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all())
    with pytest.raises(ValueError, match="unknown estimator"):
        kl_penalty(lp, ref, "k2")


def test_masked_tokens_do_not_change_the_loss():
    lp = torch.tensor([[0.0, -1.0]])
    base = grpo_loss(lp, lp, lp, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]),
                     clip_eps=0.2, kl_coef=0.1, kl_estimator="k3", normalizer=1.0)
    lp2 = torch.tensor([[0.0, -7.0]])
    other = grpo_loss(lp2, torch.tensor([[0.0, 3.0]]), torch.tensor([[0.0, 9.0]]), torch.tensor([1.0]),
                      torch.tensor([[1.0, 0.0]]), clip_eps=0.2, kl_coef=0.1, kl_estimator="k3", normalizer=1.0)
    assert base.loss.item() == pytest.approx(other.loss.item())


def test_split_micro_batches_sum_to_global_token_mean():
    torch.manual_seed(0)
    lp, old, ref = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)
    adv, mask = torch.randn(4), (torch.rand(4, 5) > 0.3).float()
    n = float(mask.sum())
    kw = dict(clip_eps=0.2, kl_coef=0.05, kl_estimator="k3", normalizer=n)
    whole = grpo_loss(lp, old, ref, adv, mask, **kw).loss
    parts = sum(grpo_loss(lp[s], old[s], ref[s], adv[s], mask[s], **kw).loss for s in (slice(0, 1), slice(1, 4)))
    assert whole.item() == pytest.approx(parts.item(), abs=1e-5)


def test_token_logprobs_shift():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = math.log(3.0)  # position 0 predicts token 1 = id 2 with p = 3/6
    ids = torch.tensor([[1, 2, 3]])
    out = token_logprobs(logits, ids)
    assert out.shape == (1, 2)
    assert out[0, 0].item() == pytest.approx(math.log(0.5))
    assert out[0, 1].item() == pytest.approx(math.log(0.25))


def test_bad_shapes_and_missing_ref_are_named():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo_loss(lp, torch.zeros(1, 3), None, torch.zeros(1), lp, clip_eps=0.2, kl_coef=0.0,
                  kl_estimator="k1", normalizer=1.0)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(lp, lp, None, torch.zeros(1), lp, clip_eps=0.2, kl_coef=0.1, kl_estimator="k1", normalizer=1.0)
    with pytest.raises(ValueError, match="normalizer"):
        grpo_loss(lp, lp, None, torch.zeros(1), lp, clip_eps=0.2, kl_coef=0.0, kl_estimator="k1", normalizer=0.0)


def test_kl_is_reported_but_not_penalised_when_kl_coef_is_zero():
    lp, _ = _case("k1")
    parts = grpo_loss(lp, torch.tensor([[0.0, -1.2, -1.0]]), torch.tensor([[-0.5, -1.0, -2.5]]), torch.tensor([2.0]),
                      torch.tensor([[1.0, 1.0, 0.0]]), clip_eps=0.2, kl_coef=0.0, kl_estimator="k1", normalizer=2.0)
    assert parts.loss.item() == pytest.approx(-2.2, abs=1e-6)
    assert parts.kl_sum == pytest.approx(0.5, abs=1e-6)


def test_token_logprobs_are_those_of_the_tempered_distribution():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[0, 0]])
    for t in (0.5, 0.7, 2.0):
        want = 2.0 / t - math.log(math.exp(2.0 / t) + 1.0 + math.exp(-1.0 / t))
        assert token_logprobs(logits, ids, temperature=t).item() == pytest.approx(want, abs=1e-6)
    assert token_logprobs(logits, ids).item() == pytest.approx(2.0 - math.log(math.exp(2) + 1 + math.exp(-1)))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, temperature=0.0)


def test_one_impossible_masked_token_leaves_loss_and_gradient_finite():
    # A prompt position (mask 0) the policy finds impossible: log-prob -100 against a ref of -5.
    logprobs = torch.tensor([[-100.0, -0.5]], requires_grad=True)
    old = torch.tensor([[0.0, -0.6]])
    ref = torch.tensor([[-5.0, -0.4]])
    mask = torch.tensor([[0.0, 1.0]])
    parts = grpo_loss(logprobs, old, ref, torch.tensor([1.0]), mask, clip_eps=0.2, kl_coef=0.1,
                      kl_estimator="k3", normalizer=1.0)
    parts.loss.backward()
    assert math.isfinite(parts.loss.item()) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 0].item() == 0.0
    # The masked token changes nothing: the loss is the one masked token's alone.
    r = math.exp(-0.5 + 0.6)
    k3 = math.exp(-0.4 + 0.5) - (-0.4 + 0.5) - 1
    assert parts.loss.item() == pytest.approx(-min(r, 1.2) * 1.0 + 0.1 * k3, rel=1e-5)


def test_k3_is_clamped_so_a_far_off_token_stays_finite():
    kl = kl_penalty(torch.tensor([-200.0, 0.0]), torch.tensor([0.0, -200.0]), "k3")
    assert torch.isfinite(kl).all() and kl.max().item() == pytest.approx(10.0)


def test_dual_clip_bounds_a_negative_advantage_at_c():
    lp, old = torch.tensor([math.log(5.0)]), torch.tensor([0.0])  # ratio 5
    neg = torch.tensor([-1.0])
    plain, _, _ = clipped_policy_loss(lp, old, neg, 0.2)
    dual, ratio, clipped = clipped_policy_loss(lp, old, neg, 0.2, dual_clip=3.0)
    assert plain.item() == pytest.approx(5.0) and dual.item() == pytest.approx(3.0) and bool(clipped)
    pos = torch.tensor([1.0])  # a positive advantage keeps the plain clip
    assert clipped_policy_loss(lp, old, pos, 0.2, dual_clip=3.0)[0].item() == pytest.approx(-1.2)
    small = clipped_policy_loss(torch.tensor([math.log(2.0)]), old, neg, 0.2, dual_clip=3.0)[0]
    assert small.item() == pytest.approx(2.0)  # under c: untouched
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_policy_loss(lp, old, neg, 0.2, dual_clip=1.0)


def test_training_config_refuses_greedy_training_tasks_and_groups_of_one():
    from tiderl.config.rollout import RolloutConfig
    from tiderl.config.schema import ConfigError, build

    for bad, key in (({"temperature": 0}, "temperature"), ({"group_size": 1}, "group_size")):
        with pytest.raises(ConfigError, match=key):
            build(RolloutConfig, bad, "job.yaml")


def test_decoupled_off_policy_weights_the_gradient_by_the_truncated_importance_weight():
    # Two tokens: the trainer now gives them log-probs -1.0 and -0.2, the engine sampled them at -1.5
    # and -2.0 (stale weights or engine mismatch). Weights: min(e^0.5, 2) = 1.6487 and min(e^1.8, 2) = 2.
    lp = torch.tensor([[-1.0, -0.2]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])
    adv, mask = torch.tensor([1.0]), torch.tensor([[1.0, 1.0]])
    parts = grpo_loss(lp, old, None, adv, mask, clip_eps=0.2, kl_coef=0.0, kl_estimator="k3", normalizer=2.0,
                      off_policy="decoupled", is_cap=2.0)
    parts.loss.backward()
    w = [math.exp(0.5), 2.0]
    assert parts.loss.item() == pytest.approx(-(w[0] + w[1]) / 2)  # the proximal ratio is 1
    assert lp.grad.tolist()[0] == pytest.approx([-w[0] / 2, -w[1] / 2], rel=1e-6)
    assert parts.is_weight_sum == pytest.approx(sum(w)) and parts.is_truncated_sum == 1
    assert parts.mismatch_sum == pytest.approx(0.5 + 1.8) and parts.clipped_sum == 0
    # `none` clips the same tokens against the engine's log-probs: ratios e^0.5 and e^1.8, both past
    # 1.2 with a positive advantage, so no gradient flows at all.
    lp2 = torch.tensor([[-1.0, -0.2]], requires_grad=True)
    plain = grpo_loss(lp2, old, None, adv, mask, clip_eps=0.2, kl_coef=0.0, kl_estimator="k3", normalizer=2.0)
    plain.loss.backward()
    assert lp2.grad.abs().sum().item() == 0.0 and plain.clipped_sum == 2 and plain.is_weight_sum == 2.0
    with pytest.raises(ValueError, match="off_policy"):
        grpo_loss(lp, old, None, adv, mask, clip_eps=0.2, kl_coef=0.0, kl_estimator="k3", normalizer=2.0,
                  off_policy="tis-typo")


def _reference_entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
                       banned: tuple[int, ...] = ()) -> torch.Tensor:
    """Plain torch: the Categorical's entropy of each position's tempered (allowed-ids) distribution, masked."""
    scaled = logits[:, :-1].double() / temperature
    if banned:
        scaled[..., list(banned)] = float("-inf")
    h = torch.distributions.Categorical(logits=scaled).entropy()
    return torch.where(mask > 0, h, torch.zeros_like(h))


@pytest.mark.parametrize("temperature,banned", [(1.0, ()), (0.7, ()), (1.3, (2, 5))])
def test_token_entropy_is_the_categorical_entropy_at_the_trained_positions(monkeypatch, temperature, banned):
    from tiderl.trainer import grpo

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 11, generator=g) * 3
    logits.requires_grad_(True)
    mask = (torch.rand(3, 8, generator=g) > 0.4).float()
    want = _reference_entropy(logits.detach(), mask, temperature, banned)
    for chunk in (1 << 24, 11, 23):  # whole, one position per chunk, two per chunk with a short last one
        monkeypatch.setattr(grpo, "ENTROPY_CHUNK_ELEMENTS", chunk)
        got = grpo.token_entropy(logits, mask, temperature=temperature, banned=banned)
        assert not got.requires_grad and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-5), chunk
    assert bool((got[mask == 0] == 0).all()) and bool((got[mask > 0] > 0).all())
    with pytest.raises(ValueError, match="loss_mask"):
        grpo.token_entropy(logits, mask[:, 1:])
