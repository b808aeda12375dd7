"""The GPU check's trainer stage (tools/gpu_check_stages.py): ``fsdp_step``, GRPO steps of the ``fsdp``
backend on a one-rank trainer group by the project's step code; its group, actor and step are shared
with the engine stages (tools/gpu_check_engine.py)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from gpu_check_context import Context
from gpu_check_env import use_model
from gpu_check_meter import synchronize


# ---- 4. one step of the fsdp backend -------------------------------------------------------------


def trainer_group(ctx: Context, name: str) -> tuple[Any, float]:
    """A one-rank trainer group (tiderl.trainer.group, a file:// rendezvous): NCCL on a GPU, gloo on a CPU;
    NCCL's communicator is made at the first collective, so one all-reduce is part of the set-up."""
    import torch
    import torch.distributed as dist

    from tiderl.trainer.group import init_trainer_group

    rendezvous = ctx.work / "rendezvous" / name
    rendezvous.unlink(missing_ok=True)  # a kept work directory's, from an earlier check
    t0 = time.perf_counter()
    comm = init_trainer_group(0, 1, 0, rendezvous, backend="nccl" if ctx.cuda else "gloo")
    x = torch.ones(1, device=ctx.device)
    dist.all_reduce(x)
    synchronize(ctx)
    if float(x.item()) != 1.0:
        raise RuntimeError(f"a one-rank all-reduce gave {float(x.item())}")
    return comm, time.perf_counter() - t0


def make_actor(ctx: Context, comm: Any) -> Any:
    from tiderl.trainer.backend import OptimConfig, make_backend

    return make_backend("fsdp", "actor", ctx.model_dir, device=ctx.device, optim=OptimConfig(lr=ctx.preset.lr),
                        dp_group=comm.dp_group, dtype="bfloat16" if ctx.cuda else "float32")


def train_step(ctx: Context, actor: Any, mbs: list[Any], version: int) -> dict[str, Any]:
    """One GRPO step of `actor` over the micro-batches `mbs`, by the project's step code (forward, loss and
    backward per micro-batch, then the optimizer step), the loss divided by the step's model tokens."""
    from tiderl.trainer import step as grpo_step
    from tiderl.trainer.step import LossConfig, StepAccumulator

    synchronize(ctx)
    started = time.perf_counter()
    acc = StepAccumulator(version=version)
    normalizer = float(sum(mb.num_model_tokens for mb in mbs))
    loss = LossConfig(kl_coef=0.0)  # no reference model in the check
    for mb in mbs:
        grpo_step.finish(actor, mb, grpo_step.forward(actor, mb, acc), None, loss, normalizer, acc)
    t_opt = time.perf_counter()
    optim = actor.step()
    synchronize(ctx)
    stats = grpo_step.reduce_stats(acc, optim.grad_norm, time.perf_counter() - t_opt, started, None)
    return {"step_s": time.perf_counter() - started, "loss": stats.loss, "grad_norm": stats.grad_norm,
            "tokens": sum(int(mb.attention_mask.sum()) for mb in mbs), "model_tokens": stats.num_tokens,
            "forward_s": stats.t_act_f_s, "loss_backward_s": stats.t_act_b_s, "optimizer_s": stats.optimizer_s,
            "logprob_mismatch_on_policy": stats.logprob_mismatch_on_policy}


def stage_fsdp_step(ctx: Context) -> dict[str, Any]:
    import torch

    from tiderl.trainer.batch import collate
    from tiderl.trainer.group import leave_trainer_group
    from tiderl.trainer.synthetic import random_samples

    use_model(ctx)
    p = ctx.preset
    comm, init_s = trainer_group(ctx, "trainer")
    try:
        t0 = time.perf_counter()
        actor = make_actor(ctx, comm)
        synchronize(ctx)
        load_s = time.perf_counter() - t0
        vocab = int(actor.model.config.vocab_size)
        steps = []
        for k in range(p.warmup + p.steps):
            samples = random_samples(1, p.micro_batches * p.seqs, vocab_size=vocab, min_tokens=p.seq_tokens,
                                     max_tokens=p.seq_tokens, version=k, seed=k)
            mbs = [collate(samples[i * p.seqs:(i + 1) * p.seqs], index=i) for i in range(p.micro_batches)]
            steps.append(train_step(ctx, actor, mbs, k))
        measured = steps[p.warmup:]
        step_s = statistics.median(s["step_s"] for s in measured)
        return {
            "backend": "fsdp", "process_group": "nccl" if ctx.cuda else "gloo", "world_size": 1,
            "sharded": actor.dp_group is not None, "compute_dtype": str(actor.compute_dtype).replace("torch.", ""),
            "parameters": sum(t.numel() for t in actor.model.parameters()),
            "group_init_s": round(init_s, 3), "load_s": round(load_s, 3),
            "first_step_s": round(steps[0]["step_s"], 4), "step_s": round(step_s, 4),
            "steps_s": [round(s["step_s"], 4) for s in measured],
            "tokens_per_step": measured[-1]["tokens"], "tokens_per_s": round(measured[-1]["tokens"] / step_s, 1),
            "forward_s": measured[-1]["forward_s"], "loss_backward_s": measured[-1]["loss_backward_s"],
            "optimizer_s": measured[-1]["optimizer_s"], "loss": measured[-1]["loss"],
            "grad_norm": measured[-1]["grad_norm"],
            "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if ctx.cuda else None,
            "micro_batches": p.micro_batches, "seqs_per_micro_batch": p.seqs, "seq_tokens": p.seq_tokens,
            "note": "one rank: the fsdp backend shards over a data-parallel group of 2 or more, so here it trains "
                    "the whole model unsharded (fp32 weights and AdamW state, bf16 autocast on a GPU)",
        }
    finally:
        leave_trainer_group()
