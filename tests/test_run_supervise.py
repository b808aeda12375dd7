"""A Slurm task's supervisor: a rollout rank that dies is quarantined and run again; an actor is not."""

from __future__ import annotations

import sys
from pathlib import Path

from tiderl.config import load_job
from tiderl.run.supervise import restartable, supervise
from tiderl.rundir import create_run
from tiderl.store.types import ClaimRequest, NewGroup, RankReport, Role, RunState, TaskKind

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, role: Role):
    _, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "run")
    store.register_initial_version("model", "0")
    store.register_rank(1, role)
    store.set_run_state(RunState.RUNNING)
    store.add_groups([NewGroup(TaskKind.TRAIN, 7, 2)])
    if role is Role.ROLLOUT:
        assert len(store.report(RankReport(rank=1, role=role, claim=ClaimRequest(limit=2)))["claims"]) == 2
    return store


def _child(tmp_path: Path, fail_times: int) -> list[str]:
    """A stand-in rank: dies with 9 the first `fail_times` runs, then exits 0; counts its runs."""
    counter = tmp_path / "runs"
    script = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = int(p.read_text() or 0) + 1 "
              f"if p.exists() else 1; p.write_text(str(n)); sys.exit(9 if n <= {fail_times} else 0)")
    return [sys.executable, "-c", script]


def test_a_rollout_rank_is_restarted_in_its_task_until_it_ends_well(tmp_path: Path) -> None:
    store = _run(tmp_path, Role.ROLLOUT)
    assert supervise(tmp_path / "run", 1, child_argv=_child(tmp_path, 2), limit=3, poll_s=0.01) == 0
    assert (tmp_path / "runs").read_text() == "3"
    assert store.buffer_state().tasks_running == 0  # its claims went back to the pool
    events = store.recent_events(50, kinds=["restarted"])
    assert len(events) == 2 and all(e["rank"] == 1 for e in events)


def test_past_the_limit_or_as_actor_the_task_ends_with_the_ranks_code(tmp_path: Path) -> None:
    _run(tmp_path / "a", Role.ROLLOUT)
    assert supervise(tmp_path / "a" / "run", 1, child_argv=_child(tmp_path / "a", 5), limit=2, poll_s=0.01) == 9
    assert (tmp_path / "a" / "runs").read_text() == "3"
    _run(tmp_path / "b", Role.ACTOR)
    assert supervise(tmp_path / "b" / "run", 1, child_argv=_child(tmp_path / "b", 5), limit=2, poll_s=0.01) == 9
    assert (tmp_path / "b" / "runs").read_text() == "1"


def test_restart_policy() -> None:
    assert restartable("rank3", Role.ROLLOUT, 0, 3) and not restartable("rank3", Role.ROLLOUT, 3, 3)
    assert not restartable("rank3", Role.ACTOR, 0, 3) and not restartable("rank3", Role.REF, 0, 3)
    assert restartable("control", None, 2, 3) and restartable("env1", None, 0, 3)
    assert not restartable("ranks", None, 0, 3)  # the srun step as a whole: its tasks supervise themselves
