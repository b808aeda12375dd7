"""Extending a run and overrides on resume (issue 49, item 2): `tiderl run --resume RUN --set KEY=VALUE` either
applies to every process of the run (RUN_DIR/config.yaml, which the control plane and the ranks load, rewritten
before any of them starts, and a `config_changed` event in the store) or is refused with a reason (exit 2, nothing
changed); `--set trainer.num_steps=N` extends a finished run from its last version to N."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fake_engine import SCRIPTED_ENGINE, scripted_run_env
from run_checks import check_run
from tiderl.config import ConfigError, load_job
from tiderl.config.resume import Change, changes, refusal
from tiderl.run.launcher import apply_changes, prepare
from tiderl.rundir import create_run
from tiderl.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "quickstart.yaml"


def tiderl(*args: str, cache: Path | None = None, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env=scripted_run_env(cache))


def config_events(run_dir: Path) -> list[dict]:
    store = RunStore.for_run_dir(run_dir, read_only=True)
    try:
        return store.recent_events(100, kinds=["config_changed"])
    finally:
        store.close()


@pytest.fixture
def created(tmp_path: Path) -> Path:
    """A run as `tiderl run` creates it, before any process starts."""
    run_dir = tmp_path / "run"
    _, store = create_run(load_job(JOB, ["trainer.num_steps=3"]), run_dir)
    store.close()
    return run_dir


@pytest.mark.parametrize("override,key,reason", [
    ("launch.num_ranks=3", "launch.num_ranks", "the run's plans, roles and trainer groups name its ranks"),
    ("rollout.group_size=6", "rollout.group_size", "the groups in the run's store have this many tasks"),
    ("model.max_context_tokens=333", "model.max_context_tokens", "made with this model, tokenizer and chat format"),
    ("env.options.high=32", "env.options", "made by this environment and its options"),
    ("seed=7", "seed", "the task feed"),
    ("store.journal_mode=delete", "store.journal_mode", "moving it is not a resume"),
])
def test_an_override_the_run_was_made_with_is_refused_and_nothing_changes(created: Path, override: str, key: str,
                                                                          reason: str) -> None:
    before = (created / "config.yaml").read_bytes()
    # An allowed override beside it is not applied either: never half applied.
    out = tiderl("run", "--resume", str(created), "--set", "trainer.num_steps=9", "--set", override, timeout_s=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--set {override}: {key}: cannot change on resume" in out.stderr and reason in out.stderr, out.stderr
    assert "nothing was changed" in out.stderr
    assert (created / "config.yaml").read_bytes() == before
    assert not config_events(created)
    assert not (created / "logs" / "control.log").exists()  # no process started


def test_a_bad_value_on_resume_is_the_same_config_error_as_anywhere(created: Path) -> None:
    before = (created / "config.yaml").read_bytes()
    out = tiderl("run", "--resume", str(created), "--set", "monitor.tensorboard=yes", timeout_s=300)
    assert out.returncode == 2 and "write true or false" in out.stderr, out.stderr[-2000:]
    assert (created / "config.yaml").read_bytes() == before


def test_an_allowed_override_reaches_the_config_every_process_loads_and_the_store(created: Path) -> None:
    launch = prepare(None, ["trainer.num_steps=6", "monitor.stall_after_s=60", "trainer.lr=5e-5"], None, created)
    try:
        assert [c.key for c in launch.changes] == ["trainer.num_steps", "trainer.lr", "monitor.stall_after_s"]
        assert yaml.safe_load((created / "config.yaml").read_text())["trainer"]["num_steps"] == 3  # not yet
        apply_changes(launch, 0, reopen=False)
        saved = load_job(created / "config.yaml")  # what the control plane and the ranks load
        assert (saved.trainer.num_steps, saved.trainer.lr, saved.monitor.stall_after_s) == (6, 5e-5, 60.0)
        assert launch.store.run_info().config_yaml == (created / "config.yaml").read_text()
    finally:
        launch.store.close()
    [event] = config_events(created)
    assert "trainer.num_steps: 3 -> 6" in event["message"] and "monitor.stall_after_s: 900.0 -> 60.0" in event["message"]
    with sqlite3.connect(created / "run.db") as db:
        [(data,)] = db.execute("select data from events where kind = 'config_changed'").fetchall()
    assert {"key": "trainer.lr", "old": 3e-4, "new": 5e-5} in json.loads(data)["changes"]


def test_resume_rules() -> None:
    old = load_job(JOB)
    found = changes(old, load_job(JOB, ["trainer.num_steps=40", "rollout.eval_every_steps=2", "slurm.nodes=2",
                                        "env.options.max_turns=3"]))
    assert [(c.key, refusal(c) is None) for c in found] == [
        ("env.options", False), ("rollout.eval_every_steps", True), ("trainer.num_steps", True),
        ("slurm.nodes", False)]
    assert refusal(Change("monitor.wandb", False, True)) is None
    assert refusal(Change("rollout.max_new_tokens", 16, 32)) is not None  # not on the allow-list: refused
    assert changes(old, load_job(JOB)) == []


@pytest.mark.slow
def test_a_finished_run_is_extended_by_a_resume(tmp_path: Path) -> None:
    """A real short local run (the scripted engine, tests/fake_engine.py) to 3 steps; a resume without an
    override, or with one that does not extend it, leaves it as it is; `--set trainer.num_steps=5` carries it on
    from version 3 to 5 with every process on the new config, exactly once throughout."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    sets = [f"rollout.engine={SCRIPTED_ENGINE}", "model.init_train_steps=5", "trainer.num_steps=3",
            "trainer.groups_min=1", "trainer.groups_ideal=2", "rollout.group_size=4", "rollout.max_concurrency=8",
            "rollout.eval_every_steps=0", "trainer.checkpoint_every=2", "system=async"]
    out = tiderl("run", str(JOB), *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir), cache=cache)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    saved = (run_dir / "config.yaml").read_bytes()

    out = tiderl("run", "--resume", str(run_dir), "--set", "monitor.stall_after_s=60", cache=cache)
    assert out.returncode == 0 and "nothing to resume (the --set overrides were not applied)" in out.stderr
    out = tiderl("run", "--resume", str(run_dir), "--set", "trainer.num_steps=2", cache=cache)
    assert out.returncode == 2 and "has published version 3 already" in out.stderr, out.stderr[-2000:]
    assert (run_dir / "config.yaml").read_bytes() == saved and not config_events(run_dir)

    out = tiderl("run", "--resume", str(run_dir), "--set", "trainer.num_steps=5", "--set",
                 "rollout.eval_every_steps=5", cache=cache)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "extending" in out.stderr and "trainer.num_steps: 3 -> 5" in out.stderr
    status = json.loads(tiderl("status", str(run_dir), "--json").stdout)
    assert status["state"] == "finished" and status["version"] == 5
    assert load_job(run_dir / "config.yaml").trainer.num_steps == 5
    [event] = config_events(run_dir)
    assert "trainer.num_steps: 3 -> 5" in event["message"] and "rollout.eval_every_steps: 0 -> 5" in event["message"]
    facts = check_run(run_dir, max_staleness=1)
    assert facts["versions"] == 5
    # The evaluation cadence the override set: version 5 was evaluated (the control plane read the new config).
    store = RunStore.for_run_dir(run_dir, read_only=True)
    try:
        assert store.has_evaluation(5)
    finally:
        store.close()


