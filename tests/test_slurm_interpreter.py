"""The sbatch script runs the cluster's interpreter where `slurm.setup` sets one up (a venv it activates, a
module it loads): `python` from PATH after the setup lines; this machine's interpreter without setup."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from tiderl.config import load_job
from tiderl.slurm.submit import batch_python, dry_run_text

ROOT = Path(__file__).resolve().parents[1]
SETUP = "slurm.setup=[source /cluster/venv/bin/activate]"


def test_batch_python_is_paths_after_setup_and_this_one_without() -> None:
    assert batch_python(("source /cluster/venv/bin/activate",)) == "python"
    assert batch_python(()) == sys.executable


def test_script_runs_python_from_path_after_the_setup_lines() -> None:
    config = load_job(ROOT / "jobs/quickstart.yaml", ["launch.num_ranks=2", SETUP])
    text = dry_run_text(config, Path("/shared/runs/q"), Path("/shared/runs/q/slurm"))
    setup_at = text.index("source /cluster/venv/bin/activate\n")
    exec_at = text.index("exec python -u -m submitit.core._submit /shared/runs/q/slurm\n")
    assert setup_at < exec_at
    assert sys.executable not in text  # neither the batch step nor the rank step names this machine's interpreter
    assert text.endswith(" python -m tiderl.run.rank /shared/runs/q\n")


def test_script_without_setup_keeps_the_submitting_interpreter() -> None:
    config = load_job(ROOT / "jobs/quickstart.yaml", ["launch.num_ranks=2"])
    text = dry_run_text(config, Path("/r"), Path("/r/slurm"))
    assert f"exec {shlex.quote(sys.executable)} -u -m submitit.core._submit /r/slurm\n" in text
    assert f" {sys.executable} -m tiderl.run.rank /r\n" in text


def test_submit_dry_run_with_setup(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "tiderl", "submit", "jobs/quickstart.yaml", "--set", "launch.num_ranks=2",
                          "--set", SETUP, "--run-dir", str(run_dir), "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    script = out.stdout.split("\n\n# Not part of the script", 1)[0]
    lines = script.splitlines()
    assert lines.index("source /cluster/venv/bin/activate") < lines.index(
        f"exec python -u -m submitit.core._submit {run_dir}/slurm")
    assert sys.executable not in out.stdout
