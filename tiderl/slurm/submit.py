"""`tiderl submit`: a run as one Slurm job, submitted with submitit.

The layout (see docs/slurm.md for why):

    sbatch (submitit, slurm_use_srun=False)      one allocation: `nodes` x `ranks_per_node` tasks
      batch step, first node:   python -m submitit.core._submit RUN_DIR/slurm   (`exec`ed by the script)
        -> tiderl.slurm.job.SlurmRun: env servers + control plane as local children (the launcher's)
        -> one step:  srun --ntasks=N ... python -m tiderl.run.rank RUN_DIR   (rank = SLURM_PROCID)

Pure parts (config in, text or argv out), tested with literal strings:
`executor_parameters`, `sbatch_text`, `rank_step_argv` and `rank_step_of` (the
rank step the job starts, and `--dry-run` prints), `dry_run_text`,
`parsable_line` and `submission_record` (what `--parsable` and `--json` print).
`tiderl.slurm.cli.submit_run` is the one function that talks to Slurm.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiderl.config import JobConfig
from tiderl.config.slurm import SlurmConfig
from tiderl.paths import RunPaths
from tiderl.slurm.sbatch import LOG_NAME, PREEMPT_SIGNAL, SlurmScriptError, job_name, ranks_per_node

SUBMITIT_MAIN = "submitit.core._submit"
SRUN_LOG = "ranks-srun.log"


def extra_flag_parameters(flags: tuple[str, ...]) -> dict[str, Any]:
    """`slurm.extra_flags` as submitit's `additional_parameters`: `--name=value` -> {name: value}, `--name` ->
    {name: True}. submitit writes one `#SBATCH --name[=value]` line per entry."""
    params: dict[str, Any] = {}
    for flag in flags:
        if not flag.startswith("--") or len(flag) < 3:
            raise SlurmScriptError(
                f"slurm.extra_flags: `tiderl submit` takes long sbatch flags (--name or --name=value), got {flag!r}"
            )
        name, sep, value = flag[2:].partition("=")
        params[name] = value if sep else True
    return params


def executor_parameters(slurm: SlurmConfig, *, name: str, num_ranks: int, log_dir: Path) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for a run; each comes from one `slurm:` field (or the rank count)."""
    params: dict[str, Any] = {
        "job_name": name,
        "time": slurm.time_min,
        "nodes": slurm.nodes,
        # The allocation holds one task slot per rank; the batch step starts them as one srun step.
        "ntasks_per_node": ranks_per_node(slurm, num_ranks),
        "cpus_per_task": slurm.cpus_per_task,
        "mem": f"{slurm.mem_gb}G",
        "signal_delay_s": slurm.signal_delay_s,
        # The submitted function runs in the batch step itself, so it can start its own srun step.
        "use_srun": False,
        # submitit writes `#SBATCH --wckey=submitit` unless told otherwise; None leaves the line out (its
        # sbatch writer skips every None parameter), so the job gets the user's default wckey as plain sbatch
        # gives it (`extra_flags: [--wckey=NAME]` sets one).
        "wckey": None,
    }
    if slurm.setup:
        params["setup"] = list(slurm.setup)
    if slurm.gpus_per_node:
        params["gpus_per_node"] = slurm.gpus_per_node
    for field in ("partition", "account", "qos", "constraint"):
        value = getattr(slurm, field)
        if value is not None:
            params[field] = value
    if slurm.mail_user is not None:
        params["mail_user"] = slurm.mail_user
        params["mail_type"] = slurm.mail_type
    additional: dict[str, Any] = {
        # Beside the run's other logs; `--open-mode=append` (submitit's) keeps a requeued job's earlier output.
        "output": str(log_dir / f"{LOG_NAME}.out"),
        "error": str(log_dir / f"{LOG_NAME}.err"),
        "requeue" if slurm.requeue else "no_requeue": True,
        # B: the warning goes to the batch step, where submitit's handler runs (without it, only to the
        # job's other steps: the ranks).
        "signal": f"B:{PREEMPT_SIGNAL}@{slurm.signal_delay_s}",
    }
    additional.update(extra_flag_parameters(slurm.extra_flags))
    params["additional_parameters"] = additional
    return params


def run_parameters(config: JobConfig, run_dir: Path) -> dict[str, Any]:
    """`executor_parameters` of a job config and its run directory."""
    return executor_parameters(config.slurm, name=job_name(config.slurm, config.name),
                               num_ranks=config.launch.num_ranks, log_dir=RunPaths(Path(run_dir)).logs)


def batch_python(setup: Sequence[str]) -> str:
    """The interpreter the batch script runs: after `slurm.setup` lines (which may activate a virtual
    environment or load a module on the cluster), `python` as the setup leaves it on PATH; without any, this
    machine's interpreter, the one that submitted (on a filesystem the cluster shares)."""
    return "python" if setup else sys.executable


