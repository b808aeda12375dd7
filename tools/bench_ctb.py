"""Vanilla vs CTB task scheduling on one real vLLM engine with a small KV cache.

The same multi-turn workload (hilo groups, environment latency injected per step)
runs twice on the same engine: once under `vanilla` (request-level: a fixed
number of concurrent tasks, vLLM's cache policy decides what stays cached) and
once under `ctb` (KV token budget, probing, priority pausing). The prefix cache
is dropped between the two runs (a weight reload of the same weights) and a
short warm-up runs first. Hit rate, generation throughput and step time come
from vLLM's own counters (`vllm:prefix_cache_hits/queries`,
`vllm:generation_tokens`) and the wall clock. Prints one JSON line.

    .venv/bin/python tools/bench_ctb.py [--tasks 256] [--latency lognormal:0.02:0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from tiderl.rollout.agent_loop import LoopLimits
from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import Engine
from tiderl.rollout.local_env import LocalEnvLink
from tiderl.rollout.schedulers import make_scheduler
from tiderl.rollout.trajectory import make_group
from tiderl.rollout.worker import RolloutWorker


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="Model dir (default: the cached tiny hilo model).")
    p.add_argument("--tasks", type=int, default=256, help="Tasks per scheduler run (groups x group size).")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=32, help="KV cache blocks (block size 32): the pressure.")
    p.add_argument("--concurrency", type=int, default=64, help="Vanilla's concurrent tasks; CTB's cap.")
    p.add_argument("--latency", default="lognormal:0.02:0.1", help="Injected env latency per step.")
    p.add_argument("--hilo-high", type=int, default=100, help="hilo range 1..HIGH (longer games, longer contexts).")
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


async def one_run(engine: Engine, fmt: ChatFormat, scheduler: str, args: argparse.Namespace, first_seed: int, num_tasks: int) -> dict[str, Any]:
    options = {"low": 1, "high": args.hilo_high, "max_turns": args.max_turns}
    groups = [
        make_group(f"{scheduler}-{first_seed + i}", "hilo", seed=first_seed + i, group_size=args.group_size, options=options)
        for i in range(max(1, num_tasks // args.group_size))
    ]
    env = LocalEnvLink(latency=args.latency, seed=args.seed)
    limits = LoopLimits(max_turns=args.max_turns, max_context_tokens=engine.kv_capacity_tokens, max_new_tokens=args.max_new_tokens)
    worker = RolloutWorker(engine, env, fmt, make_scheduler(scheduler), limits, max_resident_tasks=args.concurrency)
    worker.add_groups(groups)
    before = await engine.stats()
    started = time.monotonic()
    report = await worker.run()
    step_s = time.monotonic() - started
    delta = (await engine.stats()).minus(before)
    return {
        "hit_rate": round(delta.hit_rate, 4),
        "gen_tok_s": round(delta.generation_tokens / step_s, 1),
        "step_s": round(step_s, 2),
        "prefix_cache_queries": delta.prefix_cache_queries,
        "prefix_cache_hits": delta.prefix_cache_hits,
        "prompt_tokens": delta.prompt_tokens,
        "generation_tokens": delta.generation_tokens,
        "preemptions": delta.num_preemptions,
        "pauses": report.num_pauses,
        "max_resident_tasks": report.max_resident_tasks,
        "success_rate": round(report.reward_mean, 3),
        "tasks": report.num_tasks,
    }


async def bench(engine: Engine, fmt: ChatFormat, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    await one_run(engine, fmt, "vanilla", args, first_seed=10**6, num_tasks=4 * args.group_size)  # warm-up
    result: dict[str, Any] = {}
    for scheduler in ("vanilla", "ctb"):
        await engine.reload_weights(model_dir, version=engine.weights_version + 1)  # drops the prefix cache
        figures = await one_run(engine, fmt, scheduler, args, first_seed=args.seed * 10**4, num_tasks=args.tasks)
        result.update({f"{k}_{scheduler}": v for k, v in figures.items()})
    result["hit_rate_ratio"] = round(result["hit_rate_ctb"] / result["hit_rate_vanilla"], 3) if result["hit_rate_vanilla"] else None
    result["gen_tok_s_ratio"] = round(result["gen_tok_s_ctb"] / result["gen_tok_s_vanilla"], 3)
    result["kv_capacity_tokens"] = engine.kv_capacity_tokens
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return result


def main() -> None:
    args = parse_args()
    # vLLM logs to stdout by default; stdout is for the one JSON line.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from tiderl.rollout.from_config import chat_format
    from tiderl.rollout.tiny_model import default_model_dir, init_model
    from tiderl.rollout.vllm_engine import VllmEngine

    model_dir = args.model or init_model(default_model_dir("hilo"))
    fmt = chat_format(model_dir)
    engine = VllmEngine(
        model_dir,
        num_kv_blocks=args.kv_blocks,
        block_size=32,
        max_model_len=(args.kv_blocks - 1) * 32,
        max_num_seqs=args.concurrency,
        seed=args.seed,
    )
    try:
        result = asyncio.run(bench(engine, fmt, model_dir, args))
    finally:
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
