"""`tiderl submit` as text: executor parameters from the `slurm:` section, the sbatch script, the rank step.

Literal strings only; no Slurm needed (the `tiderl submit --dry-run` test runs the command line).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import submitit

from tiderl.config.schema import build
from tiderl.config.slurm import SlurmConfig
from tiderl.slurm.sbatch import SlurmScriptError
from tiderl.slurm.submit import executor_parameters, extra_flag_parameters, rank_step_argv, sbatch_text, submit_command

ROOT = Path(__file__).resolve().parents[1]


def slurm(**fields: object) -> SlurmConfig:
    return build(SlurmConfig, fields, "job.yaml", "slurm")


EXPECTED_2X4GPU = """\
#!/bin/bash

# Parameters
#SBATCH --account=rl
#SBATCH --constraint=h100
#SBATCH --cpus-per-task=12
#SBATCH --error=/shared/runs/q/logs/slurm-%j.err
#SBATCH --exclusive
#SBATCH --gpus-per-node=4
#SBATCH --job-name=tiderl-q
#SBATCH --mail-type=END,FAIL
#SBATCH --mail-user=me@example.org
#SBATCH --mem=200G
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --open-mode=append
#SBATCH --output=/shared/runs/q/logs/slurm-%j.out
#SBATCH --partition=gpu
#SBATCH --qos=high
#SBATCH --requeue
#SBATCH --reservation=rl-week
#SBATCH --signal=B:USR2@180
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
module load cuda/12.4
source /shared/venv/bin/activate

# command
export SUBMITIT_EXECUTOR=slurm
exec /shared/venv/bin/python -u -m submitit.core._submit /shared/runs/q/slurm
"""


def gpu_config() -> SlurmConfig:
    return slurm(partition="gpu", account="rl", qos="high", constraint="h100", time_min=240, nodes=2,
                 gpus_per_node=4, cpus_per_task=12, mem_gb=200, signal_delay_s=180, mail_user="me@example.org",
                 setup=["module load cuda/12.4", "source /shared/venv/bin/activate"],
                 extra_flags=["--exclusive", "--reservation=rl-week"])


def test_sbatch_script_of_a_2_node_gpu_run() -> None:
    params = executor_parameters(gpu_config(), name="tiderl-q", num_ranks=8, log_dir=Path("/shared/runs/q/logs"))
    text = sbatch_text(params, Path("/shared/runs/q/slurm"), python="/shared/venv/bin/python")
    assert text == EXPECTED_2X4GPU


def test_cpu_defaults_no_gpu_no_setup_no_requeue() -> None:
    params = executor_parameters(slurm(requeue=False), name="tiderl-c", num_ranks=2, log_dir=Path("/r/logs"))
    text = sbatch_text(params, Path("/r/slurm"), python="python3")
    assert "#SBATCH --ntasks-per-node=2\n" in text
    assert "#SBATCH --no-requeue\n" in text and "--requeue\n" not in text.replace("--no-requeue\n", "")
    assert "gpus" not in text and "# setup" not in text and "--partition" not in text
    assert "#SBATCH --signal=B:USR2@120\n" in text
    assert text.endswith("exec python3 -u -m submitit.core._submit /r/slurm\n")


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's SlurmExecutor needs Slurm's srun installed")
def test_parameters_are_what_submitit_accepts_and_writes(tmp_path: Path) -> None:
    # The executor validates every parameter against its own sbatch writer; its script is the dry-run's.
    params = executor_parameters(gpu_config(), name="tiderl-q", num_ranks=8, log_dir=tmp_path / "logs")
    executor = submitit.SlurmExecutor(folder=tmp_path / "slurm", python="/py")
    executor.update_parameters(**params)
    written = executor._make_submission_file_text(submit_command("/py", tmp_path / "slurm"), "uid")
    assert written == sbatch_text(params, tmp_path / "slurm", python="/py")


def test_rank_layout_errors_name_the_fields() -> None:
    with pytest.raises(SlurmScriptError, match=r"launch.num_ranks \(6\) must equal slurm.nodes \(2\) x "
                                               r"slurm.gpus_per_node \(4\)"):
        executor_parameters(gpu_config(), name="x", num_ranks=6, log_dir=Path("/l"))


@pytest.mark.parametrize("flag", ["-x", "--", "exclusive"])
def test_extra_flags_must_be_long_flags(flag: str) -> None:
    with pytest.raises(SlurmScriptError, match=rf"slurm.extra_flags: .* got '{flag}'"):
        extra_flag_parameters((flag,))


def test_extra_flags_become_parameters() -> None:
    assert extra_flag_parameters(("--exclusive", "--gres=gpu:8", "--comment=a=b")) == {
        "exclusive": True, "gres": "gpu:8", "comment": "a=b"}


def test_rank_step_is_one_srun_with_one_task_per_rank() -> None:
    assert rank_step_argv(Path("/r"), num_ranks=8, num_tasks_per_node=4, cpus_per_task=12, python="/py") == [
        "srun", "--unbuffered", "--kill-on-bad-exit=1", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=12",
        "--output=/r/logs/rank%t.log", "--open-mode=append", "/py", "-m", "tiderl.run.rank", "/r",
    ]
    on_gpus = rank_step_argv(Path("/r"), num_ranks=8, num_tasks_per_node=8, cpus_per_task=12, gpus=True, python="/py")
    assert on_gpus[6] == "--gpus-per-task=1"  # one GPU per rank: Slurm sets each task's CUDA_VISIBLE_DEVICES


def test_submit_command_execs_submitit() -> None:
    assert submit_command("/py", Path("/a b/slurm")) == "exec /py -u -m submitit.core._submit '/a b/slurm'"


def tiderl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_dry_run_prints_the_script_and_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = tiderl("submit", "jobs/quickstart.yaml", "--set", "launch.num_ranks=2", "--set", "slurm.partition=cpu",
                 "--run-dir", str(run_dir), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash\n")
    assert "#SBATCH --partition=cpu\n" in out.stdout and "#SBATCH --ntasks-per-node=2\n" in out.stdout
    assert f"#SBATCH --output={run_dir}/logs/slurm-%j.out\n" in out.stdout
    assert out.stdout.endswith(f"-u -m submitit.core._submit {run_dir}/slurm\n")
    assert not run_dir.exists()


@pytest.mark.parametrize(("sets", "message"), [
    (["slurm.gpus_per_node=4", "launch.num_ranks=6"], "launch.num_ranks (6) must equal"),
    (["slurm.partition=a b"], "partition"),
    (["slurm.extra_flags=[-x]"], "slurm.extra_flags"),
])
def test_bad_slurm_config_exits_2_naming_the_field(tmp_path: Path, sets: list[str], message: str) -> None:
    run_dir = tmp_path / "run"
    out = tiderl("submit", "jobs/quickstart.yaml", *[a for s in sets for a in ("--set", s)],
                 "--run-dir", str(run_dir))
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert not run_dir.exists()
