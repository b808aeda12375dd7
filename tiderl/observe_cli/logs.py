"""`tiderl logs RUN_DIR [--rank N | --role R | --control] [-n LINES] [-f] [--by-file] [--engine]`: a run's logs.

Every process of a run writes one file in `RUN_DIR/logs/` (which files, their prefixes, timestamps and
the engine's chatter: `tiderl.observe.logs`). The last `-n` lines of each selected file are merged into
one stream in time order (`--by-file`: one file after the other); vLLM's own DEBUG and INFO lines and
what follows them are hidden unless `--engine` is given.

`-f` prints what is there, then new lines as they are written (merged by time
within each poll), until the run has ended (its state is final and it has no
Slurm job queued or running), Ctrl-C, or the reader of a pipe has gone. A
selection that can never match (`--rank 9` of a 4-rank run, a role no rank
holds, without `-f`) exits 2 naming what exists; a valid one without a file
yet exits 1. Above `run/` and `slurm/`, like the other commands of `tiderl.observe_cli`: it asks Slurm
whether the run's jobs are still queued or running.
"""

from __future__ import annotations

import argparse
import errno
import select as select_io
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tiderl.config.cli import at_least
from tiderl.observe.logs import LogFile, LogLine, LogReader, merge_by_time, select, selection_problem, shown
from tiderl.roles import Role

if TYPE_CHECKING:
    from tiderl.store import RunStore

FOLLOW_POLL_S = 0.5
ROLES_EVERY_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="The run directory.")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=at_least(0), default=None, help="Only this rank's log.")
    which.add_argument("--role", choices=[r.value for r in Role], default=None,
                       help="Only the logs of ranks holding this role now.")
    which.add_argument("--control", action="store_true", help="Only the control plane's log.")
    parser.add_argument("-n", "--lines", type=at_least(0), default=20,
                        help="Lines to show from the end of each file, after filtering (default 20; 0 with -f: "
                             "only new lines).")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="Keep printing new lines until the run has ended (or Ctrl-C).")
    parser.add_argument("--by-file", action="store_true",
                        help="One file after the other instead of all lines merged in time order.")
    parser.add_argument("--engine", action="store_true",
                        help="Also show vLLM's DEBUG/INFO lines (start-up, weight reloads, shutdown); "
                             "hidden by default.")


def _print(batch: list[tuple[LogFile, list[LogLine]]], roles: dict[int, str], out: TextIO, *, by_file: bool,
           announced: frozenset[str]) -> None:
    if by_file:
        items = [(f, line) for f, lines in batch for line in lines]
    else:
        items = [(batch[i][0], line) for i, line in merge_by_time([lines for _, lines in batch])]
    for f, line in items:
        print(f"[{f.prefix(roles, line, f.name in announced)}] {line.text}", file=out)
    out.flush()


def _reader_gone(out: TextIO) -> bool:
    """Whether `out` is a pipe whose reader has closed it (`tiderl logs -f RUN | head`), without writing to it."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (StringIO): nobody to lose
        return False
    poller = select_io.poll()
    poller.register(fd, 0)  # errors and hang-ups are reported whatever is asked
    return any(events & (select_io.POLLERR | select_io.POLLHUP) for _, events in poller.poll(0))


def _roles(store: RunStore) -> dict[int, str]:
    return {r.rank: r.role.value for r in store.ranks()}


def _num_ranks(config: Path, seen: Iterable[int]) -> int | None:
    """The run's rank count: its config's `launch.num_ranks`, or more if ranks beyond it have run; None if unknown."""
    from tiderl.config import ConfigError, load_job

    try:
        configured = load_job(config).launch.num_ranks
    except ConfigError:  # no readable config.yaml (a run dir made by hand or by an old TideRL): don't judge
        return None
    return max([configured, *(r + 1 for r in seen)])


def _selection_name(args: argparse.Namespace) -> str:
    if args.rank is not None:
        return f"rank {args.rank}'s log"
    if args.role is not None:
        return f"the logs of role {args.role}'s ranks"
    return "the control plane's log" if args.control else "the run's logs"


def _run_over(run_dir: Path, store: RunStore) -> bool:
    from tiderl.slurm.cancel import live_job_ids
    from tiderl.slurm.runjobs import slurm_jobs_of_run

    if not store.run_info().state.is_terminal:
        return False
    return not live_job_ids(slurm_jobs_of_run(run_dir))


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    # BrokenPipeError is left to tiderl.cli.main, which ends quietly with 141 like any Unix tool.
    from tiderl.rundir import RunDirError, open_run

    try:
        paths, store = open_run(args.run_dir, read_only=True)
    except RunDirError as e:
        print(f"tiderl logs: {e}", file=sys.stderr)
        return 2
    reader = LogReader(paths.logs)
    try:
        roles = _roles(store)
        files = reader.files()
        seen = set(roles) | {f.index for f in files if f.kind == "rank" and f.index is not None}
        problem = selection_problem(rank=args.rank, role=args.role, num_ranks=_num_ranks(paths.config, seen),
                                    roles=roles, follow=args.follow)
        if problem:
            print(f"tiderl logs: {problem}", file=sys.stderr)
            return 2
        chosen = select(files, rank=args.rank, role=args.role, control=args.control, roles=roles)
        if not chosen and not args.follow:
            print(f"tiderl logs: {_selection_name(args)} not written yet (none in {paths.logs})", file=sys.stderr)
            return 1
        batch = [(f, shown(reader.read(f, to_end=not args.follow), engine=args.engine, last=args.lines))
                 for f in chosen]
        _print(batch, roles, out, by_file=args.by_file, announced=reader.announced())
        if not args.follow:
            return 0
        roles_at = time.monotonic()
        while True:
            over = _run_over(args.run_dir, store)  # read before the last poll, so nothing written is missed
            if time.monotonic() - roles_at >= ROLES_EVERY_S:
                roles, roles_at = _roles(store), time.monotonic()
            if _reader_gone(out):
                raise BrokenPipeError(errno.EPIPE, "the reader of the output has gone")
            chosen = select(reader.files(), rank=args.rank, role=args.role, control=args.control, roles=roles)
            # A file that appeared while following is read from its beginning: all of it is new.
            batch = [(f, shown(reader.read(f, to_end=over), engine=args.engine)) for f in chosen]
            _print(batch, roles, out, by_file=args.by_file, announced=reader.announced())
            if over:
                return 0
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()
