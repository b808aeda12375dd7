"""`tiderl cancel RUN_DIR`: mark the run cancelled and scancel its Slurm jobs.

The run state goes first: the control plane and the ranks see it and wind down
(for a local run that is all it takes; the launcher then exits 130), and a
launcher stopped by the scancel that follows keeps it (`launcher.run_launch`
never overwrites a cancelled run). Jobs still queued or running are then
cancelled, and with `--wait` (the default) followed until Slurm has ended them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

CANCEL_WAIT_S = 120.0
POLL_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="The run directory.")
    parser.add_argument("--no-wait", dest="wait", action="store_false",
                        help="Return once scancel has been sent, without waiting for the jobs to end.")


def live_job_ids(jobs: list[dict[str, Any]]) -> list[str]:
    """Jobs that may still run: queued, running, or of a state Slurm could not tell."""
    from tiderl.slurm.states import JobState

    live = []
    for job in jobs:
        try:
            if JobState(job["state"]).is_finished:
                continue
        except ValueError:
            pass  # UNKNOWN: cancel it anyway; scancel says if the job is gone
        live.append(job["job_id"])
    return live


def run(args: argparse.Namespace) -> int:
    from tiderl.paths import use_private_umask
    from tiderl.rundir import RunDirError, open_run
    from tiderl.slurm.cluster import SlurmCluster, SlurmError
    from tiderl.slurm.runjobs import cluster_for, recorded_jobs, slurm_jobs_of_run
    from tiderl.store.types import RunState

    try:
        use_private_umask()  # it writes to the run's store
        _, store = open_run(args.run_dir)
    except RunDirError as e:
        print(f"tiderl cancel: {e}", file=sys.stderr)
        return 2
    try:
        state = store.run_info().state
        if state.is_terminal:
            print(f"run {args.run_dir}: already {state.value}")
        else:
            store.set_run_state(RunState.CANCELLED, "cancelled by `tiderl cancel`")
            print(f"run {args.run_dir}: cancelled (was {state.value})")
    finally:
        store.close()
    live = live_job_ids(slurm_jobs_of_run(args.run_dir))
    if not live:
        return 0
    cluster: SlurmCluster = cluster_for(recorded_jobs(args.run_dir))
    try:
        cluster.cancel(live)
    except SlurmError as e:
        print(f"tiderl cancel: scancel of job(s) {', '.join(live)} failed: {e}", file=sys.stderr)
        return 1
    print(f"scancel {' '.join(live)}", flush=True)
    if not args.wait:
        return 0
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        jobs = [j for j in slurm_jobs_of_run(args.run_dir) if j["job_id"] in live]
        if not live_job_ids(jobs) or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    for job in jobs:
        print(f"job {job['job_id']} {job['state']}" + (f" ({job['reason']})" if job["reason"] else ""))
    if live_job_ids(jobs):
        print(f"tiderl cancel: job(s) {', '.join(live_job_ids(jobs))} still not ended after "
              f"{CANCEL_WAIT_S:.0f} s", file=sys.stderr)
        return 1
    return 0
