"""The sbatch script of a run, as text.

Pure functions: config in, text out; no subprocess, no file access. Tested with
literal strings and a saved expected script (tests/data/).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from tiderl.config.slurm import SlurmConfig

# Slurm sends this signal `signal_delay_s` before the time limit; submitit's
# checkpoint-and-requeue handler listens to the same one.
PREEMPT_SIGNAL = "USR2"
LOG_NAME = "slurm-%j"


class SlurmScriptError(ValueError):
    """The job config cannot be laid out on the Slurm resources it asks for. Names the fields."""


def job_name(slurm: SlurmConfig, run_name: str) -> str:
    """`slurm.job_name`, or `tiderl-` + the run's name."""
    return slurm.job_name or f"tiderl-{run_name}"


def ranks_per_node(slurm: SlurmConfig, num_ranks: int) -> int:
    """Tasks per node of the rank step: one per GPU, or the CPU ranks spread evenly over the nodes."""
    if slurm.gpus_per_node > 0:
        if num_ranks != slurm.nodes * slurm.gpus_per_node:
            raise SlurmScriptError(
                f"launch.num_ranks ({num_ranks}) must equal slurm.nodes ({slurm.nodes}) x "
                f"slurm.gpus_per_node ({slurm.gpus_per_node}): one rank per GPU"
            )
        return slurm.gpus_per_node
    if num_ranks % slurm.nodes:
        raise SlurmScriptError(
            f"launch.num_ranks ({num_ranks}) must be a multiple of slurm.nodes ({slurm.nodes}) for CPU-only ranks"
        )
    return num_ranks // slurm.nodes


# Floors below which a GPU job's host resources look sized for a CPU job (`resource_warnings`). Not limits:
# a job under them is submitted, with a warning.
# Host memory per GPU: a CUDA PyTorch process holds 1-3 GB of host memory before it loads anything (CUDA
# context, kernels, libraries), and every rank moves weights through host memory (loaded from safetensors,
# written at each publish), so less than 4 GB per GPU leaves a rank next to nothing of its own.
MIN_MEM_GB_PER_GPU = 4
# CPUs per GPU rank (one task each): one CPU keeps the GPU fed (kernel launches, the engine's scheduler),
# and the rank's other work (agent loop, tokenizing, env HTTP calls, store transactions and heartbeats)
# needs another; on one CPU they take turns and the GPU waits.
MIN_CPUS_PER_GPU_TASK = 2


def resource_warnings(slurm: SlurmConfig) -> list[str]:
    """Why the `slurm:` resources of a GPU job look CPU-sized (empty: they do not, or no GPUs asked for).

    Pure; thresholds `MIN_MEM_GB_PER_GPU` (memory is per node, `mem_gb / gpus_per_node`) and
    `MIN_CPUS_PER_GPU_TASK` (each GPU rank is one task with `cpus_per_task` CPUs)."""
    if not slurm.gpus_per_node:
        return []
    found: list[str] = []
    mem_gb_per_gpu = slurm.mem_gb / slurm.gpus_per_node
    if mem_gb_per_gpu < MIN_MEM_GB_PER_GPU:
        found.append(
            f"slurm.mem_gb ({slurm.mem_gb}) is {mem_gb_per_gpu:g} GB per GPU for slurm.gpus_per_node "
            f"({slurm.gpus_per_node}), under {MIN_MEM_GB_PER_GPU} GB of host memory per GPU rank (a CUDA "
            f"process alone holds 1-3 GB); --mem is per node: {MIN_MEM_GB_PER_GPU * slurm.gpus_per_node} or more"
        )
    if slurm.cpus_per_task < MIN_CPUS_PER_GPU_TASK:
        found.append(
            f"slurm.cpus_per_task ({slurm.cpus_per_task}) is fewer than {MIN_CPUS_PER_GPU_TASK} CPUs for a GPU "
            "rank: one keeps the GPU fed, the agent loop, tokenizing and store calls need another"
        )
    return found


def sbatch_directives(slurm: SlurmConfig, *, name: str, log_dir: Path, num_tasks_per_node: int) -> list[str]:
    """The `#SBATCH` flags, in a fixed order, each straight from one config field."""
    flags = [
        f"--job-name={name}",
        f"--output={log_dir / LOG_NAME}.out",
        f"--error={log_dir / LOG_NAME}.err",
        # A requeued job appends to its logs instead of truncating what the first attempt wrote.
        "--open-mode=append",
        f"--nodes={slurm.nodes}",
        f"--ntasks-per-node={num_tasks_per_node}",
        f"--cpus-per-task={slurm.cpus_per_task}",
        f"--mem={slurm.mem_gb}G",
        f"--time={slurm.time_min}",
    ]
    if slurm.gpus_per_node:
        flags.append(f"--gpus-per-node={slurm.gpus_per_node}")
    for flag, value in (
        ("partition", slurm.partition),
        ("account", slurm.account),
        ("qos", slurm.qos),
        ("constraint", slurm.constraint),
    ):
        if value is not None:
            flags.append(f"--{flag}={value}")
    flags.append("--requeue" if slurm.requeue else "--no-requeue")
    if slurm.signal_delay_s:
        flags.append(f"--signal={PREEMPT_SIGNAL}@{slurm.signal_delay_s}")
    if slurm.mail_user is not None:
        flags += [f"--mail-user={slurm.mail_user}", f"--mail-type={slurm.mail_type}"]
    flags += slurm.extra_flags
    return flags


def run_command(job_file: Path, run_dir: Path, *, overrides: Sequence[str] = (), python: str = "python") -> list[str]:
    """The command line that runs one job in one run directory: `python -m tiderl run JOB --run-dir DIR`."""
    argv = [python, "-m", "tiderl", "run", str(job_file)]
    for override in overrides:
        argv += ["--set", override]
    return argv + ["--run-dir", str(run_dir)]


def make_sbatch_script(
    slurm: SlurmConfig,
    *,
    name: str,
    log_dir: Path,
    num_tasks_per_node: int,
    command: Sequence[str],
    srun_flags: Sequence[str] = (),
) -> str:
    """A complete sbatch script: directives, the config's setup lines, then one `srun` of `command`."""
    if not command:
        raise SlurmScriptError("the command to run is empty")
    lines = ["#!/bin/bash", "# Generated by TideRL (tiderl.slurm.sbatch); submit with `sbatch FILE`."]
    lines += [f"#SBATCH {flag}" for flag in sbatch_directives(
        slurm, name=name, log_dir=log_dir, num_tasks_per_node=num_tasks_per_node)]
    # -u is left out on purpose: `module` and many activate scripts read unset variables.
    lines += ["", "set -eo pipefail"]
    if slurm.setup:
        lines += ["", "# setup (slurm.setup)"]
        lines += list(slurm.setup)
    # --kill-on-bad-exit: one failed task ends the step, rather than leaving the others waiting for it.
    srun = ["srun", "--unbuffered", "--kill-on-bad-exit=1", *srun_flags, *command]
    lines += ["", shlex.join(srun), ""]
    return "\n".join(lines)