def submit_command(python: str, folder: Path) -> str:
    """The batch script's command: submitit's job runner, `exec`ed so that it is the batch shell's own
    process, the one `--signal=B:...` reaches (bash would die of SIGUSR2 and leave python unsignalled)."""
    return " ".join(["exec", python, "-u", "-m", SUBMITIT_MAIN, shlex.quote(str(folder))])


def sbatch_text(params: dict[str, Any], folder: Path, python: str = shlex.quote(sys.executable)) -> str:
    """The sbatch script submitit writes for these parameters (what `tiderl submit --dry-run` prints)."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=submit_command(python, folder), folder=folder, **params)


def rank_step_argv(run_dir: Path, *, num_ranks: int, num_tasks_per_node: int, cpus_per_task: int,
                   gpus: bool = False, python: str = sys.executable) -> list[str]:
    """The srun step of the ranks: one task per rank, each learning its rank from Slurm, logs per rank.
    With `gpus`, each task gets one GPU of its node (Slurm sets its CUDA_VISIBLE_DEVICES)."""
    paths = RunPaths(Path(run_dir))
    return [
        "srun", "--unbuffered",
        # One rank dying ends the step: the launcher sees it and records the run failed.
        "--kill-on-bad-exit=1",
        f"--ntasks={num_ranks}", f"--ntasks-per-node={num_tasks_per_node}", f"--cpus-per-task={cpus_per_task}",
        *(["--gpus-per-task=1"] if gpus else []),
        f"--output={paths.rank_log('%t')}", "--open-mode=append",  # srun's %t: the task's rank in the step
        python, "-m", "tiderl.run.rank", str(run_dir),
    ]


def rank_step_of(config: JobConfig, run_dir: Path, python: str = sys.executable) -> list[str]:
    """The ranks' srun step of this run: what the job starts (`tiderl.slurm.job.start_slurm_ranks`) and what
    `tiderl submit --dry-run` prints."""
    slurm, num_ranks = config.slurm, config.launch.num_ranks
    return rank_step_argv(Path(run_dir), num_ranks=num_ranks, num_tasks_per_node=ranks_per_node(slurm, num_ranks),
                          cpus_per_task=slurm.cpus_per_task, gpus=bool(slurm.gpus_per_node), python=python)


def rank_step_env(slurm: SlurmConfig) -> dict[str, str]:
    """What the rank step adds to the batch step's environment: as many threads as the task has CPUs (the local
    launcher's one per CPU slot, on Slurm's terms)."""
    return {"OMP_NUM_THREADS": str(slurm.cpus_per_task)}


def dry_run_text(config: JobConfig, run_dir: Path, folder: Path, python: str | None = None) -> str:
    """What `tiderl submit --dry-run` prints: the sbatch script submitit writes (`sbatch_text`), then, as comment
    lines, the srun step the batch step starts for the ranks. The script `exec`s submitit's runner, so nothing
    after that line would run if the text were submitted as it is. `python`: the interpreter, by default
    `batch_python` (the ranks run the batch step's own interpreter)."""
    if python is None:
        python = batch_python(config.slurm.setup)
    script = sbatch_text(run_parameters(config, run_dir), folder, python=shlex.quote(python))
    env = " ".join(f"{name}={value}" for name, value in rank_step_env(config.slurm).items())
    return script + "\n".join([
        "",
        "# Not part of the script: the batch step (tiderl.slurm.job.SlurmRun) starts the env servers and the",
        f"# control plane, then the ranks as this one srun step, with {env} in its environment:",
        f"# {shlex.join(rank_step_of(config, run_dir, python))}",
        "",
    ])


def parsable_line(job_id: str, cluster: str | None) -> str:
    """`tiderl submit --parsable`, as `sbatch --parsable` prints it: `JOBID`, or `JOBID;CLUSTER` when the job
    went to a named cluster (`--clusters`)."""
    return job_id if cluster is None else f"{job_id};{cluster}"


def submission_record(config: JobConfig, run_dir: Path, job_id: str, cluster: str | None) -> dict[str, Any]:
    """`tiderl submit --json`: the job, the run directory, every log of the run, and the commands to follow it."""
    paths = RunPaths(Path(run_dir))
    batch_log = paths.logs / LOG_NAME.replace("%j", job_id)
    num_env_logs = 0 if config.env.servers else config.env.num_servers  # given servers are not the run's
    return {
        "job_id": job_id,
        "cluster": cluster,
        "job_name": job_name(config.slurm, config.name),
        "run_dir": str(paths.root),
        "logs": {
            "batch_out": f"{batch_log}.out",
            "batch_err": f"{batch_log}.err",
            "control": str(paths.control_log()),
            "env": [str(paths.env_log(i)) for i in range(num_env_logs)],
            "ranks": [str(paths.rank_log(r)) for r in range(config.launch.num_ranks)],
            "srun": str(paths.logs / SRUN_LOG),
        },
        "follow": shlex.join(["tiderl", "logs", str(paths.root), "-f"]),
        "status": shlex.join(["tiderl", "status", str(paths.root)]),
    }


def slurm_conf() -> str | None:
    return os.environ.get("SLURM_CONF")
