"""The PyTorch actor/ref backend on a tiny random Qwen2: real training steps, swaps, factory."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tiderl.trainer import step as grpo_step
from tiderl.trainer.backend import OptimConfig, UnknownBackendError, make_backend
from tiderl.trainer.batch import collate
from tiderl.trainer.synthetic import make_model_dir, random_samples

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


def _on_policy(samples, ref):
    """Rollout logprobs as the current policy would have produced them."""
    out = []
    for s in samples:
        lp = ref.logprobs(collate([s]))[0].tolist()
        out.append(dataclasses.replace(s, rollout_logprobs=(0.0, *[x if m else 0.0 for x, m in zip(lp, s.loss_mask[1:])])))
    return out


def _train_once(actor, ref, mbs, normalizer, loss_cfg):
    acc = grpo_step.StepAccumulator(version=0)
    for mb in mbs:
        grpo_step.finish(actor, mb, grpo_step.forward(actor, mb, acc), ref.logprobs(mb), loss_cfg, normalizer, acc)
    return acc, actor.step()


def test_training_steps_reduce_the_loss_on_a_fixed_batch(model_dir):
    ref = make_backend("torch", "ref", model_dir)
    actor = make_backend("torch", "actor", model_dir, optim=OptimConfig(lr=1e-2))
    samples = _on_policy(random_samples(2, 4, min_tokens=12, max_tokens=24, seed=1), ref)
    mbs = [collate(samples[:4], 0), collate(samples[4:], 1)]
    normalizer = float(sum(s.num_model_tokens for s in samples))
    cfg = grpo_step.LossConfig(clip_eps=0.2, kl_coef=0.01, kl_estimator="k3")
    losses = []
    for _ in range(6):
        acc, optim = _train_once(actor, ref, mbs, normalizer, cfg)
        losses.append(acc.loss_sum)
        assert optim.grad_norm > 0
    # on-policy at the start: ratio 1 and KL 0, so the loss is -mean(advantage) exactly
    assert losses[0] == pytest.approx(-sum(s.advantage * s.num_model_tokens for s in samples) / normalizer, abs=1e-4)
    assert losses[-1] < losses[0] - 0.05
    assert acc.num_tokens == normalizer and acc.num_micro_batches == 2


def test_swap_round_trip_keeps_weights_and_outputs(model_dir):
    ref = make_backend("torch", "ref", model_dir)
    mb = collate(random_samples(1, 2, seed=3))
    before = ref.logprobs(mb)
    assert ref.offload() >= 0 and not ref.is_resident
    with pytest.raises(RuntimeError, match="offloaded"):
        ref.logprobs(mb)
    # the device copy is really released while offloaded
    assert all(p.numel() == 0 for p in ref.model.parameters())
    ref.onload()
    assert torch.equal(ref.logprobs(mb), before)


def test_actor_offload_keeps_accumulated_gradients(model_dir):
    actor = make_backend("torch", "actor", model_dir)
    samples = random_samples(1, 4, seed=3)
    assert any(s.advantage != 0 for s in samples)
    mb = collate(samples)
    acc = grpo_step.StepAccumulator(version=0)
    grpo_step.finish(actor, mb, actor.train_forward(mb), None, grpo_step.LossConfig(kl_coef=0.0), 10.0, acc)
    grads = [p.grad.clone() for p in actor.params]
    actor.offload()
    actor.onload()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, actor.params))
    assert actor.step().grad_norm > 0


def test_factory_names_unknown_backend(model_dir):
    with pytest.raises(UnknownBackendError, match="'megatron'.*known: fsdp, torch"):
        make_backend("megatron", "actor", model_dir)
    with pytest.raises(ValueError, match="role"):
        make_backend("torch", "critic", model_dir)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_backend("torch", "ref", model_dir / "nowhere")


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_the_compute_dtype_keeps_fp32_weights_and_moments(model_dir, backend):
    """`trainer.dtype`: auto is fp32 on a CPU; bf16 computes in bf16 (log-probabilities within bf16's
    precision of fp32's) while the weights, gradients and AdamW moments stay fp32; the reference model is
    stored in the compute dtype. One actor: nothing sharded, the fsdp backend autocasts alike."""
    from tiderl.trainer.torch_backend import compute_dtype

    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="'float16' is not one of auto, float32, bfloat16"):
        compute_dtype("float16", torch.device("cpu"))
    mb = collate(random_samples(1, 2, seed=3))
    fp32 = make_backend(backend, "actor", model_dir, dtype="auto")
    bf16 = make_backend(backend, "actor", model_dir, dtype="bfloat16", activation_checkpointing=True)
    full, out = fp32.forward(mb), bf16.train_forward(mb)
    half = out.logprobs
    assert half.dtype == torch.float32 and 0 < float((half - full).detach().abs().max()) < 0.1
    grpo_step.finish(bf16, mb, out, None, grpo_step.LossConfig(kl_coef=0.0), 10.0, grpo_step.StepAccumulator(0))
    bf16.step()
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(v.dtype == torch.float32 for st in bf16.optimizer.state.values() for v in st.values() if v.dim())
    ref = make_backend(backend, "ref", model_dir, dtype="bfloat16")
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_the_step_entropy_is_the_token_weighted_mean_over_the_micro_batches(model_dir, backend):
    """`entropy`: the policy's mean entropy over every trained token of the step, from the logits of the actor's
    own forward (at the sampling temperature), weighted by tokens across micro-batches of unequal size (not a
    mean of their means), and without a gradient of its own."""
    temperature = 0.05  # the random model's logits are nearly flat: sharpened, entropies differ between tokens
    actor = make_backend(backend, "actor", model_dir, temperature=temperature)
    samples = random_samples(1, 4, min_tokens=8, max_tokens=40, seed=5)
    mbs = [collate(samples[:1], 0), collate(samples[1:], 1)]
    counts = [int((mb.loss_mask > 0).sum()) for mb in mbs]
    assert counts[0] != counts[1]
    sums = []
    with torch.no_grad():
        for mb in mbs:
            logits = actor.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].double()
            h = torch.distributions.Categorical(logits=logits / temperature).entropy()
            sums.append(float(h[mb.loss_mask > 0].sum()))
    acc = grpo_step.StepAccumulator(version=0)
    for mb in mbs:
        out = grpo_step.forward(actor, mb, acc)
        assert out.logprobs.requires_grad and not out.entropy.requires_grad
        grpo_step.finish(actor, mb, out, None, grpo_step.LossConfig(kl_coef=0.0), float(sum(counts)), acc)
    stats = grpo_step.reduce_stats(acc, grad_norm=0.0, optimizer_s=0.0, started=0.0, group=None)
    assert stats.entropy == pytest.approx(sum(sums) / sum(counts), rel=1e-5)
    assert stats.entropy != pytest.approx(sum(s / n for s, n in zip(sums, counts)) / 2, rel=1e-3)
