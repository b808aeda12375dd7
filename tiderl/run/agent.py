"""One task played to its end: the agent loop of a rollout rank (engine + env service).

The context is built from id pieces (`tiderl.rollout.chat`): the prompt, the
model's sampled ids exactly as generated (loss mask 1, their logprobs and the
weights version that produced them), then the environment's answer (mask 0).
A turn cut by `max_new_tokens` gets its end-of-turn marker appended as a
non-model token so the next environment piece parses the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiderl.envs.client import EnvPool
from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import Engine, SamplingSpec
from tiderl.store.types import FinishedTrajectory, TaskClaim


@dataclass(slots=True)
class Episode:
    """The growing trajectory of one task."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    num_turns: int = 0

    def add_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.token_versions += [-1] * len(ids)

    def add_generated(self, ids: tuple[int, ...], logprobs: tuple[float, ...], version: int) -> None:
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.token_versions += [version] * len(ids)

    @property
    def min_version(self) -> int | None:
        versions = [v for v, m in zip(self.token_versions, self.loss_mask) if m]
        return min(versions) if versions else None


@dataclass(frozen=True, slots=True)
class AgentSettings:
    env_name: str
    env_options: dict[str, Any]
    max_turns: int
    max_context_tokens: int
    max_new_tokens: int
    temperature: float


async def play_task(claim: TaskClaim, engine: Engine, pool: EnvPool, fmt: ChatFormat, settings: AgentSettings,
                    episode: Episode) -> FinishedTrajectory:
    """Play `claim` to its end; `episode` is filled as it goes (the caller reads its versions)."""
    start = await pool.start(settings.env_name, claim.seed, dict(settings.env_options))
    session = start.session_id
    try:
        episode.add_context(fmt.prompt_ids(start.observation))
        done = start.done
        sampling = SamplingSpec(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                stop_token_ids=(fmt.end_of_turn_id,))
        while not done and episode.num_turns < settings.max_turns:
            if len(episode.token_ids) + settings.max_new_tokens > settings.max_context_tokens:
                break  # the context would outgrow the model's window: end the episode here
            gen = await engine.generate(episode.token_ids, sampling)
            episode.add_generated(gen.token_ids, gen.logprobs, gen.weights_version)
            if not gen.token_ids or gen.token_ids[-1] != fmt.end_of_turn_id:
                episode.add_context([fmt.end_of_turn_id])
            episode.num_turns += 1
            step = await pool.step(session, fmt.action_text(gen.token_ids))
            done = step.done
            if not done:
                episode.add_context(fmt.env_turn_ids(step.observation))
    finally:
        end = await pool.end(session)
    found = end.info.get("found")
    return FinishedTrajectory(
        task_id=claim.task_id, token_ids=episode.token_ids, loss_mask=episode.loss_mask,
        logprobs=episode.logprobs, token_versions=episode.token_versions, num_turns=episode.num_turns,
        reward=end.reward, success=bool(found) if found is not None else end.reward > 0,
    )
