"""`tiderl status RUN_DIR [--json] [--check] [--watch [S]]`: run state, version, ranks and roles,
buffer, goodput, the run's Slurm jobs, and a diagnosis of who waits for what (`tiderl.observe.status`,
`tiderl.observe.diagnose`).

`--check` prints a one-line verdict plus the findings and exits 1 when the run
is stalled or a finding is an error (for a cron job or a Slurm epilog), 3 when
the run was cancelled, 0 otherwise, 2 when RUN_DIR is not a run or its run.db
is corrupt. A directory holding run directories (`runs/`) lists its runs. The store is
opened read-only: a run directory one may only read can be inspected. `--watch` redraws the status every few seconds.
Above `run/` and `slurm/`: the status document is theirs too (the launcher's progress, `submit --wait`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tiderl.observe.status import render, render_diagnosis, status_document, verdict
from tiderl.slurm.runjobs import slurm_jobs_of_run

EXIT_OK, EXIT_ATTENTION, EXIT_NOT_A_RUN, EXIT_CANCELLED = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="Run directory (holds run.db).")
    parser.add_argument("--json", action="store_true",
                        help="Print one JSON object instead of tables (with --watch: one per line, JSON Lines).")
    parser.add_argument("--check", action="store_true",
                        help="Print a one-line verdict and the findings; exit 1 if the run is stalled or a finding "
                             "is an error, 3 if it was cancelled.")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="Redraw every SECONDS (default 2) until Ctrl-C.")
    parser.add_argument("--stall-after-s", type=float, default=None,
                        help="Stalled after this many seconds without a new version (default: the run's "
                             "monitor.stall_after_s).")
    parser.add_argument("--no-probe", action="store_true", help="Do not ask the env servers for /health.")


def _show(args: argparse.Namespace, store: Any, out: TextIO) -> int:
    doc = status_document(args.run_dir, store, stall_after_s=args.stall_after_s, probe=not args.no_probe,
                          jobs=slurm_jobs_of_run(args.run_dir))
    if args.json:
        text = json.dumps(doc, default=str)
    elif args.check:
        # The verdict line already says stalled and why.
        text = "\n".join([verdict(doc), *render_diagnosis(doc["diagnosis"], skip=("stalled",))[1:]])
    else:
        text = render(doc)
    print(text, file=out, flush=True)
    if args.check and doc["diagnosis"]["needs_attention"]:
        return EXIT_ATTENTION
    return EXIT_CANCELLED if args.check and doc["state"] == "cancelled" else EXIT_OK


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from tiderl.rundir import RunDirError, open_run

    out = out or sys.stdout
    try:
        _, store = open_run(args.run_dir, read_only=True)
    except RunDirError as e:
        from tiderl.runlist import list_runs, render_runs

        runs = list_runs(args.run_dir)
        if runs and args.watch is None and not args.check:  # a directory of runs (`runs/`): one line each
            print(json.dumps(runs) if args.json else render_runs(runs), file=out, flush=True)
            return EXIT_OK
        print(f"tiderl status: {e}", file=sys.stderr)
        return EXIT_NOT_A_RUN
    try:
        if args.watch is None:
            return _show(args, store, out)
        if args.watch <= 0:
            print(f"tiderl status: --watch: expected a positive number of seconds, got {args.watch}",
                  file=sys.stderr)
            return EXIT_NOT_A_RUN
        is_tty = out.isatty()
        code = EXIT_OK
        try:
            while True:
                if not args.json:  # --json --watch is JSON Lines: one document per line, nothing else
                    if is_tty:
                        print("\x1b[H\x1b[2J", end="", file=out)  # cursor home, clear screen
                    print(time.strftime("%H:%M:%S"), file=out)
                code = _show(args, store, out)
                time.sleep(args.watch)
        except KeyboardInterrupt:
            return code
    finally:
        store.close()
