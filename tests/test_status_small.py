"""Small things of `tiderl status` and `tiderl report` a user meets: a cancelled run under `--check`, a finished
run's diagnosis, the evaluation interval in `--json`, a directory of runs, a short report's progress lines."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.config import load_job
from tiderl.observe.progress import Progress
from tiderl.rundir import create_run
from tiderl.store import FinishedTrajectory, NewGroup, RankReport, Role, RunState, TaskKind

ROOT = Path(__file__).resolve().parents[1]


def _run(run_dir: Path, state: RunState, message: str | None = None, *, evals: tuple[float, ...] = ()) -> None:
    """A run in `state`, with an evaluation of version 0 whose tasks got `evals` rewards (success: reward 1)."""
    _, s = create_run(load_job(ROOT / "jobs" / "quickstart.yaml", [f"name={run_dir.name}"]), run_dir)
    s.register_initial_version("model", "0")
    s.register_rank(0, Role.ROLLOUT)
    if evals:
        s.add_groups([NewGroup(TaskKind.EVAL, 1, len(evals), eval_version=0)])
        claims = s.claim_tasks(0, len(evals), kinds=[TaskKind.EVAL])
        s.report(RankReport(rank=0, finished=[FinishedTrajectory(
            task_id=c.task_id, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], token_versions=[-1, 0],
            num_turns=1, reward=r, success=r == 1.0) for c, r in zip(claims, evals)]))
    s.set_run_state(state, message)
    s.close()


def tiderl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_check_on_a_cancelled_run_says_cancelled_and_exits_3(tmp_path: Path) -> None:
    _run(tmp_path / "r", RunState.CANCELLED, "cancelled by `tiderl cancel`")
    out = tiderl("status", str(tmp_path / "r"), "--check", "--no-probe")
    assert out.returncode == 3, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    assert first == "CANCELLED: run r at version 0 (cancelled): cancelled by `tiderl cancel`"
    assert "OK" not in out.stdout
    assert "exit 1 if the run is stalled or a finding is an error, 3 if it was cancelled" in \
        " ".join(tiderl("status", "--help").stdout.split())


def test_a_finished_run_shows_no_time_since_the_last_version(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "r", RunState.FINISHED)
    assert main(["status", str(tmp_path / "r"), "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "diagnosis (run finished)" in out and "since the last new version" not in out
    assert main(["status", str(tmp_path / "r"), "--no-probe", "--check"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "OK: run r at version 0 (finished)"
    # A running one does show it.
    _run(tmp_path / "live", RunState.RUNNING)
    assert main(["status", str(tmp_path / "live"), "--no-probe"]) == 0
    assert "s since the last new version)" in capsys.readouterr().out


def test_json_evaluations_carry_the_interval_the_text_shows(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "r", RunState.RUNNING, evals=(1.0, 1.0, 1.0, 0.0))
    assert main(["status", str(tmp_path / "r"), "--no-probe", "--json"]) == 0
    (ev,) = json.loads(capsys.readouterr().out)["eval"]
    assert ev["num_tasks"] == 4 and ev["success_rate"] == 0.75
    low, high = ev["success_ci95"]
    assert 0.2 < low < 0.75 < high < 1.0
    assert main(["status", str(tmp_path / "r"), "--no-probe"]) == 0
    assert f"eval @ version 0: success 0.75 (95% {low:.2f}-{high:.2f}) over 4 tasks" in capsys.readouterr().out


def test_status_of_a_directory_of_runs_lists_them(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _run(runs / "alpha", RunState.FINISHED)
    _run(runs / "beta", RunState.RUNNING)
    (runs / "notes").mkdir()
    out = tiderl("status", str(runs))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["run", "directory", "name", "state", "version", "last", "update"]
    assert [line.split()[:4] for line in lines[1:]] == [["beta", "beta", "running", "0"],
                                                        ["alpha", "alpha", "finished", "0"]]
    listed = json.loads(tiderl("status", str(runs), "--json").stdout)
    assert [(r["dir"], r["state"], r["version"]) for r in listed] == [("beta", "running", 0), ("alpha", "finished", 0)]
    # A directory that holds no run is still an error naming it.
    empty = tiderl("status", str(runs / "notes"))
    assert empty.returncode == 2 and "no run store" in empty.stderr


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_quiet_progress_says_nothing_for_a_short_job_and_speaks_for_a_long_one() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress("report", total=3, out=out, quiet_s=10.0, clock=clock) as p:
        for step in ("a", "b", "c"):
            p.step(step)
            clock.t += 0.7
    assert out.getvalue() == ""
    out, clock = io.StringIO(), Clock()
    with Progress("report", total=3, out=out, quiet_s=10.0, clock=clock) as p:
        p.step("a")
        clock.t += 11.0
        p.step("b")
        clock.t += 1.0
        p.step("c")
    assert out.getvalue().splitlines() == ["report: 1/3  11.0 s  eta 22.0 s  b", "report: 2/3  12.0 s  eta 6.0 s  c",
                                           "report: done in 12.0 s (3/3)"]
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("report", out=out, quiet_s=10.0, clock=Clock()):
            raise RuntimeError("boom")
    assert out.getvalue() == "report: failed in 0.0 s\n"  # a failure is always said


def test_a_short_report_into_a_pipe_prints_no_progress_lines(tmp_path: Path) -> None:
    _run(tmp_path / "r", RunState.FINISHED)
    out = tiderl("report", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert "tiderl report:" not in out.stderr and out.stdout.startswith("wrote ")
