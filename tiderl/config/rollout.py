"""`rollout:` section: rollout ranks, the agent loop and the task scheduler."""

from __future__ import annotations

import re
from typing import Literal

from tiderl.config.schema import option, section


@section
class RolloutConfig:
    scheduler: Literal["vanilla", "ctb"] = option(
        "ctb",
        help="Task scheduler: `ctb` (Continuous Task Batching by KV token budget and RL priority) "
        "or `vanilla` (request-level, fixed concurrency, engine cache policy decides).",
    )
    engine: str = option(
        "vllm", help="The rollout ranks' engine: `vllm`, or `MODULE:FUNCTION`, a factory `f(job, model_path, "
        "weights_version)` returning a `tiderl.rollout.engine.Engine`, importable where the ranks run (another "
        "inference engine; the tests' scripted one runs a whole local run without vLLM).")
    group_size: int = option(
        4, ge=2, help="GRPO group size G: tasks played per prompt (>= 2: a group's advantages are its rewards "
        "against their mean, so one task alone learns nothing).")
    max_concurrency: int = option(
        64, ge=1, help="Tasks one rollout rank runs at once under `vanilla` (CTB's upper cap too)."
    )
    kv_budget_tokens: int | None = option(
        None,
        ge=1,
        help="CTB token budget per rollout rank. null: the engine's reported KV capacity.",
    )
    ctb_budget: Literal["fixed", "adaptive"] = option(
        "adaptive",
        help="CTB's token budget: `fixed` (`kv_budget_tokens`, or the engine's capacity) or `adaptive` "
        "(from there up to `ctb_max_overcommit` times it, raised while the budget holds tasks back and the "
        "engine's prefix cache keeps the contexts of tasks waiting on their environment, lowered when it "
        "evicts them; tiderl.policy.ctb_budget).",
    )
    ctb_max_overcommit: float = option(
        4.0, ge=1.0, help="Ceiling of the adaptive CTB budget, as a multiple of the fixed one."
    )
    report_interval_s: float = option(
        0.25,
        gt=0,
        help="How often a rollout rank reports to the run store: finished trajectories, releases, "
        "heartbeat and its claim of new tasks in one transaction. Raise it where commits are slow "
        "(a store on a network filesystem: about 1 s).",
    )
    task_attempts: int = option(
        3, ge=1, help="Attempts a task gets: a task that fails this many times fails for good, and its group with it.")
    retry_backoff_s: float = option(
        1.0,
        ge=0,
        help="A task that failed waits this long before another rank may claim it, doubling with each "
        "further failure (1, 2, 4 s by default): a transient fault (an env server restarting, a burst "
        "of bad answers) does not burn every attempt at once. 0: claimable again at once.",
    )
    max_staleness: int = option(
        1, ge=0, help="No task is admitted whose data would be more than this many versions old when trained."
    )
    max_new_tokens: int = option(16, ge=1, help="Tokens the model may generate in one turn.")
    max_images: int = option(
        10, ge=1, help="Images one context may carry (an image environment with a vision-language model): the "
        "engine takes at most this many a request, and a task whose next observation would pass it ends as "
        "max_context (without `keep_images`).")
    keep_images: int | None = option(
        None, ge=1, help="The sliding image window (the paper's multi-modal runs: max_images 10, keep_images 5): once "
        "a context would hold `max_images` images, the oldest leave it and the `keep_images` newest stay; the "
        "trajectory splits there and the trainer trains each part with the context the engine saw. null: no "
        "window.")
    temperature: float = option(
        1.0, gt=0.0, help="Sampling temperature of training tasks (> 0: greedy tasks of a group would all be "
        "the same, with zero advantages; the trainer scores tokens at this temperature too).")
    eval_every_steps: int = option(0, ge=0, help="Run evaluation tasks every N versions (0: never).")
    eval_groups: int = option(4, ge=0, help="Evaluation prompts per evaluation round.")
    kv_cache_gib: int = option(
        1, ge=1, help="KV cache size of one CPU vLLM engine in whole GiB (VLLM_CPU_KVCACHE_SPACE, an integer)."
    )
    kv_cache_blocks: int | None = option(
        None,
        ge=2,
        help="Override the engine's KV cache to this many blocks of `kv_block_size` tokens (a small "
        "cache creates real pressure with the tiny model). null: sized by `kv_cache_gib` (or GPU memory).",
    )
    kv_block_size: int = option(
        32, ge=16, help="KV block size in tokens (vLLM's CPU attention needs a multiple of 32)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", help="The rollout engine's weights and compute precision: `auto` is bf16 on a GPU, fp32 on a CPU."
    )
    tensor_parallel_size: int = option(
        1, ge=1, help="GPUs one rollout engine spans (vLLM tensor parallelism); a rollout rank owns that many."
    )
    gpu_memory_utilization: float = option(
        0.9, gt=0, le=1, help="Share of its GPUs' memory a rollout engine takes for weights and KV cache (vLLM's). "
        "Unused on a CPU (`kv_cache_gib`)."
    )
    enforce_eager: bool | None = option(
        None,
        help="Run the engine's model eagerly: no torch.compile and no CUDA graphs. null: eager on a CPU (a compile "
        "there costs 20-50 s an engine start for no faster decoding of small models, docs/RESULTS.md), compiled on "
        "a GPU.",
    )
    eval_temperature: float = option(0.0, ge=0.0, help="Sampling temperature of evaluation tasks (0: greedy).")
    ctb_weight_eval: float = option(1000.0, ge=0.0, help="CTB priority weight of evaluation tasks (Table 1, tier 1).")
    ctb_weight_group: float = option(
        100.0, ge=0.0, help="CTB priority weight of the task's GRPO group completion ratio (tier 2)."
    )
    ctb_weight_active: float = option(10.0, ge=0.0, help="CTB priority weight of a task that is generating (tier 3).")
    ctb_weight_context: float = option(
        1.0, ge=0.0, help="CTB priority weight of context length relative to `model.max_context_tokens` (tier 4)."
    )

    @property
    def eval_group_size(self) -> int:
        """Tasks of one evaluation prompt: greedy evaluation plays every copy of a prompt the same way, so one."""
        return 1 if self.eval_temperature == 0 else self.group_size

    @property
    def eval_round_tasks(self) -> int:
        """Tasks of one evaluation round (0: no evaluation)."""
        return self.eval_groups * self.eval_group_size if self.eval_every_steps else 0

    def __post_init__(self) -> None:
        if self.engine != "vllm" and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.engine):
            raise ValueError(f"engine: expected `vllm` or MODULE:FUNCTION, got {self.engine!r}")
        if self.keep_images is not None and self.keep_images >= self.max_images:
            raise ValueError(f"keep_images: must be < max_images ({self.max_images}), got {self.keep_images}")
        if self.kv_block_size % 16:
            raise ValueError(f"kv_block_size: must be a multiple of 16, got {self.kv_block_size}")
