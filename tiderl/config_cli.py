"""`tiderl config JOB.yaml [--set k=v ...]`: validate a job file and print the resolved config.

With a `model.path` it also runs the model's pre-flight checks (`tiderl.models.preflight`: seconds, as
they load transformers and vLLM) and prints each rank's memory plan after the config, as `#` comments;
with `model.path: null` it stays a quick look at the file."""

from __future__ import annotations

import argparse

from tiderl.config.cli import add_override_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Job file (jobs/*.yaml).")
    add_override_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tiderl.config import dump_job, load_job

    job = load_job(args.job, args.overrides)
    plan = None
    if job.model.path is not None:
        from tiderl.models.preflight import check_job

        plan = check_job(job)  # ConfigError: exit 2 (tiderl.cli)
    print(dump_job(job), end="")
    if plan:
        print(plan, end="")  # `#` lines: the output stays a job file
    return 0
