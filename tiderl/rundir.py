"""Creating and opening run directories (validated config first: a bad config creates nothing)."""

from __future__ import annotations

import time
from pathlib import Path

from tiderl.config import ConfigError, JobConfig, dump_job
from tiderl.envs.base import EnvOptionError
from tiderl.envs.images import ImageEnvironment
from tiderl.envs.registry import UnknownEnvError, env_class
from tiderl.paths import RunPaths, atomic_write_text
from tiderl.rollout.chat import ImageTokens
from tiderl.store import RunStore, StoreError
from tiderl.store.engine import StoreCorruptError
from tiderl.store.location import POINTER_FILE


class RunDirError(RuntimeError):
    """A run directory cannot be created or opened; the message names it."""


def default_run_dir(config: JobConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(config.launch.runs_dir) / f"{config.name}-{stamp}"


def create_run(config: JobConfig, run_dir: Path | None = None) -> tuple[RunPaths, RunStore]:
    """Make the run directory, save the resolved config, create the run store."""
    _check_env_options(config)
    _check_image_model(config)
    _check_engine(config)
    paths = RunPaths(Path(run_dir) if run_dir is not None else default_run_dir(config))
    if paths.db.exists() or paths.config.exists():
        raise RunDirError(f"{paths.root}: already holds a run (resume it instead, or pick another --run-dir)")
    paths.create()
    resolved = dump_job(config)
    atomic_write_text(paths.config, resolved)
    store = RunStore.for_run_dir(paths.root, config.store)
    store.create_schema()
    store.init_run(name=config.name, system=config.system, config_yaml=resolved)
    return paths, store


def _check_env_options(config: JobConfig) -> None:
    """`env.options` that the environment does not take (an unknown key, a wrong type) are a config
    error, found before anything is created rather than at the first episode of a started run."""
    try:
        env_class(config.env.name).check_options(config.env.options)
    except UnknownEnvError:
        return  # served by an outside env server: it checks its options itself
    except EnvOptionError as e:
        raise ConfigError(f"job {config.name!r}", "env.options", str(e)) from None


def _check_engine(config: JobConfig) -> None:
    """An engine factory that cannot be loaded here would fail every rollout rank: a config error first."""
    if config.rollout.engine == "vllm":
        return
    from tiderl.rollout.from_config import engine_factory

    try:
        engine_factory(config.rollout.engine)
    except ValueError as e:
        raise ConfigError(f"job {config.name!r}", "rollout.engine", str(e)) from None


def _check_image_model(config: JobConfig) -> None:
    """An image environment needs a vision-language model: a tiny one built for an image environment
    (`model.init_env`), or a `model.path` with an image processor. Checked before anything is created."""
    try:
        if not issubclass(env_class(config.env.name), ImageEnvironment):
            return
    except UnknownEnvError:
        return  # served by an outside env server: its answers are checked as they come
    m = config.model
    if m.path is None:
        try:
            vision = issubclass(env_class(m.init_env), ImageEnvironment)
        except UnknownEnvError:
            return  # the model's own check names it
        if not vision:
            raise ConfigError(f"job {config.name!r}", "model.init_env",
                              f"{m.init_env} builds a text model, and env.name {config.env.name} answers with "
                              f"images: set model.init_env: {config.env.name} (a tiny vision-language model) or "
                              "model.path to a vision-language model")
    elif Path(m.path).is_dir() and ImageTokens.of_model(m.path) is None:
        raise ConfigError(f"job {config.name!r}", "model.path",
                          f"{m.path} has no image processor config, and env.name {config.env.name} answers with "
                          "images: give a vision-language model (Qwen2-VL family)")


def open_run(run_dir: Path, *, read_only: bool = False) -> tuple[RunPaths, RunStore]:
    """Open an existing run directory's store: read/write, or `read_only` for the commands that only
    look (status, report, logs), which then also work on a run directory one may only read."""
    paths = RunPaths(Path(run_dir))
    if not paths.db.exists() and not (paths.root / POINTER_FILE).is_file():
        raise RunDirError(f"{paths.root}: no run store (expected {paths.db}, or {POINTER_FILE} naming a database)")
    store = RunStore.for_run_dir(paths.root, read_only=read_only)
    try:
        if not read_only:
            store.upgrade_schema()  # a run made by an earlier TideRL
        store.run_info()
    except StoreCorruptError as e:
        store.close()
        raise RunDirError(f"{store.label if store.sqlite_path is None else paths.db} is corrupt: "
                          f"{e.__cause__ or e}") from e
    except StoreError as e:
        store.close()
        raise RunDirError(f"{paths.root}: {e}") from e
    return paths, store
