"""`slurm:` section: how `tiderl submit` asks Slurm for resources. Each field names its sbatch flag."""

from __future__ import annotations

from tiderl.config.schema import option, section


@section
class SlurmConfig:
    partition: str | None = option(None, help="sbatch --partition.")
    account: str | None = option(None, help="sbatch --account.")
    qos: str | None = option(None, help="sbatch --qos.")
    time_min: int = option(60, ge=1, help="sbatch --time, in minutes.")
    nodes: int = option(1, ge=1, help="sbatch --nodes for the rank step.")
    gpus_per_node: int = option(0, ge=0, help="sbatch --gpus-per-node (0: CPU-only ranks).")
    cpus_per_task: int = option(1, ge=1, help="sbatch --cpus-per-task.")
    mem_gb: int = option(8, ge=1, help="sbatch --mem, in GB per node.")
    constraint: str | None = option(None, help="sbatch --constraint.")
    extra_flags: tuple[str, ...] = option((), help="Further sbatch flags, verbatim (e.g. `--exclusive`).")
