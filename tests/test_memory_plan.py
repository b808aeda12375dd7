"""The memory plan: parameter counts from a config on the meta device, each rank's bytes, and the refusal of
a job that does not fit its GPUs (Qwen2.5-7B on 80 GiB GPUs: fsdp over 8 actors fits, torch does not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiderl.config.job import load_job
from tiderl.trainer import memory_plan as mp
from tiderl.trainer.memory_plan import GIB, ModelShape

ROOT = Path(__file__).resolve().parents[1]
# Qwen2.5-7B's config.json (its published values).
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen7b() -> ModelShape:
    from transformers import Qwen2Config

    return ModelShape.from_config(Qwen2Config(**QWEN25_7B))


def test_the_shape_is_counted_on_the_meta_device(qwen7b: ModelShape) -> None:
    assert 7.60e9 < qwen7b.params < 7.63e9  # Qwen2.5-7B: 7.62B
    # A decoder layer: q, k, v (biased), o, gate, up, down and two norms.
    h, i, kv = 3584, 18944, 4 * 128
    assert qwen7b.layer_params == h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    assert (qwen7b.layers, qwen7b.kv_heads, qwen7b.head_dim) == (28, 4, 128)
    assert qwen7b.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2  # 57 KiB a token in bf16


def test_sharding_divides_the_state_and_the_torch_backend_adds_its_flat_buffer(qwen7b: ModelShape) -> None:
    args = dict(compute_bytes=2, micro_batch_tokens=8192, activation_checkpointing=True, colocated_ref=False)
    torch8 = mp.actor_memory(qwen7b, backend="torch", actors=8, **args)
    fsdp8 = mp.actor_memory(qwen7b, backend="fsdp", actors=8, **args)
    p = qwen7b.params
    assert torch8.parts["weights"] + torch8.parts["gradients"] + torch8.parts["optimizer"] == 16 * p
    assert torch8.parts["all-reduce buffer"] == 4 * p
    assert fsdp8.parts["optimizer"] == 8 * p // 8 and "all-reduce buffer" not in fsdp8.parts
    assert fsdp8.parts["gathered layers"] == 2 * 2 * qwen7b.layer_params
    assert fsdp8.parts["activations"] == torch8.parts["activations"]
    recompute = mp.activation_bytes(qwen7b, 8192, 2, True)
    assert recompute < mp.activation_bytes(qwen7b, 8192, 2, False) / 10
    with pytest.raises(ValueError, match="no model of trainer backend 'megatron'"):
        mp.actor_memory(qwen7b, backend="megatron", actors=8, **args)


def test_the_7b_job_fits_80_gib_with_fsdp_and_not_with_torch(qwen7b: ModelShape) -> None:
    job = load_job(ROOT / "jobs" / "qwen2.5-7b-h100.yaml")
    assert job.slurm.gpu_memory_gib == 80 and job.trainer.backend == "fsdp"
    plans = mp.plan_job(job, qwen7b)
    assert [p.role for p in plans] == ["actor", "ref", "rollout"]
    assert mp.job_problems(job, qwen7b, plans) == []
    actor = plans[0]
    assert 20 * GIB < actor.total < 72 * GIB, mp.render(plans, qwen7b)
    torch_job = load_job(ROOT / "jobs" / "qwen2.5-7b-h100.yaml", ["trainer.backend=torch"])
    found = mp.job_problems(torch_job, qwen7b, mp.plan_job(torch_job, qwen7b))
    assert len(found) == 1 and found[0].startswith("actor: ") and "optimizer 56.7 GiB" in found[0], found
    assert "exceeds 72.0 GiB (90% of 80.0 GiB)" in found[0]
    rollout = plans[-1]
    assert rollout.parts["weights"] == 2 * qwen7b.params and "KV cache holds" in rollout.notes[0]


def test_the_logits_are_one_chunk_whatever_the_micro_batch(qwen7b: ModelShape) -> None:
    from tiderl.trainer.logits import chunk_tokens

    args = dict(backend="fsdp", actors=8, compute_bytes=2, activation_checkpointing=True, colocated_ref=False)
    big = mp.actor_memory(qwen7b, micro_batch_tokens=32768, **args).parts["logits"]
    assert big == mp.actor_memory(qwen7b, micro_batch_tokens=8192, **args).parts["logits"]
    assert big == chunk_tokens(qwen7b.vocab) * qwen7b.vocab * (2 + mp.LOGIT_BYTES) < 1 * GIB
    small = mp.actor_memory(qwen7b, micro_batch_tokens=64, **args).parts["logits"]
    assert small == 64 * qwen7b.vocab * (2 + mp.LOGIT_BYTES)  # fewer tokens than a chunk: what they make


def test_a_rollout_engine_without_room_for_one_context_is_refused(qwen7b: ModelShape) -> None:
    plan = mp.rollout_memory(qwen7b, engine_bytes=2, tensor_parallel=1, gpu_bytes=24 * GIB, utilization=0.65,
                             max_context_tokens=32768)
    found = mp.problems([plan], 24 * GIB, max_context_tokens=32768, shape=qwen7b, engine_bytes=2)
    assert len(found) == 1 and "less than one context of 32768 tokens" in found[0]
    split = mp.rollout_memory(qwen7b, engine_bytes=2, tensor_parallel=2, gpu_bytes=24 * GIB, utilization=0.65,
                              max_context_tokens=32768)
    assert split.gpus == 2 and mp.problems([split], 24 * GIB, max_context_tokens=32768, shape=qwen7b,
                                           engine_bytes=2) == []


def test_cpu_jobs_are_planned_in_fp32_and_never_refused(qwen7b: ModelShape) -> None:
    job = load_job(ROOT / "jobs" / "quickstart.yaml")
    plans = mp.plan_job(job, qwen7b)
    assert plans[0].parts["reference"] == 4 * qwen7b.params  # fp32 on a CPU, colocated by the auto mode
    assert mp.job_problems(job, qwen7b, plans) == []
    text = mp.render(plans, qwen7b)
    assert text.startswith("# memory per GPU (7.62B parameters, 28 layers)\n#   actor: ")
