"""Environment registry: name -> class, and the factory `make_env`.

Built-in environments are imported lazily (the tool-use and TextWorld ones pull in
heavy packages), so importing this module is cheap. Add an environment with
`register_env(name, cls)` or by adding a line to `_BUILTIN`.
"""

from __future__ import annotations

import importlib

from tiderl.envs.base import Environment

# name -> "module:Class"
_BUILTIN: dict[str, str] = {
    "gridimage": "tiderl.envs.gridimage:GridImageEnv",
    "hilo": "tiderl.envs.hilo:HiloEnv",
    "pytool": "tiderl.envs.pytool:PyToolEnv",
    "textworld": "tiderl.envs.textworld_env:TextWorldEnv",
}
_REGISTERED: dict[str, type[Environment]] = {}


class UnknownEnvError(ValueError):
    """No environment of that name; the message lists the known names."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.env_name = name
        self.known = known
        super().__init__(f"unknown environment {name!r} (known environments: {', '.join(known)})")


class EnvUnavailableError(RuntimeError):
    """The environment exists but cannot be loaded here (e.g. its package is not installed)."""


def env_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def register_env(name: str, cls: type[Environment]) -> None:
    """Make `cls` available under `name` (replaces an earlier registration of that name)."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"register_env({name!r}): {cls!r} is not an Environment subclass")
    _REGISTERED[name] = cls


def env_class(name: str) -> type[Environment]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise UnknownEnvError(name, env_names())
    module_name, _, class_name = _BUILTIN[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvUnavailableError(f"environment {name!r} cannot be loaded: {e}") from e
    return getattr(module, class_name)


def make_env(name: str) -> Environment:
    """A fresh, not yet reset environment of that name; `UnknownEnvError` on an unknown name."""
    return env_class(name)()
