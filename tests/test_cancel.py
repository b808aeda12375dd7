"""`tiderl cancel`: which jobs are still live (pure), and cancelling a run that has no Slurm job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiderl.config import load_job
from tiderl.rundir import create_run, open_run
from tiderl.slurm.cancel import live_job_ids

ROOT = Path(__file__).resolve().parents[1]


def test_live_jobs_are_the_unfinished_and_the_unknown() -> None:
    jobs = [{"job_id": "1", "state": "RUNNING", "reason": None},
            {"job_id": "2", "state": "COMPLETED", "reason": None},
            {"job_id": "3", "state": "PENDING", "reason": "BeginTime"},
            {"job_id": "4", "state": "UNKNOWN", "reason": "cannot ask Slurm"},
            {"job_id": "5", "state": "CANCELLED", "reason": None}]
    assert live_job_ids(jobs) == ["1", "3", "4"]


def tiderl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cancel_a_run_without_slurm_jobs_marks_it_once(tmp_path: Path) -> None:
    paths, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "run")
    store.close()
    out = tiderl("cancel", str(paths.root))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"run {paths.root}: cancelled (was starting)\n"
    _, store = open_run(paths.root)
    assert (store.run_info().state, store.run_info().message) == ("cancelled", "cancelled by `tiderl cancel`")
    store.close()
    again = tiderl("cancel", str(paths.root))
    assert again.returncode == 0 and again.stdout == f"run {paths.root}: already cancelled\n"


def test_cancel_of_a_directory_without_a_run(tmp_path: Path) -> None:
    out = tiderl("cancel", str(tmp_path))
    assert out.returncode == 2 and "no run store" in out.stderr
