"""`slurm:` section: how `tiderl submit` asks Slurm for resources. Each field names its sbatch flag."""

from __future__ import annotations

import re

from tiderl.config.schema import option, section

# #SBATCH lines are not parsed by a shell: a value with blanks or a line break would
# change what the directive means, so such values are refused at load time.
_WORD = re.compile(r"^\S+$")


@section
class SlurmConfig:
    job_name: str | None = option(None, help="sbatch --job-name (default: `tiderl-` followed by the run's `name`).")
    partition: str | None = option(None, help="sbatch --partition.")
    account: str | None = option(None, help="sbatch --account.")
    qos: str | None = option(None, help="sbatch --qos.")
    time_min: int = option(60, ge=1, help="sbatch --time, in minutes.")
    nodes: int = option(1, ge=1, help="sbatch --nodes for the rank step.")
    gpus_per_node: int = option(
        0,
        ge=0,
        help="sbatch --gpus-per-node, and --ntasks-per-node: one rank per GPU (0: CPU-only ranks, "
        "`launch.num_ranks` spread evenly over the nodes).",
    )
    gpu_memory_gib: float | None = option(
        None, gt=0, help="Memory of one GPU of the nodes, in GiB (an H100: 80): `tiderl config` and `tiderl submit` "
        "check every rank's memory plan against it and refuse a job that does not fit. null: printed, not checked."
    )
    cpus_per_task: int = option(1, ge=1, help="sbatch --cpus-per-task (CPUs of each rank).")
    mem_gb: int = option(8, ge=1, help="sbatch --mem, in GB per node.")
    constraint: str | None = option(None, help="sbatch --constraint.")
    requeue: bool = option(
        True,
        help="sbatch --requeue (true) or --no-requeue: may Slurm requeue the job after preemption or a "
        "node failure (the run resumes from its store and last checkpoint).",
    )
    signal_delay_s: int = option(
        120,
        ge=0,
        help="sbatch --signal=B:USR2@N (`tiderl submit`; USR2@N in plain scripts): seconds before the time "
        "limit at which the run gets SIGUSR2 to stop and requeue itself (0: no warning).",
    )
    max_time_limits: int = option(
        3, ge=0, help="`tiderl submit`: how many times the job requeues itself at its time limit before "
        "it stops (submitit's max_num_timeout); preemptions do not count."
    )
    mail_user: str | None = option(None, help="sbatch --mail-user (no mail when unset).")
    mail_type: str = option("END,FAIL", help="sbatch --mail-type, used only with `mail_user`.")
    setup: tuple[str, ...] = option(
        (),
        help="Shell lines the sbatch script runs before the run starts (e.g. `module load cuda`, "
        "`source .venv/bin/activate`).",
    )
    extra_flags: tuple[str, ...] = option(
        (), help="Further sbatch flags, verbatim (e.g. `--exclusive`, `--gres=gpu:8`; `tiderl submit` takes "
        "long flags only: `--name` or `--name=value`)."
    )

    def __post_init__(self) -> None:
        for name in ("job_name", "partition", "account", "qos", "constraint", "mail_user", "mail_type"):
            value = getattr(self, name)
            if value is not None and not _WORD.match(value):
                raise ValueError(f"{name}: must be one word without blanks or line breaks, got {value!r}")
        for flag in self.extra_flags:
            if not flag.startswith("-") or "\n" in flag:
                raise ValueError(f"extra_flags: each entry is one sbatch flag starting with '-', got {flag!r}")
        for line in self.setup:
            if "\n" in line:
                raise ValueError(f"setup: one shell line per entry (no line breaks), got {line!r}")
        if self.signal_delay_s >= self.time_min * 60:
            raise ValueError(
                f"signal_delay_s: must be shorter than the time limit ({self.time_min * 60} s), "
                f"got {self.signal_delay_s}"
            )
