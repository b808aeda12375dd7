"""The environment interface: one small class per environment, no HTTP.

An environment is a plain Python object that plays one episode at a time:

    env = make_env("hilo")
    observation, info = env.reset(seed=3, options={})
    observation, reward, done, info = env.step("8")
    ...
    reward = env.final_reward()

The env server (`tiderl.envs.server`) wraps one such object per session; the
rollout side may also use the classes directly (e.g. to build warm-start
demonstrations). Observations and actions are strings; rewards are floats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple


class EnvOptionError(ValueError):
    """`reset` got an option it does not know or of the wrong type (the server answers 400)."""


class EnvActionError(RuntimeError):
    """`step` was called when the episode cannot take an action (not reset, or already done)."""


class StepResult(NamedTuple):
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


class Environment(ABC):
    """One episode of one environment. Subclasses set `name` and implement three methods.

    Contract:
    - `reset(seed, options)` starts a new episode, deterministic in `seed`, and returns the
      first observation and an info dict (JSON-serialisable). Bad options raise
      `EnvOptionError` naming the option.
    - `step(action)` applies one action and never raises on a bad action: an unparseable
      action gets an observation that says what was expected (and usually costs a turn).
      It raises `EnvActionError` only if called before `reset` or after `done`.
    - `final_reward()` is the episode's reward, read when the session ends (at any time,
      also before `done`: then it scores the episode as it stands).
    - `close()` frees resources (files, processes); the default does nothing.
    """

    name: ClassVar[str] = ""
    # True: reset/step do slow synchronous work (subprocesses, game engines); the server
    # runs them in a worker thread so other sessions keep going.
    blocking: ClassVar[bool] = False
    # The options `reset` takes, with their defaults (whose types are the expected ones); None:
    # not declared, and only `reset` checks them.
    option_defaults: ClassVar[Mapping[str, Any] | None] = None
    # Option values a client may not choose: the server answers 403 unless its operator allowed them
    # (`tiderl env serve --allow-unsafe-sandbox`), e.g. {"sandbox": ("unsafe",)}.
    operator_options: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise `EnvOptionError` for an option `reset` does not know or of the wrong type, before any
        episode starts (a job's `env.options` are checked so before its run is created)."""
        if cls.option_defaults is not None:
            read_options(cls.name, options, cls.option_defaults)

    @abstractmethod
    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """Start a new episode; returns (observation, info)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action; returns (observation, reward, done, info)."""

    @abstractmethod
    def final_reward(self) -> float:
        """The episode's reward."""

    def close(self) -> None:
        """Free resources held by the episode."""


def read_options(
    env_name: str, options: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """`options` merged over `defaults`, checked: unknown keys and wrong types raise
    `EnvOptionError`. A default's type is the expected type (ints are accepted for floats)."""
    if not isinstance(options, Mapping):
        raise EnvOptionError(f"{env_name}: options must be a mapping, got {options!r}")
    merged = dict(defaults)
    for key, value in options.items():
        if key not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            raise EnvOptionError(f"{env_name}: unknown option {key!r} (known options: {known})")
        default = defaults[key]
        expected: type | tuple[type, ...] = type(default)
        if isinstance(default, float):
            expected = (int, float)
        ok = isinstance(value, expected) and not (isinstance(value, bool) and not isinstance(default, bool))
        if default is not None and not ok:
            raise EnvOptionError(
                f"{env_name}: option {key!r} expects {type(default).__name__}, got {value!r}"
            )
        merged[key] = float(value) if isinstance(default, float) else value
    return merged
