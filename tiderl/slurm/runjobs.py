"""The Slurm jobs of a run: recorded by `tiderl submit` in `RUN_DIR/slurm/jobs.json`, states from squeue/sacct.

    RUN_DIR/slurm/jobs.json   {"jobs": [{"job_id": "812", "submitted_at": 1.7e9, "job_name": "tiderl-x",
                                         "slurm_conf": "/etc/slurm/slurm.conf"}, ...]}
    RUN_DIR/slurm/            submitit's folder: the sbatch script, pickles, `JOBID_0_log.{out,err}`

`slurm_jobs_of_run` is what `tiderl status` shows beside the run state; it never
raises for Slurm being missing or silent (the state reads UNKNOWN and the reason
says why). `job_states` is the pure part: recorded ids, squeue and sacct in, one
dict per job out.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiderl.paths import atomic_write_text
from tiderl.slurm.cluster import SlurmCluster, SlurmError, subprocess_runner
from tiderl.slurm.states import JobRecord, QueueEntry, SlurmOutputError

SLURM_DIR = "slurm"
JOBS_FILE = "jobs.json"
UNKNOWN = "UNKNOWN"


class RunJobsError(RuntimeError):
    """`RUN_DIR/slurm/jobs.json` is not what `tiderl submit` writes. Names the file."""


def slurm_dir(run_dir: Path) -> Path:
    """The run's Slurm folder: submitit's files and the job list."""
    return Path(run_dir) / SLURM_DIR


def jobs_file(run_dir: Path) -> Path:
    return slurm_dir(run_dir) / JOBS_FILE


def recorded_jobs(run_dir: Path) -> list[dict[str, Any]]:
    """The jobs `tiderl submit` recorded for this run, oldest first; [] for a run not submitted to Slurm."""
    path = jobs_file(run_dir)
    if not path.exists():
        return []
    try:
        doc = json.loads(path.read_text())
        jobs = doc["jobs"]
        if not isinstance(jobs, list) or not all(isinstance(j, dict) and str(j.get("job_id", "")) for j in jobs):
            raise TypeError("`jobs` must be a list of objects with a `job_id`")
    except (ValueError, KeyError, TypeError) as e:
        raise RunJobsError(f"{path}: not a job list written by `tiderl submit`: {e}") from e
    return jobs


def record_job(run_dir: Path, job_id: str, *, job_name: str, slurm_conf: str | None) -> None:
    """Add a submitted job to the run's job list (written to a temporary file, then renamed)."""
    jobs = recorded_jobs(run_dir)
    jobs.append({"job_id": str(job_id), "submitted_at": time.time(), "job_name": job_name,
                 "slurm_conf": slurm_conf})
    atomic_write_text(jobs_file(run_dir), json.dumps({"jobs": jobs}, indent=1) + "\n")


def job_states(job_ids: Sequence[str], queue: dict[str, QueueEntry],
               accounting: dict[str, JobRecord]) -> list[dict[str, Any]]:
    """One `{"job_id", "state", "reason"}` per job: squeue first (current, with its reason), else sacct."""
    states = []
    for job_id in job_ids:
        if job_id in queue:
            entry = queue[job_id]
            states.append({"job_id": job_id, "state": entry.state.value, "reason": entry.reason})
        elif job_id in accounting:
            record = accounting[job_id]
            reason = None
            if record.state.is_finished and not record.state.is_success and record.exit_code is not None:
                reason = f"exit code {record.exit_code}" + (f", signal {record.exit_signal}"
                                                           if record.exit_signal else "")
            states.append({"job_id": job_id, "state": record.state.value, "reason": reason})
        else:
            states.append({"job_id": job_id, "state": UNKNOWN, "reason": "neither squeue nor sacct knows the job"})
    return states


def cluster_for(jobs: list[dict[str, Any]]) -> SlurmCluster:
    # Every Slurm client needs SLURM_CONF; a shell that lacks it still finds the cluster the job went to.
    conf = next((j.get("slurm_conf") for j in reversed(jobs) if j.get("slurm_conf")), None)
    if conf and "SLURM_CONF" not in os.environ:
        return SlurmCluster(functools.partial(subprocess_runner, env={"SLURM_CONF": conf}))
    return SlurmCluster()


def slurm_jobs_of_run(run_dir: Path, cluster: SlurmCluster | None = None) -> list[dict[str, Any]]:
    """The run's Slurm jobs, each `{"job_id": str, "state": str, "reason": str | None}` with its current state.

    [] when the run was not submitted through Slurm. When Slurm's commands are missing or fail, each job
    reads state "UNKNOWN" and the reason says what went wrong. A malformed job list raises RunJobsError.
    """
    jobs = recorded_jobs(run_dir)
    if not jobs:
        return []
    job_ids = [str(j["job_id"]) for j in jobs]
    cluster = cluster or cluster_for(jobs)
    try:
        queue = cluster.queue_reasons(job_ids)
        missing = [j for j in job_ids if j not in queue]
        accounting = cluster.accounting(missing) if missing else {}
    except (SlurmError, SlurmOutputError, OSError) as e:
        return [{"job_id": j, "state": UNKNOWN, "reason": f"cannot ask Slurm: {e}"} for j in job_ids]
    return job_states(job_ids, queue, accounting)
