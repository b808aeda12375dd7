"""`tiderl config JOB.yaml [--set k=v ...]`: validate a job file and print the resolved config."""

from __future__ import annotations

import argparse


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config field, e.g. --set trainer.num_steps=3 (repeatable).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Job file (jobs/*.yaml).")
    add_override_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tiderl.config import dump_job, load_job

    print(dump_job(load_job(args.job, args.overrides)), end="")
    return 0
