"""The root of a job config (`jobs/*.yaml`) and its loading from YAML plus --set overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml

from tiderl.config.env import EnvConfig
from tiderl.config.ers import ErsConfig
from tiderl.config.launch import LaunchConfig
from tiderl.config.model import ModelConfig
from tiderl.config.monitor import MonitorConfig
from tiderl.config.rollout import RolloutConfig
from tiderl.config.schema import ConfigError, build, option, section, to_dict
from tiderl.config.slurm import SlurmConfig
from tiderl.config.store import StoreConfig
from tiderl.config.trainer import TrainerConfig
from tiderl.config.yamlio import load_yaml

System = Literal["tiderl", "sync", "async", "stream"]


@section
class JobConfig:
    system: System = option(
        help="Behaviour of the run: `tiderl` (CTB + RA2P + ERS), `sync` (VeRL-like: roll out the "
        "whole batch, then train), `async` (AReaL-like fixed rollout/trainer split), `stream` "
        "(StreamRL-like micro-batch streaming with naive ref/actor alternation)."
    )
    name: str = option("run", help="Run name; the run directory is named after it.")
    seed: int = option(0, ge=0, help="Seed of the task feed, sampling and initial weights.")
    model: ModelConfig = option(default_factory=ModelConfig, help="Policy model.")
    env: EnvConfig = option(default_factory=EnvConfig, help="Environment and env servers.")
    rollout: RolloutConfig = option(default_factory=RolloutConfig, help="Rollout ranks and scheduler.")
    trainer: TrainerConfig = option(default_factory=TrainerConfig, help="GRPO trainer and RA2P.")
    ers: ErsConfig = option(default_factory=ErsConfig, help="Elastic Resource Scaling.")
    launch: LaunchConfig = option(default_factory=LaunchConfig, help="Ranks and liveness.")
    slurm: SlurmConfig = option(default_factory=SlurmConfig, help="Slurm resources for `tiderl submit`.")
    store: StoreConfig = option(default_factory=StoreConfig, help="Run store.")
    monitor: MonitorConfig = option(default_factory=MonitorConfig, help="Run monitoring: stall detection, Prometheus metrics.")

    def __post_init__(self) -> None:
        problem = run_name_problem(self.name)
        if problem:
            raise ValueError(f"name: {self.name!r} {problem}: {RUN_NAME_RULE}")
        if self.trainer.actor_ranks >= self.launch.num_ranks:
            raise ValueError(f"trainer: actor_ranks: must leave a rollout rank of launch.num_ranks "
                             f"({self.launch.num_ranks}), got {self.trainer.actor_ranks}")


RUN_NAME_RULE = "a run's name is one plain file name (letters, digits, '-', '_', '.'), e.g. name: my-run"


def run_name_problem(name: str) -> str | None:
    """What makes `name` unfit to name a run directory under `launch.runs_dir` (and a Slurm job): it must be
    one plain path component, so that no name can put a run anywhere else. None: it is fit."""
    if not name.strip():
        return "is empty"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if ".." in name:
        return "holds '..'"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return "holds a control character"
    if name.startswith((".", "-")):
        return f"starts with {name[0]!r}"
    return None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML: 3 -> int, [x, y] -> list)."""
    source = f"--set {text}"
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(source, "", "expected KEY=VALUE, e.g. trainer.num_steps=3")
    path = key.strip().split(".")
    if any(not part for part in path):
        raise ConfigError(source, key, "empty key segment")
    try:
        value = load_yaml(raw, source) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(source, key, f"value is not valid YAML: {e}") from e
    return path, value


def apply_override(data: dict[str, Any], text: str) -> None:
    path, value = parse_override(text)
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {text}", ".".join(path[: i + 1]), "is not a section")
        node = child
    node[path[-1]] = value


def load_job(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> JobConfig:
    """Load and validate a job file, applying `--set` overrides. Raises ConfigError."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise ConfigError(source, "", "job file not found") from e
    except OSError as e:
        raise ConfigError(source, "", f"cannot read job file: {e.strerror}") from e
    try:
        data = load_yaml(text, source)
    except yaml.YAMLError as e:
        raise ConfigError(source, "", f"not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping of sections at the top level, got {type(data).__name__}")
    keys = {}
    for text_override in overrides:
        apply_override(data, text_override)
        keys[".".join(parse_override(text_override)[0])] = text_override
    try:
        return build(JobConfig, data, source)
    except ConfigError as e:
        # Blame the --set that introduced the bad key rather than the file.
        for key, text_override in keys.items():
            if e.key == key or e.key.startswith(key + ".") or e.key.startswith(key + "["):
                raise ConfigError(f"--set {text_override}", e.key, e.message) from e
        raise


def dump_job(config: JobConfig) -> str:
    """The resolved config as YAML (what is saved in the run directory)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)