def test_a_finished_run_reopens_only_for_an_override_that_extends_it(created: Path, monkeypatch, capsys) -> None:
    """The launch itself is left out (`run_launch` records what it was given): what the resume decides and
    writes before any process starts is the point here; the slow test above runs the processes."""
    from tiderl.cli import main
    from tiderl.store.types import RunState

    store = RunStore.for_run_dir(created)
    store.set_run_state(RunState.FINISHED, "3 steps done")
    store.close()
    launched = []
    monkeypatch.setattr("tiderl.run.launcher.run_launch", lambda launch, *a, **k: launched.append(launch) or 0)
    assert main(["run", "--resume", str(created), "--set", "launch.restarts=1"]) == 0
    assert "nothing to resume (the --set overrides were not applied)" in capsys.readouterr().err
    assert not launched and not config_events(created) and load_job(created / "config.yaml").launch.restarts != 1

    assert main(["run", "--resume", str(created), "--set", "trainer.num_steps=4", "--set", "launch.restarts=1"]) == 0
    err = capsys.readouterr().err
    assert "trainer.num_steps: 3 -> 4" in err and "extending" in err and len(launched) == 1
    assert launched[0].config.trainer.num_steps == 4
    saved = load_job(created / "config.yaml")
    assert (saved.trainer.num_steps, saved.launch.restarts) == (4, 1)
    store = RunStore.for_run_dir(created, read_only=True)
    try:
        info = store.run_info()
        assert info.state is RunState.RUNNING and info.finished_at is None and info.message == "extended to 4 steps"
    finally:
        store.close()
