"""The multi-turn agent loop of one task: generate -> environment step -> ... -> end.

The context grows by id pieces only (see `tiderl.rollout.chat`): the model's
sampled ids go in exactly as sampled (loss mask 1, with their logprobs and weights
version), the environment's answers go in as the ids of the rendered environment
message (loss mask 0). Nothing is ever re-tokenised. With the sliding image window
(`LoopLimits.keep_images`) the oldest pictures leave the engine's context and the
trajectory records where (`Trajectory.prunes`, docs/rollout.md).

A `TurnGate` (the task scheduler) sees every turn boundary: it may hold a task
before its next generation (CTB pauses it there) and learns the task's context
length each turn (CTB's footprint).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
import zlib
from typing import Protocol

from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import Engine, SamplingSpec
from tiderl.rollout.local_env import EnvLink
from tiderl.envs.client import EnvConflictError, EnvNotFoundError, EnvServiceError
from tiderl.rollout.trajectory import TaskProgress, TaskSpec, Trajectory

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"  # env /start in flight; no context yet
    GENERATING = "generating"
    WAITING_ENV = "waiting_env"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoopLimits:
    max_turns: int
    max_context_tokens: int
    max_new_tokens: int
    temperature: float = 1.0
    eval_temperature: float = 0.0  # evaluation tasks play greedily
    max_images: int = 10  # images one context may carry (an image environment)
    keep_images: int | None = None  # the sliding window: once max_images would be reached, keep this many newest

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context_tokens", "max_new_tokens", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.keep_images is not None and not 1 <= self.keep_images < self.max_images:
            raise ValueError(f"keep_images: must be >= 1 and < max_images ({self.max_images}), got {self.keep_images}")

    def images_to_drop(self, kept: int, new: int) -> int:
        """How many of the context's `kept` images (the oldest) the sliding window prunes before an observation
        brings `new` more: once the context would hold `max_images`, it keeps the `keep_images` newest (the
        paper's Appendix C.2: at ten, keep five), never the observation's own. 0 without a window."""
        if self.keep_images is None or kept + new < self.max_images:
            return 0
        return min(kept, kept + new - self.keep_images)


@dataclasses.dataclass(kw_only=True, slots=True)
class TaskRun:
    """A task in flight on this rank: what the scheduler looks at."""

    spec: TaskSpec
    phase: Phase = Phase.STARTING
    context_tokens: int = 0
    num_prompt_tokens: int = 0
    session_id: str | None = None
    num_turns: int = 0
    num_pauses: int = 0
    # The context length (ids), turn count and image count at the last turn boundary where the task may
    # be handed to another rank (before a generation); None while the environment is mid-step.
    checkpoint: tuple[int, int, int] | None = None
    trajectory: Trajectory | None = None
    handoff: bool = False  # set before cancelling: keep the env session (paused) instead of ending it
    # The last generation: the context the previous one left in the engine's cache, and the prompt
    # tokens the engine served from its prefix cache (None: not reported yet, or already read).
    prefix_tokens: int = 0
    cached_tokens: int | None = None


class TurnGate(Protocol):
    async def before_generate(self, run: TaskRun, env: EnvLink) -> None:
        """Called with the task's current context before each generation; may hold the task."""

    def after_turn(self, run: TaskRun) -> None:
        """The task's phase or context changed (a generation or env step finished)."""


async def run_task(
    spec: TaskSpec,
    run: TaskRun,
    engine: Engine,
    env: EnvLink,
    fmt: ChatFormat,
    limits: LoopLimits,
    gate: TurnGate,
) -> Trajectory:
    trajectory = await _begin(spec, run, env, fmt)
    session_id = run.session_id
    assert session_id is not None
    temperature = limits.eval_temperature if spec.is_eval else limits.temperature
    finish = "done"
    left_in_cache = 0  # the context the previous generation left in the engine's prefix cache
    left_version = -1  # the weights it was computed with (a reload empties the cache)
    try:
        while True:
            room = min(limits.max_new_tokens, limits.max_context_tokens - trajectory.engine_tokens)
            if room < 1:
                finish = "max_context"
                break
            run.checkpoint = (len(trajectory.token_ids), run.num_turns, len(trajectory.images))
            await gate.before_generate(run, env)
            run.phase = Phase.GENERATING
            # Per-task seed: a replayed task samples the same turns under the same weights.
            sampling = SamplingSpec(
                max_new_tokens=room,
                temperature=temperature,
                stop_token_ids=fmt.stop_ids,
                banned_token_ids=fmt.banned_ids,
                seed=zlib.crc32(f"{spec.task_id}#{run.num_turns}".encode()) & 0x7FFFFFFF,
            )
            context, shown = trajectory.context()
            generation = await engine.generate(context, sampling, shown)
            same_weights = generation.weights_version == left_version
            run.prefix_tokens, run.cached_tokens = left_in_cache if same_weights else 0, generation.num_cached_tokens
            trajectory.append(generation.token_ids, sampled=True, logprobs=generation.logprobs, versions=generation.versions)
            left_in_cache = trajectory.engine_tokens  # prompt and generated tokens stay cached (full blocks)
            left_version = generation.weights_version
            if not fmt.closes_turn(generation.token_ids):
                # Cut by the length limit: close the turn with the end-of-turn id so the context stays
                # well-formed; the closing id was not sampled, so it is not trained on.
                trajectory.append([fmt.end_of_turn_id], sampled=False)
            run.phase = Phase.WAITING_ENV
            run.context_tokens = trajectory.engine_tokens
            gate.after_turn(run)
            run.checkpoint = None  # from here until the answer is in, the task cannot move
            env_t0 = time.monotonic()
            step = await env.step(session_id, fmt.action_text(generation.token_ids))
            trajectory.env_s += time.monotonic() - env_t0
            run.num_turns += 1
            if step.done:
                break
            if run.num_turns >= limits.max_turns:
                finish = "max_turns"
                break
            images = tuple(getattr(step, "images", ()))  # an image environment's answer carries them
            piece = fmt.env_turn_ids(step.observation, len(images))
            counts = [fmt.image_count(i.width, i.height) for i in images]
            d = trajectory.dropped
            drop = limits.images_to_drop(len(trajectory.images) - d, len(images))
            after = trajectory.engine_tokens - trajectory.tokens_freed_by(drop) + len(piece) + sum(counts) - len(counts)
            if after >= limits.max_context_tokens or len(trajectory.images) - d - drop + len(images) > limits.max_images:
                finish = "max_context"
                break
            if drop:  # the trajectory splits here; the engine's cache keeps the context before the oldest image
                left_in_cache = min(left_in_cache, trajectory.prune(d + drop))
            spans = fmt.image_spans(piece, offset=len(trajectory.token_ids))
            trajectory.append(piece, sampled=False)
            trajectory.add_images(images, counts, spans)
            run.context_tokens = trajectory.engine_tokens
            gate.after_turn(run)
    except asyncio.CancelledError:
        if run.handoff and run.checkpoint is not None:
            await env.pause(session_id)  # the next rank resumes it
        else:
            await _end_quietly(env, session_id)
        raise
    except BaseException:
        await _end_quietly(env, session_id)  # the task's own error is the one to report
        raise
    ended = await env.end(session_id)
    trajectory.reward = ended.reward
    trajectory.env_info = dict(ended.info)
    trajectory.num_turns = run.num_turns
    trajectory.finish = finish
    trajectory.num_pauses = run.num_pauses
    run.phase = Phase.FINISHED
    return trajectory


async def _end_quietly(env: EnvLink, session_id: str) -> None:
    """End a session of a task that failed or stopped; the session may be gone with its server."""
    for delay_s in (0.05, 0.1, 0.2, None):
        try:
            await env.end(session_id)
            return
        except EnvConflictError as e:  # a step cut off on our side may still be running on the server
            if delay_s is None:
                log.info("session %s not ended (the server reaps it when idle): %s", session_id, e)
                return
            await asyncio.sleep(delay_s)
        except (EnvServiceError, KeyError) as e:
            log.info("session %s not ended cleanly: %s", session_id, e)
            return


async def _begin(spec: TaskSpec, run: TaskRun, env: EnvLink, fmt: ChatFormat) -> Trajectory:
    """Start the env session and the context, or carry on a handed-over task: its paused
    session resumes and its context so far is prefilled afresh by the next generation. A
    handed-over session the server no longer holds restarts the task from the beginning."""
    progress = spec.progress
    if progress is not None:
        try:
            if progress.server is not None and hasattr(env, "adopt"):
                env.adopt(progress.session_id, progress.server)
            await env.resume(progress.session_id)
        except (KeyError, EnvNotFoundError, EnvConflictError):
            progress = None  # reaped or ended meanwhile: play the task again from its start
    if progress is not None:
        run.session_id = progress.session_id
        trajectory = Trajectory(task=spec, token_ids=list(progress.token_ids), loss_mask=list(progress.loss_mask),
                                logprobs=list(progress.logprobs), versions=list(progress.versions),
                                num_prompt_tokens=progress.num_prompt_tokens)
        trajectory.add_images(progress.images, [fmt.image_count(i.width, i.height) for i in progress.images],
                              fmt.image_spans(progress.token_ids))
        trajectory.prunes = list(progress.prunes)
        run.num_turns, run.num_pauses = progress.num_turns, progress.num_pauses
        run.num_prompt_tokens = progress.num_prompt_tokens
    else:
        env_t0 = time.monotonic()
        started = await env.start(spec.env, spec.seed, spec.options)
        env_s = time.monotonic() - env_t0
        run.session_id = started.session_id
        prompt = fmt.prompt_ids(started.observation, images=len(started.images))
        trajectory = Trajectory(task=spec, token_ids=[], loss_mask=[], logprobs=[], versions=[],
                                num_prompt_tokens=len(prompt))
        trajectory.env_s = env_s
        trajectory.append(prompt, sampled=False)
        trajectory.add_images(started.images, [fmt.image_count(i.width, i.height) for i in started.images],
                              fmt.image_spans(prompt))
        run.num_prompt_tokens = len(prompt)
    run.context_tokens = trajectory.engine_tokens
    run.trajectory = trajectory
    return trajectory


def progress_of(run: TaskRun, server: str | None) -> TaskProgress | None:
    """The task at its last hand-over point, or None if it has none (env mid-step, not started)."""
    t = run.trajectory
    if run.checkpoint is None or t is None or run.session_id is None:
        return None
    n, turns, shown = run.checkpoint
    return TaskProgress(session_id=run.session_id, server=server, token_ids=tuple(t.token_ids[:n]),
                        loss_mask=tuple(t.loss_mask[:n]), logprobs=tuple(t.logprobs[:n]),
                        versions=tuple(t.versions[:n]), num_prompt_tokens=t.num_prompt_tokens, num_turns=turns,
                        num_pauses=run.num_pauses, images=tuple(t.images[:shown]),
                        prunes=tuple(p for p in t.prunes if p[0] < n))
