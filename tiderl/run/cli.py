"""`tiderl run JOB.yaml [--set k=v ...] [--run-dir DIR]` and `tiderl run --resume RUN_DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiderl.config.cli import add_override_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", type=Path, help="Job file (jobs/*.yaml). Not with --resume.")
    add_override_argument(parser)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="Run directory to create (default: launch.runs_dir/NAME-TIMESTAMP).")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="Continue a stopped, crashed or killed run from its store and last checkpoint.")


def run(args: argparse.Namespace) -> int:
    import sys

    from tiderl.rundir import RunDirError
    from tiderl.run.launcher import LaunchError, prepare, run_launch

    if args.resume is not None and args.job is not None:
        print("tiderl run: give either a job file or --resume RUN_DIR, not both", file=sys.stderr)
        return 2
    try:
        launch = prepare(args.job, args.overrides, args.run_dir, args.resume)
    except (RunDirError, LaunchError) as e:
        print(f"tiderl run: {e}", file=sys.stderr)
        return 2
    return run_launch(launch)
