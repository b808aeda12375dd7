"""slurm/run.sbatch on the real dev cluster (marked `slurm`): `tiderl run` as the step of a plain sbatch
script stops on SIGUSR2 (the time-limit warning), requeues its job, and the requeued script resumes the run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiderl.slurm.cluster import SlurmCluster
from tiderl.slurm.states import JobState
from tiderl.store import NoRunError, RunStore

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["trainer.num_steps=50", "trainer.groups_min=1", "trainer.groups_ideal=2", "rollout.group_size=4",
         "rollout.eval_every_steps=0", "rollout.max_concurrency=8", "launch.num_ranks=2", "system=async"]


def run_state(run_dir: Path) -> tuple[str, str | None] | None:
    """(state, message) of the run; None before the run store holds the run (the file appears first)."""
    if not (run_dir / "run.db").exists():
        return None
    store = RunStore.for_run_dir(run_dir)
    try:
        info = store.run_info()
        return info.state.value, info.message
    except NoRunError:
        return None
    finally:
        store.close()


def wait_for(what: str, check, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(1.0)


@pytest.mark.slurm
def test_plain_sbatch_run_requeues_itself_on_usr2_and_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_file = tmp_path / "short.yaml"
    config = subprocess.run([sys.executable, "-m", "tiderl", "config", "jobs/quickstart.yaml",
                             *[a for s in SHORT for a in ("--set", s)]],
                            cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    job_file.write_text(config.stdout)
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    done = subprocess.run(["sbatch", "--parsable", f"--output={out}", "--mem=2G", "slurm/run.sbatch", str(job_file),
                           str(run_dir)], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
    job_id = done.stdout.strip().split(";")[0]
    try:
        wait_for("the run running", lambda: (run_state(run_dir) or ("",))[0] == "running", 300)
        # What the script's --signal=USR2@120 sends before the time limit: SIGUSR2 to the step, `tiderl run`.
        slurm_cluster.cancel([job_id], signal="USR2")
        wait_for("the requeued attempt", lambda: "(restart 1)" in out.read_text(), 300)
        text = out.read_text()
        assert "stopped by Slurm (SIGUSR2)" in text and f"tiderl run: requeued job {job_id}" in text, text
        # The interrupted launch left the run resumable; the next one records that it resumed it.
        assert (run_state(run_dir) or ("",))[0] == "running"
        wait_for("the resumed run running", lambda: run_state(run_dir) == ("running", "resumed"), 300)
    finally:
        slurm_cluster.cancel([job_id])
    assert slurm_cluster.wait(job_id, timeout_s=60) is JobState.CANCELLED
