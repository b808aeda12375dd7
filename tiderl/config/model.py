"""`model:` section: which policy model the run trains."""

from __future__ import annotations

from typing import Any

from tiderl.config.schema import option, section


@section
class ModelConfig:
    path: str | None = option(
        None,
        help="Hugging Face model directory (config, safetensors, tokenizer) loaded by both vLLM "
        "and transformers. null: the tiny model `tiderl init-model` builds for `init_env`, cached.",
    )
    init_env: str = option("hilo", help="Environment whose demonstrations warm-start the tiny model when `path` is null.")
    init_train_steps: int | None = option(
        None,
        ge=0,
        help="Supervised warm-start steps of the tiny model when `path` is null (null: the model's default, 250 "
        "for the text model, 800 for the vision-language one; 0: random weights). Fewer: a weaker start that "
        "leaves RL more to learn. Its demonstrations use `env.options` when `init_env` is `env.name`.",
    )
    init_demo_noise: float | None = option(
        None,
        ge=0.0,
        le=1.0,
        help="Share of random actions in the tiny model's warm-start demonstrations when `path` is null (null: "
        "the model's default, 0.3 for the text model, 0.1 for the vision-language one). Less noise: the sampled "
        "policy plays closer to the demonstrators, and RL moves greedy play sooner.",
    )
    max_context_tokens: int = option(
        1024, ge=64, help="Longest context (prompt + all turns) a task may reach, in tokens."
    )
    system_prompt: str | None = option(
        None,
        help="System message of every task's prompt. null: the chat template's default (Qwen2.5's \"You are "
        "Qwen...\", none for most templates).",
    )
    chat_template_kwargs: dict[str, Any] = option(
        default_factory=dict,
        help="Extra variables of the model's chat template, passed to `apply_chat_template` at every rendering "
        "(e.g. `{enable_thinking: false}` for Qwen3).",
    )
