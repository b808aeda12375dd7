"""One trial of the fault campaign (tools/chaos.py, whose docstring gives the trial's run and its result
line): the run launched, its fault injected after a version and a seeded delay, the launcher waited for,
and the result line filled from the run's store."""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos_facts import POLL_S, Watcher, _launcher_lines, _zombie, exactly_once
from chaos_procs import ChaosError, _default_sigint, reap_run, stop_process

if TYPE_CHECKING:
    from chaos_faults import Fault

ROOT = Path(__file__).resolve().parents[1]


def base_sets(steps: int) -> list[str]:
    return [f"trainer.num_steps={steps}", "trainer.groups_min=2", "trainer.groups_ideal=2",
            "rollout.group_size=4", "rollout.eval_every_steps=0", "rollout.max_concurrency=8",
            "launch.num_ranks=4", "launch.rollout_fraction=0.5", "system=async",
            "trainer.ra2p_mode=decoupled", "trainer.checkpoint_every=1", "env.latency=fixed:0.3"]


# ---- a trial -------------------------------------------------------------------------------

@dataclass
class Trial:
    fault: str
    seed: int
    steps: int
    work_dir: Path
    run_dir: Path
    deadline: float
    stack: ExitStack
    rng: random.Random
    sets: list[str] = field(default_factory=list)
    launcher: subprocess.Popen[bytes] | None = None
    watcher: Watcher | None = None
    env_urls: Callable[[], list[str]] | None = None
    token_file: Path | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def db(self) -> Path:
        return self.run_dir / "run.db"

    @property
    def log(self) -> Path:
        return self.work_dir / "launcher.log"

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def launch(self, *args: str) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "tiderl", "run", *args], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_default_sigint)
        self.stack.callback(stop_process, proc)
        self.launcher = proc
        return proc

    def wait_version(self, version: int) -> None:
        assert self.launcher is not None and self.watcher is not None
        while self.watcher.version < version:
            if self.launcher.poll() is not None:
                raise ChaosError(f"the launcher exited ({self.launcher.returncode}) before version {version}")
            if self.left_s() <= 0:
                raise ChaosError(f"version {version} not reached within the trial's timeout")
            time.sleep(POLL_S)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.left_s()))


def run_trial(fault: Fault, *, seed: int, steps: int = 10, timeout_s: float = 1200.0,
              work_root: Path = Path("/tmp/tiderl-chaos"), keep: bool = False,
              model_path: Path | None = None) -> dict[str, Any]:
    """One run with one injected `fault`; returns its result line (see tools/chaos.py's docstring)."""
    rng = random.Random(f"{fault.name}:{seed}")
    steps = max(steps, fault.min_steps)
    work_dir = work_root / f"{fault.name}-s{seed}"
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    result: dict[str, Any] = {"fault": fault.name, "seed": seed, "survived": None, "trajectories_lost": None,
                              "consumed_twice": None, "recovery_s": None, "exit_code": None,
                              "run_dir": str(work_dir / "run"), "note": ""}
    with ExitStack() as outer:  # mounts and helper servers: they outlive the run's processes
        trial = Trial(fault.name, seed, steps, work_dir, work_dir / "run", time.monotonic() + timeout_s, outer, rng,
                      sets=base_sets(steps) + list(fault.sets)
                      + ([f"model.path={model_path.resolve()}"] if model_path is not None else []))
        injected = False
        try:
            if fault.setup is not None:
                fault.setup(trial)
            with ExitStack() as inner:  # the run's processes: ended before the store is read
                trial.stack = inner
                inner.callback(lambda: trial.extra.__setitem__("reaped", reap_run(trial.run_dir)))
                injected = _inject_and_wait(trial, fault, result)
        except (ChaosError, sqlite3.Error, OSError, subprocess.SubprocessError) as e:
            # The campaign goes on with the next fault; this one's line says what went wrong.
            trial.notes.append(f"fault not injected: {type(e).__name__}: {e}")
        trial.stack = outer
        if trial.launcher is not None:
            result["exit_code"] = trial.launcher.returncode
        try:
            _fill(result, trial, exactly_once(trial.db), steps, injected)
        except (sqlite3.Error, IndexError) as e:
            result["note"] = "; ".join(trial.notes + [f"run store unreadable: {e}"] + _launcher_lines(trial.log))
        if keep and trial.run_dir != work_dir / "run" and trial.run_dir.exists():  # on the tmpfs: keep a copy
            shutil.copytree(trial.run_dir, work_dir / "run", dirs_exist_ok=True)
    if not keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    return result


