"""Vanilla vs CTB task scheduling on one real vLLM engine with a small KV cache.

The same multi-turn workload runs three times on the same engine: under `vanilla`
(request-level: a fixed number of concurrent tasks, vLLM's cache policy decides what
stays cached), under `ctb` with its fixed budget (the engine's KV capacity: token
budget, probing, priority pausing) and under `ctb` with the adaptive budget
(`rollout.ctb_budget: adaptive`, tiderl.policy.ctb_budget). The prefix cache is
dropped before each run (a weight reload of the same weights) and a short warm-up
runs first. Hit rate, generation throughput and step time come from vLLM's own
counters (`vllm:prefix_cache_hits/queries`, `vllm:generation_tokens`) and the wall
clock; tasks/s is finished tasks over the wall clock.

Settings (one JSON line each, `--setting` picks; default both):
- `tiny`: hilo (range 1-100, 10 turns, 8 new tokens a turn) with the 0.5M-parameter
  tiny model, 256 tasks in groups of 4, a 1,024-token cache; prefill costs almost
  nothing next to an engine step.
- `prefill`: textworld games that list their commands in every observation (a
  ~800-token first observation, ~180 tokens a turn, 6 turns, 16 new tokens a turn)
  with a 9.6M-parameter model of the same family (randomly initialised but for a
  two-step warm start: it plays badly, which only lengthens its games), 32 tasks in
  groups of 4, an 8,192-token cache: re-prefilling a context costs a visible share
  of the run, as with a large model on a GPU.

`--overcommit 2,4` adds runs of `ctb` with a fixed budget of that many times the
engine's capacity (`rollout.kv_budget_tokens`), keys `*_ctb_x2`, `*_ctb_x4`: where the
budget trades cached contexts for decoding sequences.

    .venv/bin/python tools/bench_ctb.py [--setting tiny] [--setting prefill] [--seed 0] [--overcommit 2,4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tiderl.envs.pool import EnvPool
from tiderl.policy.ctb_budget import BudgetLimits
from tiderl.rollout.agent_loop import LoopLimits
from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import Engine
from tiderl.rollout.local_env import LocalEnvLink
from tiderl.rollout.schedulers import make_scheduler
from tiderl.models.tiny_model import TinyModelSpec
from tiderl.rollout.trajectory import make_group
from tiderl.rollout.worker import RolloutWorker


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    model: TinyModelSpec
    model_dir_name: str
    env: str
    options: dict[str, Any]
    tasks: int
    group_size: int
    distinct_games: int
    kv_blocks: int
    concurrency: int
    max_turns: int
    max_new_tokens: int
    latency: str = "lognormal:0.02:0.1"
    env_server: bool = False
    """Play the environment through a real env server process (textworld's game engine crashes a process
    that also holds vLLM's engine client); else in-process, as before."""


SETTINGS = {
    "tiny": Setting(name="tiny", model=TinyModelSpec(env="hilo", seed=0), model_dir_name="tiny-hilo", env="hilo",
                    options={"low": 1, "high": 100, "max_turns": 10}, tasks=256, group_size=4, distinct_games=10**6,
                    kv_blocks=32, concurrency=64, max_turns=10, max_new_tokens=8),
    "prefill": Setting(
        name="prefill",
        model=TinyModelSpec(env="hilo", seed=0, hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2,
                            intermediate_size=1024, num_demos=100, train_steps=2, batch_size=4),
        model_dir_name="prefill-hilo", env="textworld",
        options={"show_commands": True, "nb_rooms": 4, "nb_objects": 6, "quest_length": 4, "max_turns": 6},
        tasks=32, group_size=4, distinct_games=8, kv_blocks=256, concurrency=32, max_turns=6, max_new_tokens=16,
        env_server=True),
}
RUNS = ("vanilla", "ctb", "ctb_adaptive")  # the ctb key is the fixed budget; ctb_adaptive the adaptive one


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", action="append", choices=list(SETTINGS), help="Setting to run (repeatable; default all).")
    p.add_argument("--tasks", type=int, default=None, help="Tasks per scheduler run (default: the setting's).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overcommit", type=_factors, default=(),
                   help="Comma-separated budget factors: also run ctb with a fixed budget of F x the KV capacity.")
    return p.parse_args()


def _factors(text: str) -> tuple[float, ...]:
    try:
        factors = tuple(float(f) for f in text.split(",") if f.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--overcommit: comma-separated numbers, got {text!r}") from None
    if not factors or any(f < 1 for f in factors):
        raise argparse.ArgumentTypeError(f"--overcommit: factors must be >= 1, got {text!r}")
    return factors


def run_name(factor: float) -> str:
    return f"ctb_x{factor:g}"


async def one_run(engine: Engine, fmt: ChatFormat, run: str, setting: Setting, first_seed: int,
                  num_tasks: int, seed: int, env_url: str | None, budget_tokens: int | None = None) -> dict[str, Any]:
    groups = [
        make_group(f"{run}-{first_seed + i}", setting.env, seed=first_seed + i % setting.distinct_games,
                   group_size=setting.group_size, options=setting.options)
        for i in range(max(1, num_tasks // setting.group_size))
    ]
    env: Any = LocalEnvLink(latency=setting.latency, seed=seed) if env_url is None else EnvPool([env_url], hold_s=60.0)
    limits = LoopLimits(max_turns=setting.max_turns, max_new_tokens=setting.max_new_tokens,
                        max_context_tokens=min(engine.kv_capacity_tokens, setting.model.max_position_embeddings))
    adaptive = BudgetLimits(floor_tokens=engine.kv_capacity_tokens) if run == "ctb_adaptive" else None
    worker = RolloutWorker(engine, env, fmt, make_scheduler("vanilla" if run == "vanilla" else "ctb"), limits,
                           max_resident_tasks=setting.concurrency, budget_limits=adaptive, budget_tokens=budget_tokens)
    worker.add_groups(groups)
    before = await engine.stats()
    started = time.monotonic()
    try:
        report = await worker.run()
    finally:
        if env_url is not None:
            await env.close()
    step_s = time.monotonic() - started
    delta = (await engine.stats()).minus(before)
    return {
        "hit_rate": round(delta.hit_rate, 4),
        "gen_tok_s": round(delta.generation_tokens / step_s, 1),
        "tasks_s": round(report.num_tasks / step_s, 3),
        "step_s": round(step_s, 2),
        "prefix_cache_queries": delta.prefix_cache_queries,
        "prefix_cache_hits": delta.prefix_cache_hits,
        "prompt_tokens": delta.prompt_tokens,
        "reprefilled_tokens": delta.prompt_tokens - delta.prefix_cache_hits,
        "generation_tokens": delta.generation_tokens,
        "preemptions": delta.num_preemptions,
        "pauses": report.num_pauses,
        "max_resident_tasks": report.max_resident_tasks,
        "prefix_kept_turns": report.prefix_kept_turns,
        "prefix_evicted_turns": report.prefix_evicted_turns,
        "max_budget_tokens": report.max_budget_tokens,
        # The adaptive budget's cost rule: what a re-prefilled token costs in generated tokens, as the worker
        # fitted it from its turns (None: no fit yet, the count rule), and the evicted contexts' tokens.
        "reprefill_cost": None if (cost := worker._cost_meter.cost()) is None else round(cost, 4),  # noqa: SLF001
        "evicted_context_tokens": worker.budget.lost_tokens,
        "success_rate": round(report.reward_mean, 3),
        "tasks": report.num_tasks,
    }


async def bench(engine: Engine, fmt: ChatFormat, model_dir: Path, setting: Setting, args: argparse.Namespace,
                env_url: str | None) -> dict[str, Any]:
    num_tasks = args.tasks or setting.tasks
    await one_run(engine, fmt, "vanilla", setting, 10**6, 2 * setting.group_size, args.seed, env_url)  # warm-up
    result: dict[str, Any] = {"setting": setting.name}
    runs = {run: None for run in RUNS} | {run_name(f): round(f * engine.kv_capacity_tokens) for f in args.overcommit}
    for run, budget in runs.items():
        await engine.reload_weights(model_dir, version=engine.weights_version + 1)  # drops the prefix cache
        figures = await one_run(engine, fmt, run, setting, args.seed * 10**4, num_tasks, args.seed, env_url,
                                budget_tokens=budget)
        result.update({f"{k}_{run}": v for k, v in figures.items()})
    for run in list(runs)[1:]:
        suffix = run[len("ctb"):]
        for key in ("hit_rate", "gen_tok_s", "tasks_s"):
            base = result[f"{key}_vanilla"]
            result[f"{key}_ratio{suffix}"] = round(result[f"{key}_{run}"] / base, 3) if base else None
    result["kv_capacity_tokens"] = engine.kv_capacity_tokens
    result["config"] = {"tasks": num_tasks, "seed": args.seed, "model_parameters": _parameters(model_dir),
                        **{k: v for k, v in dataclasses.asdict(setting).items() if k != "model"}}
    return result


def _parameters(model_dir: Path) -> int | None:
    try:
        return json.loads((model_dir / "tiderl-model.json").read_text())["num_parameters"]
    except (OSError, ValueError, KeyError):
        return None


def main() -> None:
    args = parse_args()
    # vLLM logs to stdout by default; stdout is for the JSON lines.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from tiderl.rollout.from_config import chat_format
    from tiderl.models.tiny_model import default_model_dir, init_model

    for name in args.setting or list(SETTINGS):
        setting = SETTINGS[name]
        model_dir = init_model(default_model_dir("hilo").with_name(setting.model_dir_name), setting.model)
        fmt = chat_format(model_dir)
        with contextlib.ExitStack() as stack:
            env_url = _env_server(stack, setting) if setting.env_server else None
            result = _run_setting(model_dir, fmt, setting, args, env_url)
        print(json.dumps(result), flush=True)


def _run_setting(model_dir: Path, fmt: ChatFormat, setting: Setting, args: argparse.Namespace,
                 env_url: str | None) -> dict[str, Any]:
    from tiderl.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(model_dir, num_kv_blocks=setting.kv_blocks, block_size=32,
                        max_model_len=min((setting.kv_blocks - 1) * 32, setting.model.max_position_embeddings),
                        max_num_seqs=setting.concurrency, seed=args.seed)
    try:
        return asyncio.run(bench(engine, fmt, model_dir, setting, args, env_url))
    finally:
        engine.close()


def _env_server(stack: contextlib.ExitStack, setting: Setting) -> str:
    """A real env server for the setting's environment, stopped when `stack` closes; its URL."""
    from tiderl.envs.launch import wait_for_url

    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ctb-")))
    port_file = work / "env.port"
    log = stack.enter_context(open(work / "env.log", "wb"))
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "env", "serve", "--env", setting.env, "--port-file",
                             str(port_file), "--latency", setting.latency, "--max-sessions-per-client", "512"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(timeout=30)))
    return wait_for_url(port_file, proc, timeout_s=120.0)


if __name__ == "__main__":
    main()
