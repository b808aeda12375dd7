"""Environment registry: name -> class, and the factory `make_env`.

An environment name is one of:
- a built-in (`_BUILTIN`) or a class given to `register_env(name, cls)` in this process;
- an entry point of an installed package in the group `tiderl.envs` (its name -> `module:Class`), e.g. in
  that package's pyproject.toml: `[project.entry-points."tiderl.envs"] countdown = "mypkg.envs:CountdownEnv"`;
- an import path `module:Class` (e.g. `mypkg.envs:CountdownEnv`), importable where the server runs.

Every class found so must subclass `Environment`; its options go through the same check as the built-ins'
(`Environment.check_options`). Built-ins and entry points are imported lazily (the tool-use and TextWorld
ones pull in heavy packages), so importing this module is cheap.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

from tiderl.envs.base import Environment

ENTRY_POINT_GROUP = "tiderl.envs"

# name -> "module:Class"
_BUILTIN: dict[str, str] = {
    "gridimage": "tiderl.envs.gridimage:GridImageEnv",
    "hilo": "tiderl.envs.hilo:HiloEnv",
    "pytool": "tiderl.envs.pytool:PyToolEnv",
    "textworld": "tiderl.envs.textworld_env:TextWorldEnv",
}
_REGISTERED: dict[str, type[Environment]] = {}


class UnknownEnvError(ValueError):
    """No environment of that name; the message says where it was looked for and lists the known names."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.env_name = name
        self.known = known
        super().__init__(
            f"unknown environment {name!r}: not a built-in or registered one, not an entry point of group "
            f"{ENTRY_POINT_GROUP!r}, and not an import path `module:Class` (known environments: {', '.join(known)})")


class EnvUnavailableError(RuntimeError):
    """The environment is named, but cannot be loaded here (its package is not installed, the import path
    names no class, the class is not an `Environment`)."""


def is_import_path(name: str) -> bool:
    """Whether `name` has the form `module:Class` (whether that imports is another matter)."""
    # The config's rule, imported here, not at the top: the sandbox's code imports this package with nothing
    # but the standard library (no PyYAML, which the config package needs).
    from tiderl.config.env import IMPORT_PATH

    return bool(IMPORT_PATH.match(name))


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def env_names() -> list[str]:
    """Built-in, registered and entry-point names (import paths are open-ended and not listed)."""
    return sorted(set(_BUILTIN) | set(_REGISTERED) | set(_entry_points()))


def register_env(name: str, cls: type[Environment]) -> None:
    """Make `cls` available under `name` (replaces an earlier registration of that name)."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"register_env({name!r}): {cls!r} is not an Environment subclass")
    _REGISTERED[name] = cls


def _import(target: str, what: str) -> type[Environment]:
    """The class at `module:Class`; `what` names where the path came from, for the error."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvUnavailableError(f"{what}: cannot import module {module_name!r}: {e}") from e
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EnvUnavailableError(f"{what}: module {module_name!r} has no {qualname!r}") from None
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise EnvUnavailableError(f"{what}: {target} is {obj!r}, not a subclass of tiderl.envs.Environment")
    return obj


def env_class(name: str) -> type[Environment]:
    """The class of environment `name`: `UnknownEnvError` when no source has it, `EnvUnavailableError` when
    the source names it but it does not load."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        return _import(_BUILTIN[name], f"environment {name!r}")
    found = _entry_points().get(name)
    if found is not None:
        return _import(found.value, f"environment {name!r} (entry point of group {ENTRY_POINT_GROUP!r})")
    if is_import_path(name):
        return _import(name, f"environment {name!r}")
    raise UnknownEnvError(name, env_names())


def make_env(name: str) -> Environment:
    """A fresh, not yet reset environment of that name; `UnknownEnvError` on an unknown name."""
    return env_class(name)()
