"""Kill and resume: SIGKILL a rank and the launcher at random points, resume, check nothing was lost or doubled.
With the tests' scripted engine (`rollout.engine: fake_engine:for_job`: every process of the run real but the
engine); a rollout rank killed with vLLM's engine in it is tests/test_chaos.py's, so the resume logic is not run
on vLLM twice (a `vllm` engine value here still runs it that way)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_engine import SCRIPTED_ENGINE, scripted_run_env
from run_checks import check_run
from tiderl.store import RunStore
from tiderl.store.engine import StoreError

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
# Each environment step takes 0.5 s, so a training step takes seconds even on a fast idle machine:
# the kills below always land while steps remain (without it, a fast machine finished the whole run
# between the test's poll and its kill).
JOB = [f"trainer.num_steps={STEPS}", "trainer.groups_min=1", "trainer.groups_ideal=2", "rollout.group_size=4",
       "rollout.eval_every_steps=0", "rollout.max_concurrency=8", "launch.num_ranks=2",
       "trainer.checkpoint_every=1", "launch.heartbeat_timeout_s=20", "system=async", "env.latency=fixed:0.5"]


ENGINES = ["scripted"]


def _engine_sets(engine: str) -> list[str]:
    return [] if engine == "vllm" else ["--set", f"rollout.engine={SCRIPTED_ENGINE}", "--set", "model.init_train_steps=0"]


def _launch(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tiderl", "run", *args], cwd=ROOT, text=True, env=scripted_run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _version(run_dir: Path) -> int:
    store = RunStore.for_run_dir(run_dir)
    try:
        return store.run_info().version
    finally:
        store.close()


def _rank_pids(run_dir: Path, role: str | None = None) -> list[int]:
    store = RunStore.for_run_dir(run_dir)
    try:
        return [r.pid for r in store.ranks() if r.pid and role in (None, r.role)]
    finally:
        store.close()


def _wait_version(run_dir: Path, version: int, proc: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (run_dir / "run.db").exists() and _version(run_dir) >= version:
                return
        except StoreError:  # the file exists but the launcher is still creating the schema
            pass
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the launcher exited ({proc.returncode}) before version {version}:\n{out}")
        time.sleep(0.5)
    raise AssertionError(f"version {version} not reached in {timeout_s} s")


def _kill_groups(pids: list[int]) -> None:
    """What the kernel's parent-death signal does not reach (a rank's engine processes)."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_actor_restarts_its_trainer_group_then_a_killed_launcher_resumes(tmp_path: Path, engine: str) -> None:
    rng = random.Random(int(os.environ.get("TIDERL_TEST_SEED", time.time())))
    run_dir = tmp_path / "run"
    sets = [a for s in JOB for a in ("--set", s)] + _engine_sets(engine)
    first = _launch("jobs/quickstart.yaml", *sets, "--run-dir", str(run_dir))
    _wait_version(run_dir, 1, first, 900)
    time.sleep(rng.uniform(0.0, 2.0))
    victim = _rank_pids(run_dir, role="actor")[0]
    os.kill(victim, signal.SIGKILL)  # an actor dies inside a step: its trainer group restarts, the run goes on
    killed_at = _version(run_dir)
    assert killed_at < STEPS - 2, f"the first launch reached version {killed_at} before the rank was killed"
    _wait_version(run_dir, killed_at + 1, first, 900)
    store = RunStore.for_run_dir(run_dir)
    try:
        assert [e["kind"] for e in store.recent_events(500, kinds=["trainer_restarted"])] == ["trainer_restarted"]
    finally:
        store.close()
    time.sleep(rng.uniform(0.0, 3.0))
    os.kill(first.pid, signal.SIGKILL)  # the launcher dies: its children die with it
    first.wait(30)
    time.sleep(2)
    _kill_groups(_rank_pids(run_dir))

    second = _launch("--resume", str(run_dir))
    out, _ = second.communicate(timeout=900)
    assert second.returncode == 0, out[-4000:]
    doc = json.loads(_status(run_dir))
    assert doc["state"] == "finished" and doc["version"] == STEPS
    facts = check_run(run_dir, max_staleness=1)  # nothing lost, nothing trained twice
    assert facts["versions"] == STEPS


def _status(run_dir: Path) -> str:
    return subprocess.run([sys.executable, "-m", "tiderl", "status", str(run_dir), "--json"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rollout_rank_that_dies_is_restarted_and_the_run_finishes(tmp_path: Path, engine: str) -> None:
    # Three ranks: an actor and two rollout ranks; one rollout rank is SIGKILLed mid-run.
    run_dir = tmp_path / "run"
    sets = [a for s in JOB + ["launch.num_ranks=3"] for a in ("--set", s)] + _engine_sets(engine)
    proc = _launch("jobs/quickstart.yaml", *sets, "--run-dir", str(run_dir))
    _wait_version(run_dir, 1, proc, 900)
    victim = _rank_pids(run_dir, role="rollout")[0]
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert "exited with code -9: restarting it (1 of 3)" in out
    doc = json.loads(_status(run_dir))
    assert doc["state"] == "finished" and doc["version"] == STEPS
    facts = check_run(run_dir, max_staleness=1)  # nothing lost, nothing trained twice
    assert facts["versions"] == STEPS
    store = RunStore.for_run_dir(run_dir)
    try:
        assert [e["kind"] for e in store.recent_events(500, kinds=["restarted"])] == ["restarted"]
    finally:
        store.close()
