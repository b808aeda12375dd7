"""The `--set KEY=VALUE` option of every command that loads a job (`tiderl config`, `run`, `submit`).
`tiderl config` itself is `tiderl.config_cli`: it also checks the model, which this package's layer
does not import."""

from __future__ import annotations

import argparse


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config field, e.g. --set trainer.num_steps=3 (repeatable).")
