"""Warm-start demonstrations: episodes played by a noisy expert, as chat messages.

The tiny model is warm-started on these so RL starts from a policy that speaks
the environment's action format and plays better than chance, but not perfectly:
with probability ``noise`` a turn's action is a uniformly random legal-looking
action instead of the expert's, so the demonstrations themselves are imperfect.

An environment with pictures (`tiderl.envs.images.ImageEnvironment`) also gives each
user message the PNGs that came with its observation, under ``"images"``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tiderl.envs import Environment, make_env
from tiderl.envs.images import ImageEnvironment


class NoDemonstrationsError(ValueError):
    """The environment has no demonstration policy for the warm start."""


def _hilo_noisy_expert(env: Any, rng: random.Random, noise: float) -> str:
    if rng.random() < noise:
        return str(rng.randint(env.low, env.high))
    return env.expert_action()


def _moves_noisy_expert(env: Any, rng: random.Random, noise: float) -> str:
    if rng.random() < noise:
        return rng.choice(env.action_words)
    return env.expert_action()


# env name -> (env, rng, noise) -> action text
_DEMO_POLICIES: dict[str, Callable[[Any, random.Random, float], str]] = {
    "hilo": _hilo_noisy_expert,
    "gridimage": _moves_noisy_expert,
}


def demo_env_names() -> list[str]:
    return sorted(_DEMO_POLICIES)


def play_demonstration(
    env_name: str, seed: int, noise: float, options: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], float]:
    """One episode of the noisy expert: (messages, final reward). Deterministic in ``seed``.
    A user message of an environment with pictures carries them as ``"images"`` (PNG bytes)."""
    if env_name not in _DEMO_POLICIES:
        raise NoDemonstrationsError(
            f"no demonstration policy for environment {env_name!r} "
            f"(environments with one: {', '.join(demo_env_names())})"
        )
    policy = _DEMO_POLICIES[env_name]
    env: Environment = make_env(env_name)
    rng = random.Random(seed * 7919 + 1)
    pictures = env.observation_images if isinstance(env, ImageEnvironment) else None

    def user(observation: str) -> dict[str, Any]:
        return {"role": "user", "content": observation} | ({"images": pictures()} if pictures else {})

    observation, _ = env.reset(seed=seed, options=options or {})
    messages = [user(observation)]
    done = False
    try:
        while not done:
            action = policy(env, rng, noise)
            messages.append({"role": "assistant", "content": action})
            observation, _, done, _ = env.step(action)
            messages.append(user(observation))
        return messages, env.final_reward()
    finally:
        env.close()


def corpus_texts(env_name: str, seeds: range, noise: float) -> list[str]:
    """Raw texts (observations and actions) to train the tokenizer on."""
    texts = []
    for seed in seeds:
        messages, _ = play_demonstration(env_name, seed, noise)
        texts.extend(m["content"] for m in messages)
    return texts
