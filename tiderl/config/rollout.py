"""`rollout:` section: rollout ranks, the agent loop and the task scheduler."""

from __future__ import annotations

from typing import Literal

from tiderl.config.schema import option, section


@section
class RolloutConfig:
    scheduler: Literal["vanilla", "ctb"] = option(
        "ctb",
        help="Task scheduler: `ctb` (Continuous Task Batching by KV token budget and RL priority) "
        "or `vanilla` (request-level, fixed concurrency, engine cache policy decides).",
    )
    group_size: int = option(4, ge=1, help="GRPO group size G: tasks played per prompt.")
    max_concurrency: int = option(
        64, ge=1, help="Tasks one rollout rank runs at once under `vanilla` (CTB's upper cap too)."
    )
    kv_budget_tokens: int | None = option(
        None,
        ge=1,
        help="CTB token budget per rollout rank. null: the engine's reported KV capacity.",
    )
    max_staleness: int = option(
        1, ge=0, help="No task is admitted whose data would be more than this many versions old when trained."
    )
    max_new_tokens: int = option(16, ge=1, help="Tokens the model may generate in one turn.")
    temperature: float = option(1.0, ge=0.0, help="Sampling temperature of training tasks.")
    eval_every_steps: int = option(0, ge=0, help="Run evaluation tasks every N versions (0: never).")
    eval_groups: int = option(4, ge=0, help="Evaluation prompts per evaluation round.")
    kv_cache_gib: float = option(
        0.25, gt=0, help="KV cache size of one CPU vLLM engine (VLLM_CPU_KVCACHE_SPACE), GiB."
    )
