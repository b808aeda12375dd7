"""The rollout pieces built from a job config (`model:`, `env:`, `rollout:` sections)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from tiderl.config.job import JobConfig
from tiderl.config.model import ModelConfig
from tiderl.policy.ctb import PriorityWeights
from tiderl.policy.ctb_budget import BudgetLimits
from tiderl.rollout.agent_loop import LoopLimits
from tiderl.rollout.chat import ChatFormat, ImageTokens
from tiderl.rollout.engine import Engine
from tiderl.rollout.local_env import EnvLink
from tiderl.rollout.schedulers import make_scheduler
from tiderl.rollout.worker import RolloutWorker, Sink


def chat_format(model_path: str | Path, model: ModelConfig | None = None) -> ChatFormat:
    """The chat format of the model directory's tokenizer, with the `model:` section's `system_prompt` and
    `chat_template_kwargs` (None: neither)."""
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(model_path), ImageTokens.of_model(model_path),
                      system_prompt=model.system_prompt if model is not None else None,
                      template_kwargs=model.chat_template_kwargs if model is not None else None)


def loop_limits(job: JobConfig) -> LoopLimits:
    return LoopLimits(
        max_turns=job.env.max_turns,
        max_context_tokens=job.model.max_context_tokens,
        max_new_tokens=job.rollout.max_new_tokens,
        temperature=job.rollout.temperature,
        eval_temperature=job.rollout.eval_temperature,
        max_images=job.rollout.max_images,
        keep_images=job.rollout.keep_images,
    )


def priority_weights(job: JobConfig) -> PriorityWeights:
    r = job.rollout
    return PriorityWeights(
        eval=r.ctb_weight_eval,
        group_completion=r.ctb_weight_group,
        active=r.ctb_weight_active,
        context=r.ctb_weight_context,
        context_scale_tokens=job.model.max_context_tokens,
    )


def budget_limits(job: JobConfig) -> BudgetLimits | None:
    """The adaptive CTB budget's limits (None: `rollout.ctb_budget: fixed`, or not the ctb scheduler).
    The worker sets the floor to its fixed budget."""
    r = job.rollout
    if r.scheduler != "ctb" or r.ctb_budget != "adaptive":
        return None
    return BudgetLimits(floor_tokens=r.kv_budget_tokens or 1, max_factor=r.ctb_max_overcommit)


VLLM_FACTORY = "tiderl.rollout.vllm_engine:for_job"  # `rollout.engine: vllm`


def make_engine(job: JobConfig, model_path: str | Path, weights_version: int = 0) -> Engine:
    """The rank's engine, by `rollout.engine`: the factory it names (`engine_factory`; `vllm`: `VLLM_FACTORY`).
    vLLM's spawns: call under `if __name__ == "__main__":` in scripts."""
    engine = engine_factory(VLLM_FACTORY if job.rollout.engine == "vllm" else job.rollout.engine)(
        job, model_path, weights_version)
    if not isinstance(engine, Engine):
        raise TypeError(f"rollout.engine: {job.rollout.engine} returned a {type(engine).__name__}, not a "
                        "tiderl.rollout.engine.Engine")
    return engine


def engine_factory(spec: str) -> Callable[[JobConfig, str | Path, int], Engine]:
    """The factory `rollout.engine` names (MODULE:FUNCTION); a ValueError names what could not be loaded."""
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec}: {type(e).__name__}: {e}") from None
    if not callable(factory):
        raise ValueError(f"{spec} is a {type(factory).__name__}, not a function")
    return factory


def rollout_worker(
    job: JobConfig,
    engine: Engine,
    env: EnvLink,
    fmt: ChatFormat,
    *,
    sink: Sink | None = None,
    staleness_allowance: Callable[[], int | None] | None = None,
    max_resident_tasks: int | None = None,
) -> RolloutWorker:
    """``max_resident_tasks``: this rank's share of the environment concurrency cap
    (default `rollout.max_concurrency`)."""
    return RolloutWorker(
        engine,
        env,
        fmt,
        make_scheduler(job.rollout.scheduler, priority_weights(job)),
        loop_limits(job),
        sink=sink,
        budget_tokens=job.rollout.kv_budget_tokens,
        max_resident_tasks=max_resident_tasks or job.rollout.max_concurrency,
        staleness_allowance=staleness_allowance,
        budget_limits=budget_limits(job),
    )