def _inject_and_wait(trial: Trial, fault: Fault, result: dict[str, Any]) -> bool:
    """Launch, inject the fault after version 1 or 2 and a random delay, wait for the launcher's end."""
    run_dir, steps = trial.run_dir, trial.steps
    trial.watcher = Watcher(run_dir, trial.env_urls or (lambda: json.loads((run_dir / "env_urls.json").read_text())),
                            lambda: trial.token_file or run_dir / "env.token")
    trial.watcher.start()
    trial.stack.callback(trial.watcher.stop)
    trial.launch("jobs/quickstart.yaml", "--run-dir", str(run_dir), *[a for s in trial.sets for a in ("--set", s)])
    trial.wait_version(1 + trial.rng.randrange(2))
    trial.sleep(trial.rng.uniform(0.0, 2.0))
    at_version, fault_at = trial.watcher.version, time.time()
    trial.notes.append(fault.inject(trial) + f" at v{at_version}")
    fault_at = trial.extra.get("fault_at", fault_at)
    if at_version >= steps:
        trial.notes.append("the run had reached its last version before the fault")
    assert trial.launcher is not None
    try:
        trial.launcher.wait(timeout=trial.left_s())
    except subprocess.TimeoutExpired:
        trial.notes.append("trial timeout: the run was still going; stopped")
    result["recovery_s"] = trial.watcher.next_version_after(fault_at)
    return True


def _fill(result: dict[str, Any], trial: Trial, facts: dict[str, Any], steps: int, injected: bool) -> None:
    lost, twice = sum(facts["lost"].values()), sum(facts["twice"].values())
    result["trajectories_lost"], result["consumed_twice"] = lost, twice
    if injected:
        result["survived"] = facts["state"] == "finished" and facts["version"] == steps and result["exit_code"] == 0
    notes = list(trial.notes)
    notes.append(f"run {facts['state']} at v{facts['version']} of {steps}"
                 + (f" ({facts['message']})" if facts["message"] and facts["state"] != "finished" else ""))
    if lost:
        notes.append("lost: " + ", ".join(f"{k} {v}" for k, v in facts["lost"].items() if v))
    if twice:
        notes.append("twice: " + ", ".join(f"{k} {v}" for k, v in facts["twice"].items() if v))
    if facts["dropped_stale"]:
        notes.append(f"{facts['dropped_stale']} trajectories dropped as too stale (by design, not counted as lost)")
    if facts["stale_trained"]:
        notes.append(f"{facts['stale_trained']} trajectories trained past the staleness bound")
    if facts["events"]:
        notes.append("store events: " + ", ".join(f"{k} x{n}" for k, n in sorted(facts["events"].items())))
    notes.append(f"store: {facts['trajectories']} trajectories ({facts['consumed']} trained), "
                 f"{facts['attempts']} task attempts, {facts['retried']} tasks retried")
    if trial.watcher is not None:
        notes.append(trial.watcher.env.summary())
    if "stopped_rank" in trial.extra:
        notes.append(_zombie(trial.db, trial.extra["stopped_rank"]))
    if trial.extra.get("reaped"):
        notes.append(f"the tool killed {len(trial.extra['reaped'])} processes the run left behind")
    notes += _launcher_lines(trial.log)
    result["note"] = "; ".join(n for n in notes if n)
