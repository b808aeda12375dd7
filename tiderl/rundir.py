"""Creating and opening run directories (validated config first: a bad config creates nothing)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from tiderl.config import ConfigError, JobConfig, dump_job
from tiderl.config.job import RUN_NAME_RULE, run_name_problem
from tiderl.envs.base import EnvOptionError
from tiderl.envs.images import ImageEnvironment
from tiderl.envs.registry import EnvUnavailableError, UnknownEnvError, env_class
from tiderl.paths import RunPaths, atomic_write_text, private_dir
from tiderl.rollout.chat import ImageTokens
from tiderl.store import RunStore, StoreError
from tiderl.store.engine import NoRunError, StoreCorruptError, corrupt_line
from tiderl.store.location import POINTER_FILE


class RunDirError(RuntimeError):
    """A run directory cannot be created or opened; the message names it."""


def check_run_name(name: str, source: str = "job") -> None:
    """A run's name becomes a directory under `launch.runs_dir` (and a Slurm job name): one plain path
    component, so that no name can put a run anywhere else. ConfigError naming it otherwise."""
    problem = run_name_problem(name)
    if problem:
        raise ConfigError(source, "name", f"{name!r} {problem}: {RUN_NAME_RULE}")


def default_run_dir(config: JobConfig) -> Path:
    check_run_name(config.name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(config.launch.runs_dir) / f"{config.name}-{stamp}"


def make_private(paths: RunPaths) -> None:
    """The run's own directories 0700 and its top-level files 0600, where this user owns them: what the run
    directory holds (the store, logs, config, weights, checkpoints, the env token) is its user's alone."""
    for d in (paths.root, paths.weights, paths.ckpt, paths.logs):
        if d.is_dir():
            private_dir(d)
    for f in (paths.db, paths.db.with_name("run.db-wal"), paths.db.with_name("run.db-shm"), paths.config):
        try:
            if f.is_file() and f.stat().st_uid == os.geteuid():
                f.chmod(0o600)
        except OSError:
            pass  # a run directory one may only read: nothing of it is ours to change


def create_run(config: JobConfig, run_dir: Path | None = None) -> tuple[RunPaths, RunStore]:
    """Make the run directory, save the resolved config, create the run store. Everything is checked
    first (`check_config`: the run's name, env options, the image model, the engine; the callers run
    `validate_job`, which adds the model's pre-flight checks): a bad config creates nothing.

    The run's directories are 0700 and its files 0600 whatever the umask; the processes of the run (the
    launcher, `tiderl submit`, the control plane, the ranks) take the private umask at their start
    (`tiderl.paths.use_private_umask`), so what they and their children write later is private too."""
    check_config(config)
    paths = RunPaths(Path(run_dir) if run_dir is not None else default_run_dir(config))
    if paths.db.exists() or paths.config.exists():
        raise RunDirError(f"{paths.root}: already holds a run (resume it instead, or pick another --run-dir)")
    paths.create()
    make_private(paths)  # a --run-dir that existed already keeps no wider mode
    resolved = dump_job(config)
    atomic_write_text(paths.config, resolved)
    store = RunStore.for_run_dir(paths.root, config.store)
    store.create_schema()
    store.init_run(name=config.name, system=config.system, config_yaml=resolved)
    make_private(paths)
    return paths, store


def check_config(config: JobConfig) -> None:
    """The checks of a loaded config that need no model: the run's name, `env.options` against the
    environment, an image environment's model, the rollout engine. ConfigError at the first problem."""
    check_run_name(config.name)
    _check_env_options(config)
    _check_image_model(config)
    _check_engine(config)


def validate_job(config: JobConfig) -> str | None:
    """The one check of a job that `tiderl config`, `tiderl submit` (`--dry-run` too), `tiderl run` and
    `tiderl run --resume` (on the config merged with its `--set` overrides) make before anything is created,
    queued or changed, so that they accept and refuse the same configs: `check_config`, then the model and
    trainer backend (`tiderl.models.preflight.check_job`). ConfigError at the first problem (exit 2); returns
    the ranks' memory plan as `#` comment lines (None with `model.path: null`)."""
    from tiderl.models.preflight import check_job

    check_config(config)
    return check_job(config)


def _check_env_options(config: JobConfig) -> None:
    """`env.options` that the environment does not take (an unknown key, a wrong type) are a config
    error, found before anything is created rather than at the first episode of a started run."""
    try:
        env_class(config.env.name).check_options(config.env.options)
    except UnknownEnvError:
        return  # served by an outside env server: it checks its options itself
    except EnvUnavailableError as e:  # an import path or entry point that does not load here
        if config.env.servers:
            return  # the outside servers may have what this machine lacks
        raise ConfigError(f"job {config.name!r}", "env.name", str(e)) from None
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
    except (UnknownEnvError, EnvUnavailableError):
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
        raise RunDirError(corrupt_line(str(paths.db) if store.sqlite_path is not None else store.label,
                                       e.detail or str(e))) from e
    except NoRunError as e:
        store.close()
        raise RunDirError(f"{paths.root}: {e}; if no run is being created there, this directory holds no run "
                          "to open: create the run again in another directory") from e
    except StoreError as e:
        store.close()
        raise RunDirError(f"{paths.root}: {e}") from e
    if not read_only:
        make_private(paths)  # a run made before run files were private, or copied in with other modes
    return paths, store


def model_checksum(directory: Path) -> str:
    """SHA-256 over the model's `*.safetensors` files, in name order: the checksum the first launch records
    for version 0, the base model (`tiderl.run.launcher`)."""
    h = hashlib.sha256()
    for p in sorted(Path(directory).glob("*.safetensors")):
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def check_base_model(paths: RunPaths, store: RunStore) -> None:
    """Before a run resumes: its base model (version 0) must be the one its first launch checksummed.
    RunDirError naming the model and both checksums otherwise. A run whose first launch stopped before it
    recorded version 0, or whose model directory is gone (the model's own pre-flight check names that),
    has nothing to compare here."""
    from sqlalchemy import select

    from tiderl.store.schema import versions

    row = store.tx.read(lambda c: c.execute(
        select(versions.c.path, versions.c.checksum).where(versions.c.version == 0)).first())
    if row is None or not Path(row.path).is_dir():
        return
    digest = model_checksum(Path(row.path))
    if digest != row.checksum:
        raise RunDirError(f"base model {row.path} (version 0 of {paths.root}): its weights are not the ones the "
                          f"run started from (checksum recorded at the first launch {row.checksum[:16]}, files now "
                          f"{digest[:16]}): a changed or tampered base model is refused; restore the model the "
                          "run started from, or start a new run")
