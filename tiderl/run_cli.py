"""`tiderl run JOB.yaml [--set k=v ...] [--run-dir DIR]` and `tiderl run --resume RUN_DIR`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.config.cli import add_override_argument
from tiderl.store.types import RunState

if TYPE_CHECKING:
    from tiderl.run.launcher import Launch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", type=Path, help="Job file (jobs/*.yaml). Not with --resume.")
    add_override_argument(parser)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="Run directory to create (default: launch.runs_dir/NAME-TIMESTAMP).")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="Continue a stopped, crashed or killed run from its store and last checkpoint.")


def run(args: argparse.Namespace) -> int:
    from tiderl.rundir import RunDirError, check_base_model
    from tiderl.run.launcher import LaunchError, prepare, run_launch

    if args.resume is not None and args.job is not None:
        print("tiderl run: give either a job file or --resume RUN_DIR, not both", file=sys.stderr)
        return 2
    try:
        launch = prepare(args.job, args.overrides, args.run_dir, args.resume)
    except (RunDirError, LaunchError) as e:
        print(f"tiderl run: {e}", file=sys.stderr)
        return 2
    if launch.resumed:
        try:
            check_base_model(launch.paths, launch.store)
        except RunDirError as e:
            launch.store.close()
            print(f"tiderl run: {e}", file=sys.stderr)
            return 2
        info = launch.store.run_info()
        if info.state is RunState.FINISHED:
            # Nothing to do, and nothing touched: no process started, no figure rewritten.
            launch.store.close()
            print(f"tiderl run: {args.resume} finished at version {info.version} of "
                  f"{launch.config.trainer.num_steps}: nothing to resume", file=sys.stderr)
            return 0
        print(f"tiderl run: resuming {args.resume} at version {info.version} of "
              f"{launch.config.trainer.num_steps} (it was {info.state.value}"
              + (f": {info.message}" if info.message else "") + ")", file=sys.stderr)
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        return run_launch(launch)
    return _run_in_slurm_job(launch, job_id)


def _run_in_slurm_job(launch: "Launch", job_id: str) -> int:
    """`tiderl run` as the step of a plain sbatch script (slurm/run.sbatch): Slurm's signals stop the run
    cleanly and leave it resumable; SIGUSR2 (`--signal=USR2@N`, the time limit is near) also requeues the
    job, whose script then resumes the run directory."""
    import signal

    from tiderl.run.launcher import Interrupted, run_launch
    from tiderl.slurm.cluster import SlurmCluster

    received: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            raise Interrupted(f"job {job_id} stopped by Slurm ({signal.Signals(signum).name}); "
                              "a requeued job resumes the run")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGUSR2, interrupt)
    code = run_launch(launch)
    if received and received[0] == signal.SIGUSR2:
        SlurmCluster().requeue([job_id])
        print(f"tiderl run: requeued job {job_id}", file=sys.stderr)
    return code
