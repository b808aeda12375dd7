"""Environments and the environment service.

`make_env(name)` gives a plain Python environment (no HTTP); `tiderl.envs.server`
serves them over HTTP and `tiderl.envs.client.EnvClient` talks to such a server.
"""

from tiderl.envs.base import (
    EnvActionError,
    Environment,
    EnvOptionError,
    StepResult,
    read_options,
)
from tiderl.envs.registry import UnknownEnvError, env_names, make_env, register_env

__all__ = [
    "EnvActionError",
    "EnvOptionError",
    "Environment",
    "StepResult",
    "UnknownEnvError",
    "env_names",
    "make_env",
    "read_options",
    "register_env",
]
