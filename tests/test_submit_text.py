"""`tiderl submit` as text: executor parameters from the `slurm:` section, the sbatch script, the rank step,
what `--parsable` and `--json` print.

Literal strings; no Slurm needed. The command-line tests run `tiderl submit`: `--dry-run` as it is, a
submission with stand-ins for scontrol, sbatch, squeue and sacct on PATH (real submitit, fake Slurm).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import submitit

from tiderl.config import JobConfig, load_job
from tiderl.config.schema import build
from tiderl.config.slurm import SlurmConfig
from tiderl.paths import RunPaths
from tiderl.slurm.sbatch import SlurmScriptError
from tiderl.slurm.submit import (
    dry_run_text,
    executor_parameters,
    extra_flag_parameters,
    parsable_line,
    rank_step_argv,
    rank_step_of,
    sbatch_text,
    submission_record,
    submit_command,
)

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


def test_submitit_wckey_is_left_out_unless_asked_for() -> None:
    # submitit writes `--wckey=submitit` by default; the job gets the user's default wckey instead.
    params = executor_parameters(slurm(), name="tiderl-c", num_ranks=2, log_dir=Path("/r/logs"))
    assert "wckey" not in sbatch_text(params, Path("/r/slurm"), python="python3")
    asked = executor_parameters(slurm(extra_flags=["--wckey=rl"]), name="tiderl-c", num_ranks=2,
                                log_dir=Path("/r/logs"))
    assert sbatch_text(asked, Path("/r/slurm"), python="python3").count("wckey") == 1
    assert "#SBATCH --wckey=rl\n" in sbatch_text(asked, Path("/r/slurm"), python="python3")


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


def job_config(*sets: str) -> JobConfig:
    return load_job(ROOT / "jobs/quickstart.yaml", list(sets))


GPU_SETS = ("slurm.gpus_per_node=4", "slurm.nodes=2", "launch.num_ranks=8", "slurm.cpus_per_task=12",
            "slurm.mem_gb=200")


def test_rank_step_of_a_config_is_its_layout() -> None:
    assert rank_step_of(job_config(*GPU_SETS), Path("/r"), python="/py") == rank_step_argv(
        Path("/r"), num_ranks=8, num_tasks_per_node=4, cpus_per_task=12, gpus=True, python="/py")
    assert "--gpus-per-task=1" not in rank_step_of(job_config("launch.num_ranks=2"), Path("/r"), python="/py")


def test_the_job_starts_the_rank_step_of_its_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tiderl.slurm import job

    spawned: list[tuple[str, list[str], Path, dict[str, str]]] = []
    monkeypatch.setattr(job.procs, "spawn", lambda name, argv, log, env: spawned.append((name, argv, log, env)))
    config = job_config(*GPU_SETS)
    launch = types.SimpleNamespace(config=config, paths=RunPaths(tmp_path))
    job.start_slurm_ranks(launch, {"TIDERL_RUN_DIR": str(tmp_path)})  # type: ignore[arg-type]
    [(name, argv, log, env)] = spawned
    assert argv == rank_step_of(config, tmp_path)  # the step `--dry-run` prints
    assert env == {"TIDERL_RUN_DIR": str(tmp_path), "OMP_NUM_THREADS": "12"}
    assert log == tmp_path / "logs" / "ranks-srun.log"


def test_dry_run_text_ends_in_the_rank_step_as_comments() -> None:
    text = dry_run_text(job_config(*GPU_SETS), Path("/shared/runs/q"), Path("/shared/runs/q/slurm"), python="/py")
    script, comments = text.split("\n\n# Not part of the script", 1)
    assert script.endswith("\nexec /py -u -m submitit.core._submit /shared/runs/q/slurm")
    assert comments == (
        ": the batch step (tiderl.slurm.job.SlurmRun) starts the env servers and the\n"
        "# control plane, then the ranks as this one srun step, with OMP_NUM_THREADS=12 in its environment:\n"
        "# srun --unbuffered --kill-on-bad-exit=1 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=12 "
        "--gpus-per-task=1 --output=/shared/runs/q/logs/rank%t.log --open-mode=append "
        "/py -m tiderl.run.rank /shared/runs/q\n"
    )


def test_parsable_line_is_sbatchs() -> None:
    assert parsable_line("4242", None) == "4242"
    assert parsable_line("4242", "alpha") == "4242;alpha"


def test_submission_record_names_every_log_and_how_to_follow() -> None:
    record = submission_record(job_config("launch.num_ranks=2"), Path("/runs/a b"), "4242", None)
    assert record == {
        "job_id": "4242", "cluster": None, "job_name": "tiderl-quickstart", "run_dir": "/runs/a b",
        "logs": {"batch_out": "/runs/a b/logs/slurm-4242.out", "batch_err": "/runs/a b/logs/slurm-4242.err",
                 "control": "/runs/a b/logs/control.log", "env": ["/runs/a b/logs/env0.log"],
                 "ranks": ["/runs/a b/logs/rank0.log", "/runs/a b/logs/rank1.log"],
                 "srun": "/runs/a b/logs/ranks-srun.log"},
        "follow": "tiderl logs '/runs/a b' -f", "status": "tiderl status '/runs/a b'",
    }
    given = submission_record(job_config("launch.num_ranks=2", "env.servers=[http://e:1]"), Path("/r"), "1", "x")
    assert given["logs"]["env"] == [] and given["cluster"] == "x"  # servers the run did not start log elsewhere


def test_submit_command_execs_submitit() -> None:
    assert submit_command("/py", Path("/a b/slurm")) == "exec /py -u -m submitit.core._submit '/a b/slurm'"


def tiderl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_dry_run_prints_the_script_and_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = tiderl("submit", "jobs/quickstart.yaml", "--set", "launch.num_ranks=2", "--set", "slurm.partition=cpu",
                 "--run-dir", str(run_dir), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash\n")
    assert "#SBATCH --partition=cpu\n" in out.stdout and "#SBATCH --ntasks-per-node=2\n" in out.stdout
    assert f"#SBATCH --output={run_dir}/logs/slurm-%j.out\n" in out.stdout
    assert f"-u -m submitit.core._submit {run_dir}/slurm\n" in out.stdout
    # The rank step, exactly as the job builds it (same interpreter: the script runs this one).
    rank_step = rank_step_argv(run_dir, num_ranks=2, num_tasks_per_node=2, cpus_per_task=1, python=sys.executable)
    assert out.stdout.endswith(f"\n# {shlex.join(rank_step)}\n")
    assert "wckey" not in out.stdout
    assert "warning" not in out.stderr  # a CPU job
    assert not run_dir.exists()


def test_dry_run_warns_about_cpu_sized_resources_of_a_gpu_job(tmp_path: Path) -> None:
    out = tiderl("submit", "jobs/quickstart.yaml", "--set", "slurm.gpus_per_node=4", "--set", "slurm.mem_gb=8",
                 "--set", "slurm.cpus_per_task=1", "--run-dir", str(tmp_path / "run"), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash\n") and "warning" not in out.stdout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("tiderl submit: warning: ")]
    assert len(warnings) == 2, out.stderr
    assert "slurm.mem_gb (8) is 2 GB per GPU" in warnings[0] and "slurm.cpus_per_task (1)" in warnings[1]


FAKE_SCONTROL = "#!/bin/sh\necho 'Slurmctld(primary) at dev is UP'\n"
# Accounting of a job that failed at once, so that `--wait` ends at its first look.
FAKE_SACCT = ("#!/bin/sh\necho 'JobID|JobName|State|ExitCode|Elapsed|NodeList'\n"
              "echo '4242|tiderl-quickstart|FAILED|1:0|00:00:01|dev1'\n")


def fake_slurm(tmp_path: Path, sbatch_says: str) -> dict[str, str]:
    """An environment whose PATH finds stand-ins for Slurm's commands first; sbatch answers `sbatch_says`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"scontrol": FAKE_SCONTROL, "sbatch": f"#!/bin/sh\necho '{sbatch_says}'\n",
                       "srun": "#!/bin/sh\nexit 1\n", "squeue": "#!/bin/sh\n", "sacct": FAKE_SACCT}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def submit_faked(tmp_path: Path, *flags: str, sbatch_says: str = "Submitted batch job 4242"
                 ) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path / "run"
    out = tiderl("submit", "jobs/quickstart.yaml", "--set", "launch.num_ranks=2", "--run-dir", str(run_dir),
                 *flags, env=fake_slurm(tmp_path, sbatch_says))
    return out, run_dir


