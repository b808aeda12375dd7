"""A Slurm task's supervisor: a rollout rank that dies is quarantined and run again; an actor is not."""

from __future__ import annotations

import sys
from pathlib import Path

from tiderl.config import load_job
from tiderl.run.supervise import GENERATION_POLL_S, restartable, supervise
from tiderl.rundir import create_run
from tiderl.store.types import ClaimRequest, NewGroup, RankReport, Role, RunState, TaskKind, TrainerGeneration

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


def test_past_the_limit_the_task_ends_with_the_ranks_code(tmp_path: Path) -> None:
    _run(tmp_path / "a", Role.ROLLOUT)
    assert supervise(tmp_path / "a" / "run", 1, child_argv=_child(tmp_path / "a", 5), limit=2, poll_s=0.01) == 9
    assert (tmp_path / "a" / "runs").read_text() == "3"
    # An actor restarts with its trainer group (here itself alone), each time in a new generation.
    store = _run(tmp_path / "b", Role.ACTOR)
    assert supervise(tmp_path / "b" / "run", 1, child_argv=_child(tmp_path / "b", 5), limit=2, poll_s=0.01) == 9
    assert (tmp_path / "b" / "runs").read_text() == "3"
    assert store.trainer_generation() == TrainerGeneration(2, (1,))
    assert len(store.recent_events(50, kinds=["trainer_restarted"])) == 2


def _sleeper(tmp_path: Path, rank: int) -> list[str]:
    """A stand-in rank that records each start (its pid) and runs until it is stopped."""
    script = (f"import os, pathlib, time; d = pathlib.Path({str(tmp_path)!r}); "
              f"(d / f'rank{rank}.{{os.getpid()}}').write_text(''); time.sleep(300)")
    return [sys.executable, "-c", script]


def _starts(tmp_path: Path, rank: int) -> list[int]:
    return sorted(int(p.name.split(".")[1]) for p in tmp_path.glob(f"rank{rank}.*"))


def test_an_actor_that_dies_restarts_its_trainer_group_across_the_slurm_tasks(tmp_path: Path) -> None:
    """Three tasks' supervisors, each in its own process as under srun: the actor's rank dies; its supervisor
    moves the trainer group to a new generation, the ref's supervisor stops and restarts its rank, the
    rollout rank runs on untouched."""
    import os
    import signal
    import subprocess
    import time

    _, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "run")
    store.register_initial_version("model", "0")
    for rank, role in [(0, Role.ACTOR), (1, Role.REF), (2, Role.ROLLOUT)]:
        store.register_rank(rank, role, pid=10_000 + rank)
    store.set_run_state(RunState.RUNNING)
    tasks = {rank: subprocess.Popen([sys.executable, "-c",
                                     "import sys; from tiderl.run.supervise import supervise; "
                                     f"sys.exit(supervise(__import__('pathlib').Path({str(tmp_path / 'run')!r}), "
                                     f"{rank}, child_argv={_sleeper(tmp_path, rank)!r}, limit=1, poll_s=0.05))"],
                                    cwd=ROOT)
             for rank in range(3)}

    def wait(what: str, check, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
            time.sleep(0.1)

    try:
        wait("every rank started", lambda: all(len(_starts(tmp_path, r)) == 1 for r in range(3)))
        first = {r: _starts(tmp_path, r)[0] for r in range(3)}
        os.kill(first[0], signal.SIGKILL)  # the actor dies inside a step
        wait("the actor and the ref started again", lambda: all(len(_starts(tmp_path, r)) == 2 for r in (0, 1)))
        time.sleep(2 * GENERATION_POLL_S + 1)
        assert _starts(tmp_path, 2) == [first[2]] and tasks[2].poll() is None  # the rollout rank ran on
        assert store.trainer_generation() == TrainerGeneration(1, (0, 1))
        events = store.recent_events(50, kinds=["trainer_restarted"])
        assert len(events) == 1 and events[0]["rank"] == 0
        assert all(t.poll() is None for t in tasks.values())
        # Past launch.restarts (1 here) a second death ends its task with the rank's code.
        os.kill(next(p for p in _starts(tmp_path, 1) if p != first[1]), signal.SIGKILL)
        assert tasks[1].wait(30) == -signal.SIGKILL % 256  # sys.exit of the rank's -9
        assert store.trainer_generation().number == 1
    finally:
        for t in tasks.values():
            if t.poll() is None:
                t.send_signal(signal.SIGTERM)
        for t in tasks.values():
            t.wait(30)


def test_restart_policy() -> None:
    assert restartable("rank3", Role.ROLLOUT, 0, 3) and not restartable("rank3", Role.ROLLOUT, 3, 3)
    assert not restartable("rank3", Role.ACTOR, 0, 3) and not restartable("rank3", Role.REF, 0, 3)
    assert restartable("control", None, 2, 3) and restartable("env1", None, 0, 3)
    assert not restartable("ranks", None, 0, 3)  # the srun step as a whole: its tasks supervise themselves
