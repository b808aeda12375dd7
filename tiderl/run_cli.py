"""`tiderl run JOB.yaml [--set k=v ...] [--run-dir DIR]`, `tiderl run --resume RUN_DIR [--set k=v ...]` and
`tiderl run --resume RUN_DIR --fork NEW_DIR [--set k=v ...]`."""

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
                        help="Continue a stopped, crashed or killed run from its store and last checkpoint; "
                             "with --set trainer.num_steps=N, extend a finished one to N steps. A --set on resume "
                             "changes the run's config for every process and is recorded in its store, or is "
                             "refused (exit 2) for a key the run was made with (docs/running.md).")
    parser.add_argument("--fork", type=Path, default=None, metavar="NEW_DIR",
                        help="With --resume RUN_DIR: start a new run in NEW_DIR (absent or empty) from RUN_DIR's "
                             "newest complete checkpoint (weights, optimizer state, step), RUN_DIR only read; --set "
                             "changes its config, any key but model.* (docs/running.md).")


def run(args: argparse.Namespace) -> int:
    from tiderl.config import ConfigError
    from tiderl.rundir import RunDirError, check_base_model
    from tiderl.run.launcher import LaunchError, apply_changes, check_steps, prepare, run_launch
    from tiderl.store.engine import StoreError

    if args.resume is not None and args.job is not None:
        print("tiderl run: give either a job file or --resume RUN_DIR, not both", file=sys.stderr)
        return 2
    if args.fork is not None:
        return _fork(args)
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
        steps = launch.config.trainer.num_steps
        try:
            check_steps(launch, info.version)
        except ConfigError as e:
            launch.store.close()
            print(f"tiderl run: config error: {e}", file=sys.stderr)
            return 2
        # A finished run carries on only where an override extends it: a new trainer.num_steps past its version.
        extends = steps > info.version and any(c.key == "trainer.num_steps" for c in launch.changes)
        if info.state is RunState.FINISHED and not extends:
            # Nothing to do, and nothing touched: no process started, no figure rewritten, no override applied.
            launch.store.close()
            ignored = " (the --set overrides were not applied)" if launch.changes else ""
            print(f"tiderl run: {args.resume} finished at version {info.version} of {steps}: nothing to resume"
                  f"{ignored}; to extend it, --set trainer.num_steps=N with N > {info.version}", file=sys.stderr)
            return 0
        try:
            apply_changes(launch, info.version, reopen=info.state is RunState.FINISHED)
        except (ConfigError, StoreError, OSError) as e:
            launch.store.close()
            what = "config error" if isinstance(e, ConfigError) else "the change could not be applied, nothing changed"
            print(f"tiderl run: {what}: {e}", file=sys.stderr)
            return 2
        for change in launch.changes:
            print(f"tiderl run: {change.text()} (recorded in the run store)", file=sys.stderr)
        if info.state is RunState.FINISHED:
            print(f"tiderl run: extending {args.resume} from version {info.version} to {steps}", file=sys.stderr)
        print(f"tiderl run: resuming {args.resume} at version {info.version} of "
              f"{launch.config.trainer.num_steps} (it was {info.state.value}"
              + (f": {info.message}" if info.message else "") + ")", file=sys.stderr)
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        return run_launch(launch)
    return _run_in_slurm_job(launch, job_id)


def _fork(args: argparse.Namespace) -> int:
    """`--resume RUN_DIR --fork NEW_DIR`: a new run from RUN_DIR's newest checkpoint (tiderl.run.fork). In a
    requeued Slurm job (its script runs this command line again) the fork its first attempt made is resumed:
    NEW_DIR, never RUN_DIR."""
    from tiderl.rundir import RunDirError
    from tiderl.run.fork import made_fork, prepare_fork
    from tiderl.run.launcher import run_launch

    if args.resume is None or args.run_dir is not None:
        print("tiderl run: --fork NEW_DIR goes with --resume RUN_DIR (the run to fork), and names the new run's "
              "directory itself (no --run-dir)", file=sys.stderr)
        return 2
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")  # Slurm's count of this job's requeues
    if restarts.isdigit() and int(restarts) > 0 and made_fork(args.resume, args.fork) is not None:
        print(f"tiderl run: job {os.environ.get('SLURM_JOB_ID')} requeued ({restarts}): {args.fork} holds the fork "
              f"of {args.resume} an earlier attempt made; resuming it as it was made (the --set overrides are "
              "in its config already)", file=sys.stderr)
        return run(argparse.Namespace(**vars(args) | {"resume": args.fork, "fork": None, "overrides": []}))
    try:
        launch = prepare_fork(args.resume, args.overrides, args.fork)
    except RunDirError as e:
        print(f"tiderl run: {e}", file=sys.stderr)
        return 2
    origin = launch.store.fork_origin()
    assert origin is not None
    for change in launch.changes:
        print(f"tiderl run: {change.text()} (recorded in the fork's store)", file=sys.stderr)
    print(f"tiderl run: forked {args.resume} at its checkpoint of step {origin.step} into {args.fork}: training "
          f"from version {origin.version} to {launch.config.trainer.num_steps}", file=sys.stderr)
    job_id = os.environ.get("SLURM_JOB_ID")
    return run_launch(launch) if job_id is None else _run_in_slurm_job(launch, job_id)


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
