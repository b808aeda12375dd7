"""Environments played in-process behind the same async interface as the env service.

`EnvLink` is what the agent loop needs from environments; `tiderl.envs.client.EnvClient`
and `EnvPool` (HTTP) satisfy it, and so does `LocalEnvLink`, which runs the plain
environment classes in this process with an optional injected latency profile (for
tests and benchmarks that should not pay for HTTP).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any, Protocol

from tiderl.envs import make_env
from tiderl.envs.base import StepResult
from tiderl.envs.client import EndResult, StartResult, StepWithImages
from tiderl.envs.images import ImageEnvironment, PngImage, check_png
from tiderl.config.latency import parse_latency


class EnvLink(Protocol):
    async def start(self, env: str, seed: int, options: dict[str, Any] | None = None) -> StartResult: ...

    async def step(self, session_id: str, action: str) -> StepResult: ...

    async def pause(self, session_id: str) -> str: ...

    async def resume(self, session_id: str) -> str: ...

    async def end(self, session_id: str) -> EndResult: ...


class LocalEnvLink:
    """Sessions of plain environment objects; counts pauses and resumes it was asked for."""

    def __init__(self, latency: str = "none", seed: int = 0) -> None:
        self._latency = parse_latency(latency)
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._sessions: dict[str, Any] = {}
        self.paused: set[str] = set()
        self.num_starts = 0
        self.num_pauses = 0
        self.num_resumes = 0
        self.max_sessions_seen = 0

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def _session(self, session_id: str) -> Any:
        if session_id not in self._sessions:
            raise KeyError(f"local env: unknown session {session_id!r}")
        return self._sessions[session_id]

    async def _delay(self) -> None:
        delay_s = self._latency.sample_s(self._rng)
        await asyncio.sleep(delay_s)

    async def start(self, env: str, seed: int, options: dict[str, Any] | None = None) -> StartResult:
        instance = make_env(env)
        observation, info = instance.reset(seed=seed, options=options or {})
        session_id = f"s{next(self._ids)}"
        self._sessions[session_id] = instance
        self.num_starts += 1
        self.max_sessions_seen = max(self.max_sessions_seen, len(self._sessions))
        return StartResult(session_id, observation, False, info, images=_images(instance))

    async def step(self, session_id: str, action: str) -> StepResult:
        instance = self._session(session_id)
        if session_id in self.paused:
            raise RuntimeError(f"local env: step on paused session {session_id}")
        await self._delay()
        step = instance.step(action)
        images = _images(instance)
        return StepWithImages(*step, images=images) if images else step

    async def pause(self, session_id: str) -> str:
        self._session(session_id)
        self.paused.add(session_id)
        self.num_pauses += 1
        return "paused"

    async def resume(self, session_id: str) -> str:
        self._session(session_id)
        self.paused.discard(session_id)
        self.num_resumes += 1
        return "active"

    async def end(self, session_id: str) -> EndResult:
        self._session(session_id)
        instance = self._sessions.pop(session_id)
        self.paused.discard(session_id)
        reward = instance.final_reward()
        instance.close()
        return EndResult(reward, {})


def _images(instance: Any) -> tuple[PngImage, ...]:
    """The images of the observation an image environment returned last (checked as the server would)."""
    if not isinstance(instance, ImageEnvironment):
        return ()
    return tuple(check_png(data) for data in instance.observation_images())