def test_submit_prints_job_and_run_dir(tmp_path: Path) -> None:
    out, run_dir = submit_faked(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"job 4242\nrun dir {run_dir}\n"
    assert json.loads((run_dir / "slurm" / "jobs.json").read_text())["jobs"][0]["job_id"] == "4242"


@pytest.mark.parametrize(("sbatch_says", "expected"), [
    ("Submitted batch job 4242", "4242\n"),
    ("Submitted batch job 4242 on cluster alpha", "4242;alpha\n"),
])
def test_parsable_prints_what_sbatch_parsable_would(tmp_path: Path, sbatch_says: str, expected: str) -> None:
    out, _ = submit_faked(tmp_path, "--parsable", sbatch_says=sbatch_says)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected


def test_json_prints_one_object(tmp_path: Path) -> None:
    out, run_dir = submit_faked(tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1
    record = json.loads(out.stdout)
    assert (record["job_id"], record["cluster"], record["run_dir"]) == ("4242", None, str(run_dir))
    assert record["logs"]["batch_out"] == f"{run_dir}/logs/slurm-4242.out"
    assert record["follow"] == f"tiderl logs {run_dir} -f"


@pytest.mark.parametrize("mode", ["--parsable", "--json"])
def test_wait_in_a_machine_readable_mode_follows_on_stderr(tmp_path: Path, mode: str) -> None:
    out, _ = submit_faked(tmp_path, mode, "--wait")
    assert out.returncode == 1, out.stdout + out.stderr  # the job failed before the run started
    assert out.stdout.count("\n") == 1 and "4242" in out.stdout
    assert "job 4242 FAILED" in out.stderr


@pytest.mark.parametrize("flags", [["--dry-run", "--json"], ["--parsable", "--json"], ["--dry-run", "--parsable"]])
def test_output_modes_exclude_each_other(tmp_path: Path, flags: list[str]) -> None:
    out = tiderl("submit", "jobs/quickstart.yaml", "--run-dir", str(tmp_path / "run"), *flags)
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
    assert not (tmp_path / "run").exists()


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
