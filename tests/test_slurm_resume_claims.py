"""A requeued Slurm job (or `tiderl run --resume`) gets back every claim of the previous attempt's ranks,
including those of ranks Slurm's SIGTERM stopped cleanly (recorded `stopped`, claims still held)."""

from __future__ import annotations

from pathlib import Path

from tiderl.config import load_job
from tiderl.run.launcher import end_previous_launch
from tiderl.rundir import create_run
from tiderl.store.types import NewGroup, RankState, Role, TaskKind

ROOT = Path(__file__).resolve().parents[1]


def test_claims_of_stopped_and_running_ranks_return_to_the_pool(tmp_path: Path) -> None:
    paths, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "run")
    try:
        store.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.TRAIN, 2, 2)])
        store.register_rank(1, Role.ROLLOUT)
        store.register_rank(2, Role.ROLLOUT)
        assert len(store.claim_tasks(1, 2)) == 2 and len(store.claim_tasks(2, 2)) == 2
        store.set_rank_state(1, RankState.STOPPED)  # left through its SIGTERM handler
        assert store.buffer_state().tasks_running == 4
        end_previous_launch(store, paths)
        assert store.buffer_state().tasks_running == 0
        assert store.buffer_state().tasks_pending == 4
        assert {r.rank: r.state for r in store.ranks()} == {1: "dead", 2: "dead"}
        # The next launch's rank 1 claims them afresh.
        store.register_rank(1, Role.ROLLOUT)
        assert len(store.claim_tasks(1, 4)) == 4
    finally:
        store.close()
