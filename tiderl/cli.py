"""`tiderl` command line. Each subcommand lives in its subsystem's module and is
registered here by name. Command modules keep heavy imports (torch, vLLM) inside
`run`, so building the parser stays fast."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tiderl import __version__
from tiderl.config import ConfigError

# name -> (module, help). The module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("tiderl.config_cli", "Validate a job file (with --set overrides) and print the resolved config."),
    "status": ("tiderl.observe_cli.status", "Show a run's state, version, ranks, buffer and goodput."),
    "report": ("tiderl.observe_cli.report", "Write a run's figures (PNG) and Markdown summary: goodput, rewards, waits, roles."),
    "sim": ("tiderl.sim.cli", "Simulate systems at cluster scale with the real CTB/RA2P/ERS policies."),
    "plan": ("tiderl.sim.plan_cli", "Predict goodput, split and cost per million tokens over GPUs x groups x staleness, and recommend one."),
    "env": ("tiderl.envs.cli", "Environment service: `tiderl env serve --env NAMES --port P`."),
    "init-model": ("tiderl.models.cli_init_model", "Build (or find cached) the tiny warm-started policy model for an environment."),
    "run": ("tiderl.run_cli", "Run a job as local processes (env servers, control plane, ranks); --resume RUN_DIR continues one."),
    "submit": ("tiderl.slurm.cli", "Submit a job to Slurm (submitit): one job, ranks as one srun step; --wait follows it."),
    "samples": ("tiderl.samples", "Show a run's trajectories as text, turn by turn, with reward and advantage."),
    "logs": ("tiderl.observe_cli.logs", "Show or follow (-f) a run's logs, local or Slurm, with rank and role prefixes."),
    "cancel": ("tiderl.slurm.cancel", "Cancel a run: its Slurm jobs (scancel) and its run state."),
}

EXIT_CONFIG_ERROR = 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiderl",
        description="TideRL: asynchronous multi-turn agentic RL on Slurm (CTB, RA2P, ERS).",
    )
    parser.add_argument("--version", action="version", version=f"tiderl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `tiderl`: what there is to run
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:
        print(f"tiderl {args.command}: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except BrokenPipeError:
        # `tiderl logs RUN | head`: the reader has gone. Quiet, like any Unix tool; the interpreter
        # would otherwise fail again flushing stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as e:
        # A store damaged (or emptied) under a command that had opened it: one line naming the file and
        # what to do, as when the damage is found at opening (tiderl.rundir.open_run), not a traceback.
        from tiderl.store.engine import failure_line

        line = failure_line(e)
        if line is None:
            raise
        print(f"tiderl {args.command}: {line}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
