"""Trainer backends side by side: step time, peak memory and state bytes per rank.

For each backend of ``--backend`` (``fsdp,torch``), ``--ranks`` gloo processes train a random-init
Qwen2 of about ``--params`` parameters (``150M``, ``1.5B``: the layer count is chosen for the size) on
the same synthetic micro-batches: ``--warmup`` unmeasured steps, then ``--steps`` measured ones, each a
GRPO step over ``--micro-batches`` micro-batches per rank of ``--seqs`` sequences of ``--seq-tokens``
tokens (the actor only: no reference model, no KL term). Per rank it reports

- ``state_bytes``: the rank's own weights, gradients and AdamW moments (after a step, gradients still
  held), the bytes a backend must keep whatever the batch;
- ``peak_rss_bytes``: the process's peak resident memory (the device is the host here), and
  ``peak_over_import_bytes``: the same less the process's size once torch and transformers are imported;
- ``step_s``: the median measured step of the group's slowest rank;
- ``checkpoint_write_s``, ``checkpoint_read_s``, ``checkpoint_bytes``: a checkpoint of the state written and
  read back, re-sharded (what an ERS hand-off of a sharded actor costs, tiderl.run.handoff), slowest rank;
  ``catch_up_broadcast_s``: a replicated backend's catch-up of a joining replica (a broadcast);
- ``plan_bytes``: what the memory plan (tiderl.trainer.memory_plan, `tiderl config`) gives an actor rank at
  these settings, and ``measured_over_plan``: the largest rank's peak over import against it.

A backend followed by ``:whole`` (``fsdp:whole``) computes the output layer's logits for a whole
micro-batch at once instead of a chunk of positions at a time (tiderl.trainer.logits), its plan likewise:
``--backend fsdp,fsdp:whole`` shows what the chunks save at a large vocabulary.

The backends run one after the other, each in fresh processes; ``ratios`` compares the first to the
others. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BACKENDS = ("fsdp", "torch")


def parse_params(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kMB]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"--params: a count such as 150M or 1.5B, got {text!r}")
    return int(float(match[1]) * {"": 1, "k": 1e3, "M": 1e6, "B": 1e9}[match[2]])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="fsdp,torch", help="comma-separated backends (first: the one compared)")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel actor ranks (gloo processes)")
    p.add_argument("--params", type=parse_params, default=parse_params("150M"), help="model size, e.g. 150M")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank and step")
    p.add_argument("--seqs", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--work-dir", type=Path, default=None, help="keep the model here (default: a temp dir)")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    unknown = [b for b in args.backends if b.removesuffix(":whole") not in BACKENDS]
    if unknown or not args.backends:
        p.error(f"--backend: {', '.join(unknown) or 'none given'} not among {', '.join(BACKENDS)}")
    if args.ranks < 1:
        p.error("--ranks: at least 1")
    return args


def model_size(params: int, hidden: int, vocab: int) -> Any:
    """Qwen2 sizes with about `params` parameters: the layers that fill what the (tied) embedding leaves."""
    from tiderl.trainer.synthetic import ModelSize

    heads = max(1, hidden // 64)
    intermediate = hidden * 4
    kv_heads = max(1, heads // 4)
    per_layer = 4 * hidden + 2 * hidden * hidden + 2 * hidden * (kv_heads * hidden // heads) + 3 * hidden * intermediate
    layers = max(1, round((params - vocab * hidden) / per_layer))
    return ModelSize(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv_heads)


def _rss_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _state_bytes(actor: Any) -> int:
    """This rank's weights, gradients and optimizer moments (a sharded tensor counts its local shard)."""
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in actor.model.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for st in actor.optimizer.state.values():
        for v in st.values():
            if hasattr(v, "numel") and v.dim() > 0:
                total += local(v).numel() * local(v).element_size()
    return total


