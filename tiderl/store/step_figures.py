"""A training step's figures of the trajectories it trained: mean reward, success rate, turns per task, and
the reward and success of each environment among them; and a run's steady-state goodput, with its start-up
apart (:func:`steady_goodput`).

Pure: no SQL. The run store computes them once, in the transaction that publishes the step's version
(`RunStore.publish_version`, into the `versions` row), and every reader takes them from there: `tiderl
status`, TensorBoard and W&B (`tiderl.observe.tboard`), Prometheus (`tiderl.observe.metrics`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class TrainedRow(Protocol):
    """What the figures read of one trained trajectory (a `trajectories` row, or a :class:`TrainedTask`)."""

    @property
    def reward(self) -> float: ...

    @property
    def success(self) -> int | bool: ...

    @property
    def num_turns(self) -> int: ...

    @property
    def env(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class TrainedTask:
    reward: float
    success: bool
    num_turns: int
    env: str | None = None
    """The environment the task played (`TaskSpec.env`); None: not recorded (a store of an earlier TideRL)."""


@dataclass(frozen=True, slots=True)
class EnvFigures:
    """One environment's share of a step."""

    num_trajectories: int
    reward_mean: float
    success_rate: float


@dataclass(frozen=True, slots=True)
class StepFigures:
    reward_mean: float | None  # None: the step trained no trajectory
    success_rate: float | None
    turns_mean: float | None
    """Mean agent turns (generations) per trained task: `Trajectory.num_turns`, counted by the agent loop."""
    turns_max: int | None
    by_env: dict[str, EnvFigures]
    """Per environment named by its trajectories, in name order; trajectories with no environment recorded count
    only in the step's own figures."""

    def env_json(self) -> str | None:
        """`by_env` as the `versions.env_figures` column holds it (None: no environment recorded)."""
        return json.dumps({env: asdict(f) for env, f in self.by_env.items()}) if self.by_env else None


def step_figures(rows: Iterable[TrainedRow]) -> StepFigures:
    """The figures of a step that trained `rows`."""
    rows = list(rows)
    n = len(rows)
    by_env: dict[str, list[TrainedRow]] = defaultdict(list)
    for r in rows:
        if r.env is not None:
            by_env[r.env].append(r)
    return StepFigures(
        reward_mean=_mean(float(r.reward) for r in rows) if n else None,
        success_rate=_mean(float(bool(r.success)) for r in rows) if n else None,
        turns_mean=_mean(float(r.num_turns) for r in rows) if n else None,
        turns_max=max((int(r.num_turns) for r in rows), default=None),
        by_env={env: EnvFigures(num_trajectories=len(group), reward_mean=_mean(float(r.reward) for r in group),
                                success_rate=_mean(float(bool(r.success)) for r in group))
                for env, group in sorted(by_env.items())})


def parse_env_figures(text: str | None) -> dict[str, dict[str, Any]]:
    """The `versions.env_figures` column read back: {env: {num_trajectories, reward_mean, success_rate}}."""
    return json.loads(text) if text else {}


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def steady_from_version(published: Sequence[tuple[int, float]], engines_up_at: Sequence[float]) -> int:
    """The first version (>= 1) published at or after the last engine came up; `published` holds
    (version, publication time) in order. Where none is, the last version (no steady window)."""
    last_up = max(engines_up_at, default=0.0)
    after = [v for v, at in published if v >= 1 and at >= last_up]
    return after[0] if after else max((v for v, _ in published), default=1)


@dataclass(frozen=True, slots=True)
class SteadyGoodput:
    """Goodput once the run is up: the generated tokens trained by the versions after `from_version`,
    per second between its publication and the last one's (None: fewer than two versions there);
    `startup_s` from the run's creation to `from_version`'s publication (the model's build, the
    engines' start, the first steps)."""

    from_version: int
    tok_s: float | None
    startup_s: float | None


def steady_goodput(published: Sequence[tuple[int, float, int]], engines_up_at: Sequence[float],
                   run_created_at: float, from_version: int | None = None) -> SteadyGoodput:
    """From the published versions ((version, publication time, generated tokens trained), ascending) and
    when each engine came up; `from_version` None: :func:`steady_from_version`."""
    rows = [r for r in published if r[0] >= 1]
    if from_version is None:
        from_version = steady_from_version([(v, at) for v, at, _ in rows], engines_up_at)
    window = [r for r in rows if r[0] >= from_version]
    start = window[0][1] if window else None
    tok_s = None
    if len(window) >= 2 and window[-1][1] > window[0][1]:
        tok_s = sum(tokens for _, _, tokens in window[1:]) / (window[-1][1] - window[0][1])
    return SteadyGoodput(from_version, tok_s, None if start is None else max(0.0, start - run_created_at))

