"""What every role loop of a rank needs: the config, the run dir, the store and the boundary test."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.config import JobConfig, load_job
from tiderl.paths import RunPaths, atomic_write_text
from tiderl.run.bell import Bell
from tiderl.systems import SystemBehaviour, behaviour
from tiderl.store import PlanRecord, RunStore

if TYPE_CHECKING:  # the mechanisms a rank builds on first use (torch, vLLM): not imported to open a context
    from tiderl.rollout.chat import ChatFormat
    from tiderl.rollout.engine import Engine
    from tiderl.rollout.local_env import EnvLink
    from tiderl.weightsync.server import WeightServer
    from tiderl.trainer.group import HeldGroup
    from tiderl.trainer.rank import ActorRank, RefRank

MODEL_FILE = "model_dir.txt"


class RunStopped(Exception):
    """The run reached a terminal state (finished, failed, cancelled): the rank winds down."""


def write_run_files(paths: RunPaths, model_dir: Path, env_urls: list[str]) -> None:
    """What the launcher hands every rank besides the config: the model and the env servers."""
    atomic_write_text(paths.root / MODEL_FILE, str(model_dir))
    atomic_write_text(paths.env_urls, json.dumps(env_urls))


@dataclass
class RankContext:
    rank: int
    config: JobConfig
    paths: RunPaths
    store: RunStore
    system: SystemBehaviour
    model_dir: Path
    env_urls: list[str]
    poll_s: float = 0.2
    # Long-lived mechanisms, built on a role's first use and kept across role changes (a test may set
    # them beforehand: a fake engine, a local environment).
    bells: dict[str, Bell] = field(default_factory=dict, repr=False)
    """This rank's views of the run's bells, by name (`bell`)."""
    engine: Engine | None = None
    """The rollout role's engine (tiderl.run.rollout_role)."""
    chat: ChatFormat | None = None
    pool: EnvLink | None = None
    """The rollout role's link to the environment servers."""
    actor: ActorRank | None = None
    """The actor role's model and optimizer (tiderl.run.trainer_role)."""
    ref: RefRank | None = None
    weight_server: "WeightServer | None" = None
    """The trainer leader's weight server (tiderl.run.weights.stage_for_transfer), kept while it leads."""
    trainer_group: "HeldGroup | None" = None
    """The trainer process group this rank is in, kept while the next version's layout is the same
    (tiderl.run.trainer_role._in_group)."""

    def bell(self, name: str) -> Bell:
        """This rank's view of the run's bell `name` (tiderl.run.bell), kept for the rank's life."""
        if name not in self.bells:
            self.bells[name] = Bell(self.paths.bell(name))
        return self.bells[name]

    @classmethod
    def open(cls, run_dir: Path, rank: int) -> "RankContext":
        paths = RunPaths(Path(run_dir))
        config = load_job(paths.config)
        store = RunStore.for_run_dir(paths.root, config.store)
        system = behaviour(config.system, max_staleness=config.rollout.max_staleness,
                           ra2p_mode=config.trainer.ra2p_mode)
        return cls(rank=rank, config=config, paths=paths, store=store, system=system,
                   model_dir=Path((paths.root / MODEL_FILE).read_text().strip()),
                   env_urls=json.loads(paths.env_urls.read_text()))

    def weights_dir(self, version: int) -> Path:
        return self.model_dir if version == 0 else self.paths.weights_version(version)

    def position(self) -> int:
        """The last published version; raises RunStopped once the run is over."""
        state, version = self.store.position()
        if state.is_terminal:
            raise RunStopped(state.value)
        return version

    async def wait_plan(self, version: int, timeout_s: float = 600.0) -> PlanRecord:
        """The plan of `version`, once the control plane wrote it (the rank's heartbeat thread beats meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            plan = self.store.plan_at(version)
            if plan is not None:
                return plan
            self.position()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: no plan for version {version} after {timeout_s:.0f} s")
            await self.bell("planned").wait_async(self.poll_s)

    def boundary(self, version: int) -> PlanRecord | None:
        """The plan of the next version once it is published and planned, else None."""
        current = self.position()
        if current <= version:
            return None
        return self.store.plan_at(current)
