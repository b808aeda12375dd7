"""TensorBoard event files from the run store (tiderl.observe.tboard), read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tiderl.config import load_job
from tiderl.rundir import create_run
from tiderl.store import (FinishedTrajectory, MetricPoint, NewGroup, RankReport, TaskKind, VersionRecord)
from tiderl.store.types import Role, RunState
from tiderl.observe.tboard import TensorBoardLog

ROOT = Path(__file__).resolve().parents[1]


def _step(s, version: int) -> None:
    s.add_groups([NewGroup(TaskKind.TRAIN, version, 2)])
    claims = s.claim_tasks(1, 2)
    s.report(RankReport(rank=1, finished=[
        FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1],
                           logprobs=[0, -1, -1, -1], token_versions=[-1, 0, 0, 0], num_turns=1 + 2 * i,
                           reward=float(i), success=bool(i), env=("hilo", "pytool")[i]) for i, c in enumerate(claims)],
        metrics=[MetricPoint("rwt_s", 1.5, version - 1, "rollout")]))
    got = s.claim_ready_groups(0, 4)
    s.publish_version(VersionRecord(version=version, path=f"weights/v{version}", checksum="c",
                                    trajectory_ids=[t.id for t in got], step_started_at=0.0, duration_s=2.0,
                                    ras=1, tprm_s=0.5, ra2p_mode="colocated"), owner=0)
    s.report(RankReport(rank=0, metrics=[MetricPoint("clip_frac", 0.25 * version, version - 1, "actor"),
                                         MetricPoint("entropy", 1.5, version - 1, "actor")]))
    s.plan_roles(version, {0: Role.ACTOR, 1: Role.ROLLOUT, 2: Role.IDLE})


def _running(config, tmp_path: Path):
    """A running run of `config`: version 0, an actor, a rollout rank and an idle one."""
    paths, s = create_run(config, tmp_path / "r")
    s.register_initial_version("weights/v0", "c0")
    s.register_rank(0, Role.ACTOR)
    s.register_rank(1, Role.ROLLOUT)
    s.plan_roles(0, {0: Role.ACTOR, 1: Role.ROLLOUT, 2: Role.IDLE})
    s.set_run_state(RunState.RUNNING)
    return paths, s


def _scalars(d: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(d))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_per_step_scalars_are_written_once_and_a_restart_carries_on(tmp_path: Path) -> None:
    paths, s = _running(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path)
    _step(s, 1)
    board = TensorBoardLog(paths.root, s, interval_s=0.0, eval_tasks=1)
    board.close()
    d = paths.root / "tensorboard"
    assert _scalars(d, "train/success_rate") == [(1, 0.5)]
    assert _scalars(d, "trainer/clip_frac") == [(1, 0.25)]
    assert _scalars(d, "roles/idle") == [(1, 1.0)] and _scalars(d, "wait/rwt_s") == [(1, 1.5)]
    assert _scalars(d, "trainer/entropy") == [(1, 1.5)]
    # Turns per task (1 and 3), and each environment's share of the step (one trajectory each here).
    assert _scalars(d, "train/turns_mean") == [(1, 2.0)] and _scalars(d, "train/turns_max") == [(1, 3.0)]
    assert _scalars(d, "train/reward_mean/hilo") == [(1, 0.0)] and _scalars(d, "train/success_rate/hilo") == [(1, 0.0)]
    assert _scalars(d, "train/reward_mean/pytool") == [(1, 1.0)]
    assert _scalars(d, "train/success_rate/pytool") == [(1, 1.0)]
    # A restarted control plane writes only what is new.
    _step(s, 2)
    again = TensorBoardLog(paths.root, s, interval_s=0.0, eval_tasks=1)
    again.close()
    assert _scalars(d, "train/success_rate") == [(1, 0.5), (2, 0.5)]
    assert _scalars(d, "trainer/clip_frac") == [(1, 0.25), (2, 0.5)]
    assert _scalars(d, "train/success_rate/pytool") == [(1, 1.0), (2, 1.0)]
    assert _scalars(d, "wait/rwt_s") == [(1, 1.5), (2, 3.0)]


def test_a_full_disk_skips_a_write_and_the_next_tick_catches_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer lives in the control plane: ENOSPC from it once ended the control plane (fault campaign,
    full disk). It warns, and the next tick writes what this one could not."""
    import errno

    import tiderl.observe.tboard

    paths, s = _running(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path)
    _step(s, 1)
    written = tiderl.observe.tboard.atomic_write_text

    def full(*args, **kwargs) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiderl.observe.tboard, "atomic_write_text", full)
    board = TensorBoardLog(paths.root, s, interval_s=0.0, eval_tasks=1)
    board.tick(force=True)  # no exception
    assert not (paths.root / "tensorboard" / "written.json").exists()
    monkeypatch.setattr(tiderl.observe.tboard, "atomic_write_text", written)
    _step(s, 2)
    board.close()
    assert (paths.root / "tensorboard" / "written.json").exists()
    assert _scalars(paths.root / "tensorboard", "train/success_rate") == [(1, 0.5), (2, 0.5)]

    def other(*args, **kwargs) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tiderl.observe.tboard, "atomic_write_text", other)
    again = TensorBoardLog(paths.root, s, interval_s=0.0, eval_tasks=1)
    _step(s, 3)
    with pytest.raises(PermissionError):  # any other error still raises
        again.tick(force=True)


class _FakeWandbRun:
    """A stand-in for a wandb run (the wandb package is not a dependency): records what it is given."""

    def __init__(self, **kwargs) -> None:
        self.init = kwargs
        self.defined: list[tuple[str, str | None]] = []
        self.logged: list[dict] = []
        self.finished = False

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.defined.append((name, step_metric))

    def log(self, data: dict) -> None:
        self.logged.append(data)

    def finish(self) -> None:
        self.finished = True


def _fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[_FakeWandbRun]:
    import importlib.machinery
    import sys
    import types

    runs: list[_FakeWandbRun] = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = lambda **kw: runs.append(_FakeWandbRun(**kw)) or runs[-1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_wandb_gets_the_same_scalars_offline_against_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _fake_wandb(monkeypatch)
    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["monitor.wandb=true", "monitor.tensorboard=false"])
    paths, s = _running(config, tmp_path)
    _step(s, 1)
    board = TensorBoardLog.start(paths.root, s, config)
    assert board is not None
    board.close()
    (run,) = runs
    assert run.init["mode"] == "offline" and run.init["dir"] == str(paths.root) and run.init["name"] == "quickstart"
    assert ("*", "version") in run.defined and run.finished
    assert {"train/success_rate": 0.5, "version": 1} in run.logged
    assert {"trainer/clip_frac": 0.25, "version": 1} in run.logged
    assert {"trainer/entropy": 1.5, "version": 1} in run.logged
    assert {"train/turns_mean": 2.0, "version": 1} in run.logged
    assert {"train/reward_mean/pytool": 1.0, "version": 1} in run.logged
    assert not _scalars(paths.root / "tensorboard", "train/success_rate")  # TensorBoard off: no event file
    # Asked for but not installed: a warning, and no writer at all when TensorBoard is off too.
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert TensorBoardLog.start(paths.root, s, config) is None
