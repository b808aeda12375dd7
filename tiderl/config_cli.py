"""`tiderl config JOB.yaml [--set k=v ...]`: validate a job file and print the resolved config.

With a `model.path` it also runs the model's pre-flight checks (`tiderl.models.preflight`: seconds, as
they load transformers and vLLM); with `model.path: null` it stays a quick look at the file."""

from __future__ import annotations

import argparse

from tiderl.config.cli import add_override_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="Job file (jobs/*.yaml).")
    add_override_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tiderl.config import dump_job, load_job

    job = load_job(args.job, args.overrides)
    if job.model.path is not None:
        from tiderl.models.preflight import check_job

        check_job(job)  # ConfigError: exit 2 (tiderl.cli)
    print(dump_job(job), end="")
    return 0
