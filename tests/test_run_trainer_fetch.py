"""The trainer's fetch size (tiderl.run.trainer_role._fetch) against a real run store."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tiderl.config import load_job
from tiderl.rundir import create_run
from tiderl.systems import behaviour
from tiderl.run.trainer_role import _fetch
from tiderl.store.types import NewGroup, PlanRecord, Role, TaskKind

ROOT = Path(__file__).resolve().parents[1]


def test_the_last_step_takes_every_open_or_ready_group_up_to_a_full_batch(tmp_path: Path) -> None:
    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["trainer.num_steps=5", "trainer.groups_min=2",
                                                          "trainer.groups_ideal=4"])
    _, store = create_run(config, tmp_path / "run")
    ctx = SimpleNamespace(config=config, store=store,
                          system=behaviour("tiderl", max_staleness=1, ra2p_mode=config.trainer.ra2p_mode))
    store.add_groups([NewGroup(TaskKind.TRAIN, seed, 8) for seed in range(3)])  # three groups fed, not trained

    def plan(version: int, fetch: int) -> PlanRecord:
        return PlanRecord(version=version, roles={0: Role.ACTOR}, ra2p_mode="colocated", fetch_groups=fetch)

    assert _fetch(ctx, plan(2, 2)) == 2  # an elastic step mid-run takes what ERS says
    assert _fetch(ctx, plan(4, 2)) == 3  # the last step takes the three groups fed for the run
    store.add_groups([NewGroup(TaskKind.TRAIN, seed, 8) for seed in range(3, 6)])
    assert _fetch(ctx, plan(4, 2)) == 4  # never more than a full batch
    assert _fetch(ctx, plan(4, 9)) == 4
