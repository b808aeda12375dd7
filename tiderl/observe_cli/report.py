"""`tiderl report RUN_DIR [--out DIR]`: write the figures (PNG) and `summary.md` of a run
(`tiderl.observe.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPORT_DIR = "report"  # default output: RUN_DIR/report
QUIET_S = 10.0  # no progress lines into a file or pipe before the report has run this long


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="Run directory (holds run.db); works while the run goes on.")
    parser.add_argument("--out", type=Path, default=None, help="Output directory (default: RUN_DIR/report).")


def run(args: argparse.Namespace) -> int:
    from tiderl.paths import atomic_write_text
    from tiderl.observe.progress import Progress
    from tiderl.observe.report import data as report_data
    from tiderl.observe.report.figures import FIGURES, write_all
    from tiderl.observe.report.summary import render
    from tiderl.observe.status import status_document
    from tiderl.rundir import RunDirError, open_run
    from tiderl.slurm.runjobs import slurm_jobs_of_run

    try:
        _, store = open_run(args.run_dir, read_only=True)
    except RunDirError as e:
        print(f"tiderl report: {e}", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else args.run_dir / REPORT_DIR
    try:
        # Into a log or a pipe, only a report that takes a while says how far it is.
        with Progress("tiderl report", total=len(FIGURES) + 2, unit="steps", quiet_s=QUIET_S) as progress:
            progress.step("reading the run store")
            try:
                data = report_data.load(store)
                diagnosis = status_document(args.run_dir, store, probe=False,
                                            jobs=slurm_jobs_of_run(args.run_dir))["diagnosis"]
            finally:
                store.close()
            figures = write_all(data, out, on_figure=lambda name: progress.step(f"drawing {name}.png"))
            progress.step("writing summary.md")
            summary = out / "summary.md"
            atomic_write_text(summary, render(data, figures, diagnosis))
    except OSError as e:
        print(f"tiderl report: cannot write to {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {summary} and {len(figures)} figures: {', '.join(p.name for p, _ in figures.values())}")
    return 0
