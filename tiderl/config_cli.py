"""`tiderl config JOB.yaml [--set k=v ...]`: validate a job file and print the resolved config.

It makes the same check as `tiderl run` and `tiderl submit` (`tiderl.rundir.validate_job`: the run's
name, `env.options`, the engine, then the model's pre-flight checks), so the three accept and refuse the
same configs. With a `model.path` the model checks take seconds (they load transformers and vLLM) and
each rank's memory plan is printed after the config, as `#` comments; with `model.path: null` only the
trainer backend is checked and it stays quick."""

from __future__ import annotations

import argparse

from tiderl.config.cli import add_override_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Job file (jobs/*.yaml).")
    add_override_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tiderl.config import dump_job, load_job
    from tiderl.rundir import validate_job

    job = load_job(args.job, args.overrides)
    plan = validate_job(job)  # the check `tiderl run` and `tiderl submit` make; ConfigError: exit 2 (tiderl.cli)
    print(dump_job(job), end="")
    if plan:
        print(plan, end="")  # `#` lines: the output stays a job file
    return 0
