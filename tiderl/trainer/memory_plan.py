"""Each rank's accelerator memory for a job, before anything is queued (pure: numbers in, numbers out).

The model's shape (`ModelShape`: parameter counts, layers, widths) comes from its config
(`ModelShape.from_config` counts parameters on the meta device: no weights are read). From it and the
job's trainer and rollout settings:

- an actor rank holds its weights, gradients and AdamW moments (fp32: 4 + 4 + 8 bytes a parameter,
  all of them on every rank with the ``torch`` backend, 1/N of them with ``fsdp`` over N actors, which
  also holds the full compute-dtype weights of the layer it computes and of the next one it
  prefetches); the ``torch`` backend's optimizer step concatenates every gradient into one flat fp32
  buffer for its all-reduce (4 more bytes a parameter at the step);
- activations of one micro-batch of `trainer.micro_batch_tokens` tokens (or one context of
  `model.max_context_tokens`, if longer: a trajectory is never split): what a decoder layer keeps
  for its backward (`ACTIVATION_WIDTHS`: 10 hidden-wide and 4 intermediate-wide tensors a token, in the
  compute dtype), for every layer, or with activation checkpointing each layer's input plus one
  layer's recompute; and the output layer's logits, in the compute dtype, their fp32 copy, the
  log-softmax and its gradient (`LOGIT_BYTES`), for one chunk of positions at a time
  (tiderl.trainer.logits: at most `CHUNK_ELEMENTS` logits, 448 MiB in bf16 whatever the micro-batch;
  whole, a 152k vocabulary would take 2 GiB per 1,000 tokens);
- a reference model colocated with the actor (RA2P's colocated mode), frozen in the compute dtype;
- a rollout rank's engine takes `rollout.gpu_memory_utilization` of its GPUs: its weights in the engine
  dtype, split over `rollout.tensor_parallel_size` GPUs, and a KV cache in the rest, which must hold at
  least one context of `model.max_context_tokens`.

The estimates are what the tensors weigh; the allocator's fragmentation, CUDA context (~0.5 GiB) and
communication buffers come on top, so `fits` leaves `HEADROOM` of each GPU free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACTIVATION_WIDTHS = (10, 4)  # hidden-wide, intermediate-wide tensors a decoder layer keeps a token
LOGIT_BYTES = 4 + 4 + 4  # a token's logits: fp32 copy, log-softmax, its gradient (plus the compute dtype's)
HEADROOM = 0.10  # of each GPU: allocator, CUDA context, communication buffers


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the plan needs of a model: parameter counts and the widths activations scale with."""

    params: int
    layer_params: int  # one decoder layer's (the largest unit FSDP gathers)
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (a vision-language one: its text model's widths, every parameter
        counted): the model built on the meta device, so no memory is taken and no weights read."""
        import torch

        from tiderl.trainer.torch_backend import model_class

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        with torch.device("meta"):
            model = model_class(config).from_config(config)
        params = sum(p.numel() for p in model.parameters())
        names = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in names]
        layer_params = max((sum(p.numel() for p in m.parameters()) for m in layers), default=params)
        heads = text.num_attention_heads
        return cls(params=params, layer_params=layer_params, layers=text.num_hidden_layers, hidden=text.hidden_size,
                   intermediate=text.intermediate_size, vocab=text.vocab_size,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank's bytes by part (on each of its GPUs: a rollout engine's are split over them)."""

    role: str
    parts: Mapping[str, int]
    gpus: int = 1
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def actor_memory(shape: ModelShape, *, backend: str, actors: int, compute_bytes: int, micro_batch_tokens: int,
                 activation_checkpointing: bool, colocated_ref: bool) -> RankMemory:
    """An actor rank's peak: state, the step's buffers, one micro-batch's activations (and the colocated
    reference model's weights, which swaps keep on the device in the worst case)."""
    if backend not in ("torch", "fsdp"):
        raise ValueError(f"memory plan: no model of trainer backend {backend!r} (torch, fsdp)")
    share = actors if backend == "fsdp" else 1
    p = shape.params
    parts = {"weights": 4 * p // share, "gradients": 4 * p // share, "optimizer": 8 * p // share}
    if backend == "fsdp" and actors > 1:
        parts["gathered layers"] = 2 * shape.layer_params * compute_bytes  # computing one, prefetching the next
    if backend == "torch" and actors > 1:
        parts["all-reduce buffer"] = 4 * p
    parts["activations"] = activation_bytes(shape, micro_batch_tokens, compute_bytes, activation_checkpointing)
    parts["logits"] = logit_elements(shape, micro_batch_tokens) * (compute_bytes + LOGIT_BYTES)
    if colocated_ref:
        parts["reference"] = compute_bytes * p
    return RankMemory("actor", parts)


def activation_bytes(shape: ModelShape, tokens: int, compute_bytes: int, checkpointing: bool) -> int:
    """What the decoder layers keep for the backward of `tokens` tokens."""
    hidden_wide, intermediate_wide = ACTIVATION_WIDTHS
    layer = tokens * compute_bytes * (hidden_wide * shape.hidden + intermediate_wide * shape.intermediate)
    if checkpointing:  # each layer's input, and one layer recomputed at a time
        return shape.layers * tokens * compute_bytes * shape.hidden + layer
    return shape.layers * layer


def ref_memory(shape: ModelShape, *, compute_bytes: int, micro_batch_tokens: int) -> RankMemory:
    """A decoupled reference rank: frozen weights, one forward's largest tensors (no graph kept)."""
    return RankMemory("ref", {
        "weights": compute_bytes * shape.params,
        "activations": micro_batch_tokens * compute_bytes * (shape.hidden + shape.intermediate) * 2,
        "logits": logit_elements(shape, micro_batch_tokens) * (compute_bytes + 4 + 4),
    })


def logit_elements(shape: ModelShape, tokens: int) -> int:
    """Logits held at once for `tokens` positions: one chunk of the output layer's (tiderl.trainer.logits)."""
    from tiderl.trainer.logits import chunk_tokens

    return min(tokens, chunk_tokens(shape.vocab)) * shape.vocab


def rollout_memory(shape: ModelShape, *, engine_bytes: int, tensor_parallel: int, gpu_bytes: int | None,
                   utilization: float, max_context_tokens: int) -> RankMemory:
    """A rollout engine, per GPU: its weights' share and the KV cache it fills the rest of its memory
    share with (without a GPU size, the KV cache of one full context)."""
    weights = engine_bytes * shape.params // tensor_parallel
    per_token = shape.kv_bytes_per_token(engine_bytes) // tensor_parallel
    one_context = per_token * max_context_tokens
    notes: tuple[str, ...] = ()
    if gpu_bytes is None:
        kv = one_context
    else:
        kv = int(utilization * gpu_bytes) - weights
        if kv >= one_context:
            notes = (f"KV cache holds {kv // per_token:,} tokens ({kv // one_context} contexts of {max_context_tokens})",)
    return RankMemory("rollout", {"weights": weights, "kv cache": max(kv, 0)}, gpus=tensor_parallel, notes=notes)


def problems(plans: list[RankMemory], gpu_bytes: int, *, max_context_tokens: int, shape: ModelShape,
             engine_bytes: int) -> list[str]:
    """Why the plan does not fit GPUs of `gpu_bytes` (empty: it fits)."""
    out = []
    usable = int(gpu_bytes * (1 - HEADROOM))
    for plan in plans:
        if plan.role == "rollout":
            per_token = shape.kv_bytes_per_token(engine_bytes) // plan.gpus
            if plan.parts["kv cache"] < per_token * max_context_tokens:
                out.append(f"rollout: {gib(plan.parts['weights'])} of weights per GPU leave "
                           f"{gib(plan.parts['kv cache'])} for the KV cache, less than one context of "
                           f"{max_context_tokens} tokens ({gib(per_token * max_context_tokens)})")
        elif plan.total > usable:
            out.append(f"{plan.role}: {gib(plan.total)} per GPU ({describe(plan)}) exceeds "
                       f"{gib(usable)} ({100 - round(HEADROOM * 100)}% of {gib(gpu_bytes)})")
    return out


def gib(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB (a tiny model's plan)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def describe(plan: RankMemory) -> str:
    return ", ".join(f"{name} {gib(n)}" for name, n in plan.parts.items())


def dtype_bytes(name: str, gpu: bool) -> int:
    """Bytes of a `trainer.dtype` / `rollout.dtype` value on a GPU (`auto`: bf16) or a CPU (`auto`: fp32)."""
    if name == "auto":
        return 2 if gpu else 4
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"memory plan: unknown dtype {name!r} (auto, {', '.join(DTYPE_BYTES)})") from None


def plan_job(job: Any, shape: ModelShape) -> list[RankMemory]:
    """Every kind of rank the job may run (a `tiderl.config.JobConfig`): the actor, a decoupled reference
    rank where the RA2P mode allows one, a rollout rank. On GPUs (`slurm.gpus_per_node` > 0) `auto`
    dtypes are bf16, else fp32."""
    gpu = job.slurm.gpus_per_node > 0
    t, r = job.trainer, job.rollout
    compute = dtype_bytes(t.dtype, gpu)
    engine = dtype_bytes(r.dtype, gpu)
    gpu_bytes = int(job.slurm.gpu_memory_gib * GIB) if gpu and job.slurm.gpu_memory_gib else None
    # A trajectory longer than the micro-batch budget gets a micro-batch of its own (never split).
    tokens = max(t.micro_batch_tokens, job.model.max_context_tokens)
    plans = [actor_memory(shape, backend=t.backend, actors=t.actor_ranks, compute_bytes=compute,
                          micro_batch_tokens=tokens, activation_checkpointing=t.activation_checkpointing,
                          colocated_ref=t.ra2p_mode != "decoupled")]
    if t.ra2p_mode in ("auto", "decoupled"):
        plans.append(ref_memory(shape, compute_bytes=compute, micro_batch_tokens=tokens))
    plans.append(rollout_memory(shape, engine_bytes=engine, tensor_parallel=r.tensor_parallel_size, gpu_bytes=gpu_bytes,
                                utilization=r.gpu_memory_utilization, max_context_tokens=job.model.max_context_tokens))
    return plans


def job_problems(job: Any, shape: ModelShape, plans: list[RankMemory]) -> list[str]:
    """`problems` on the job's GPUs (`slurm.gpu_memory_gib`); none without GPUs or a size."""
    if job.slurm.gpus_per_node <= 0 or not job.slurm.gpu_memory_gib:
        return []
    return problems(plans, int(job.slurm.gpu_memory_gib * GIB), max_context_tokens=job.model.max_context_tokens,
                    shape=shape, engine_bytes=dtype_bytes(job.rollout.dtype, True))


def render(plans: list[RankMemory], shape: ModelShape) -> str:
    """The plan as `tiderl config` and `tiderl submit --dry-run` print it."""
    count = f"{shape.params / 1e9:.2f}B" if shape.params >= 1e9 else f"{shape.params / 1e6:.2f}M"
    lines = [f"# memory per GPU ({count} parameters, {shape.layers} layers)"]
    for plan in plans:
        span = f" (each of {plan.gpus} GPUs)" if plan.gpus > 1 else ""
        lines.append(f"#   {plan.role}{span}: {gib(plan.total)} = {describe(plan)}")
        lines += [f"#     {note}" for note in plan.notes]
    return "\n".join(lines) + "\n"
