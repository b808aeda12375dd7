"""The `--set KEY=VALUE` option of every command that loads a job (`tiderl config`, `run`, `submit`), and the
whole-number arguments of the commands.
`tiderl config` itself is `tiderl.config_cli`: it also checks the model, which this package's layer
does not import."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config field, e.g. --set trainer.num_steps=3 (repeatable).")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: a whole number of at least `minimum`, else a message naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value

    return parse