def _rank(rank: int, backend: str, args: argparse.Namespace, model_dir: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (what a trainer process imports anyway: not the backend's memory)

    from tiderl.trainer import step as grpo_step
    from tiderl.trainer.backend import OptimConfig, make_backend
    from tiderl.trainer.batch import collate
    from tiderl.trainer.group import init_trainer_group, leave_trainer_group
    from tiderl.trainer.step import LossConfig, StepAccumulator
    from tiderl.trainer.synthetic import random_samples

    torch.set_num_threads(args.threads_per_rank)
    _whole_logits(backend)
    imported = _rss_peak()
    comm = init_trainer_group(rank, args.ranks, 0, out / f"rendezvous-{backend}") if args.ranks > 1 else None
    try:
        actor = make_backend(backend.removesuffix(":whole"), "actor", model_dir, optim=OptimConfig(lr=1e-5),
                             dp_group=comm.dp_group if comm else None,
                             activation_checkpointing=args.activation_checkpointing)
        loss = LossConfig(kl_coef=0.0)
        times = []
        for k in range(args.warmup + args.steps):
            samples = random_samples(args.micro_batches * args.seqs, 1, vocab_size=args.vocab,
                                     min_tokens=args.seq_tokens, max_tokens=args.seq_tokens, version=k,
                                     seed=1000 * k + rank)
            mbs = [collate(samples[i * args.seqs:(i + 1) * args.seqs], index=i) for i in range(args.micro_batches)]
            normalizer = float(sum(mb.num_model_tokens for mb in mbs)) * args.ranks
            if comm:
                dist.barrier()
            t0 = time.perf_counter()
            acc = StepAccumulator(version=k)
            for mb in mbs:
                grpo_step.finish(actor, mb, grpo_step.forward(actor, mb, acc), None, loss, normalizer, acc)
            state = _state_bytes(actor)  # gradients held, before the step frees them
            actor.step()
            state = max(state, _state_bytes(actor))  # and the moments, which the first step creates
            if comm:
                dist.barrier()
            times.append(time.perf_counter() - t0)
        peak = _rss_peak()
        moves = _state_moves(actor, backend, comm, out / f"ckpt-{backend}", args.ranks)
        (out / f"{backend}-rank{rank}.json").write_text(json.dumps({
            "step_s": times[args.warmup:], "state_bytes": state, "peak_rss_bytes": peak,
            "peak_over_import_bytes": peak - imported, **moves}))
    finally:
        leave_trainer_group()


def _whole_logits(backend: str) -> None:
    """`backend:whole`: the output layer's logits of a whole micro-batch at once (one chunk of any size)."""
    from tiderl.trainer import logits

    if backend.endswith(":whole"):
        logits.CHUNK_ELEMENTS = 1 << 62


def _state_moves(actor: Any, backend: str, comm: Any, ckpt: Path, ranks: int) -> dict[str, float]:
    """What moving the state costs: a checkpoint written (every rank its shards, or the leader alone for a
    replica) and read back in place, re-sharded, as an ERS hand-off does (tiderl.run.handoff); for a
    replicated backend also the catch-up broadcast of a joining replica (ActorRank.catch_up)."""
    import torch.distributed as dist

    from tiderl.trainer.publish import Checkpointer

    checkpointer = Checkpointer(ckpt, every=1)
    writers = actor.collective_io or comm is None or comm.rank == 0
    if comm:
        dist.barrier()
    t0 = time.perf_counter()
    if writers:
        checkpointer.save(actor, step=1, version=1)
    if comm:
        dist.barrier()
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpointer.restore(actor, checkpointer.latest())
    if comm:
        dist.barrier()
    moves = {"checkpoint_write_s": write_s, "checkpoint_read_s": time.perf_counter() - t0,
             "checkpoint_bytes": sum(f.stat().st_size for f in checkpointer.latest().path.iterdir())}
    if comm and not actor.collective_io and ranks > 1:
        t0 = time.perf_counter()
        actor.take_state_from(0)
        dist.barrier()
        moves["catch_up_broadcast_s"] = time.perf_counter() - t0
    return moves


def run_backend(backend: str, args: argparse.Namespace, model_dir: Path, out: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_rank)
    procs = [ctx.Process(target=_rank, args=(r, backend, args, model_dir, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"bench_trainer: {backend}: rank(s) {failed} failed")
    ranks = [json.loads((out / f"{backend}-rank{r}.json").read_text()) for r in range(args.ranks)]
    steps = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
    moves = {k: max(r[k] for r in ranks) for k in ("checkpoint_write_s", "checkpoint_read_s",
                                                     "catch_up_broadcast_s") if k in ranks[0]}
    return {"step_s": statistics.median(steps), **moves, "checkpoint_bytes": ranks[0]["checkpoint_bytes"],
            "state_bytes": [r["state_bytes"] for r in ranks],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
            "peak_over_import_bytes": [r["peak_over_import_bytes"] for r in ranks]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tiderl.trainer.synthetic import make_model_dir

    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = args.work_dir or Path(tmp)
        size = model_size(args.params, args.hidden, args.vocab)
        model_dir = work / f"model-{size.num_layers}x{size.hidden_size}"
        if not (model_dir / "config.json").is_file():
            make_model_dir(model_dir, size)
        from safetensors import safe_open

        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            num_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
        results = {}
        for backend in args.backends:
            out = work / "out"
            out.mkdir(parents=True, exist_ok=True)
            results[backend] = run_backend(backend, args, model_dir, out)
        plans = _plans(args, model_dir)
    for backend in args.backends:
        results[backend]["plan_bytes"] = plans[backend]
        results[backend]["measured_over_plan"] = max(results[backend]["peak_over_import_bytes"]) / plans[backend]
    first = args.backends[0]
    ratios = {f"{first}/{b}": {
        "state_bytes": max(results[first]["state_bytes"]) / max(results[b]["state_bytes"]),
        "peak_over_import_bytes": max(results[first]["peak_over_import_bytes"]) / max(results[b]["peak_over_import_bytes"]),
        "step_s": results[first]["step_s"] / results[b]["step_s"]} for b in args.backends[1:]}
    print(json.dumps({"params": num_params, "layers": size.num_layers, "hidden": size.hidden_size,
                      "ranks": args.ranks, "tokens_per_rank_step": args.micro_batches * args.seqs * args.seq_tokens,
                      "activation_checkpointing": args.activation_checkpointing, "backends": results,
                      "ratios": ratios, "load_avg_1m": os.getloadavg()[0]}))
    return 0


def _plans(args: argparse.Namespace, model_dir: Path) -> dict[str, int]:
    """The memory plan's actor bytes (tiderl.trainer.memory_plan) for each backend at these settings: fp32 on a
    CPU, no reference model, one micro-batch's activations."""
    from transformers import AutoConfig

    from tiderl.trainer import memory_plan

    from tiderl.trainer import logits

    shape = memory_plan.ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    chunk = logits.CHUNK_ELEMENTS
    plans = {}
    for b in args.backends:
        logits.CHUNK_ELEMENTS = (1 << 62) if b.endswith(":whole") else chunk
        plans[b] = memory_plan.actor_memory(shape, backend=b.removesuffix(":whole"), actors=args.ranks,
                                            compute_bytes=4, micro_batch_tokens=args.seqs * args.seq_tokens,
                                            activation_checkpointing=args.activation_checkpointing,
                                            colocated_ref=False).total
    logits.CHUNK_ELEMENTS = chunk
    return plans


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
