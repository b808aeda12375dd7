"""`tiderl logs RUN_DIR [--rank N | --role R | --control] [-n LINES] [-f]`: a run's logs, each line prefixed.

Every process of a run, local or on Slurm, writes one file in `RUN_DIR/logs/`:
`control.log`, `env{I}.log`, `rank{R}.log` (on Slurm: srun's per-task output),
and for a Slurm run also `slurm-{JOBID}.out`/`.err` (the batch step: launcher
progress, submitit) and `ranks-srun.log` (srun's own messages). Lines are
prefixed with where they come from: `[control]`, `[env0]`, `[rank1 rollout]`
(the rank's current role from the run store), `[slurm 812]`, `[srun]`.

`-f` prints what is there, then new lines as they are written, until the run
has ended (its state is final and it has no Slurm job queued or running) or
Ctrl-C. File naming and line splitting are pure functions.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tiderl.roles import Role

FOLLOW_POLL_S = 0.5
ROLES_EVERY_S = 2.0

_NAMES = (
    ("control", re.compile(r"^control\.log$")),
    ("env", re.compile(r"^env(\d+)\.log$")),
    ("rank", re.compile(r"^rank(\d+)\.log$")),
    ("srun", re.compile(r"^ranks-srun\.log$")),
    ("slurm", re.compile(r"^slurm-(\d+)\.(out|err)$")),
)
_ORDER = {kind: i for i, (kind, _) in enumerate(_NAMES)}


@dataclass(frozen=True, slots=True)
class LogFile:
    """One log file of a run: its kind (control, env, rank, srun, slurm), index (env/rank number, job id)."""

    name: str
    kind: str
    index: int | None = None

    def prefix(self, roles: dict[int, str]) -> str:
        if self.kind == "rank":
            role = roles.get(self.index)  # type: ignore[arg-type]
            return f"rank{self.index}" + (f" {role}" if role else "")
        if self.kind == "env":
            return f"env{self.index}"
        if self.kind == "slurm":
            return f"slurm {self.index}" + (" err" if self.name.endswith(".err") else "")
        return self.kind


def classify(names: Iterable[str]) -> list[LogFile]:
    """The run's log files among `names`, in a fixed order (control, env, ranks, srun, slurm); others ignored."""
    found = []
    for name in names:
        for kind, pattern in _NAMES:
            m = pattern.match(name)
            if m:
                found.append(LogFile(name, kind, int(m.group(1)) if m.groups() else None))
                break
    return sorted(found, key=lambda f: (_ORDER[f.kind], f.index or 0, f.name))


def select(files: list[LogFile], *, rank: int | None = None, role: str | None = None, control: bool = False,
           roles: dict[int, str] | None = None) -> list[LogFile]:
    """The files one of `--rank`, `--role`, `--control` asks for (all of them when none is given)."""
    if rank is not None:
        return [f for f in files if f.kind == "rank" and f.index == rank]
    if role is not None:
        return [f for f in files if f.kind == "rank" and (roles or {}).get(f.index) == role]  # type: ignore
    if control:
        return [f for f in files if f.kind == "control"]
    return files


def split_lines(pending: str) -> tuple[list[str], str]:
    """Complete lines of `pending` and what is left after its last line break (a line still being written)."""
    *lines, rest = pending.split("\n")
    return lines, rest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="The run directory.")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=None, help="Only this rank's log.")
    which.add_argument("--role", choices=[r.value for r in Role], default=None,
                       help="Only the logs of ranks holding this role now.")
    which.add_argument("--control", action="store_true", help="Only the control plane's log.")
    parser.add_argument("-n", "--lines", type=int, default=20, help="Lines to show from the end of each file.")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="Keep printing new lines until the run has ended (or Ctrl-C).")


class _Follower:
    def __init__(self, run_dir: Path, out: TextIO) -> None:
        self.logs = run_dir / "logs"
        self.out = out
        self.offsets: dict[str, int] = {}
        self.pending: dict[str, str] = {}

    def files(self) -> list[LogFile]:
        return classify(p.name for p in self.logs.iterdir()) if self.logs.is_dir() else []

    def show_tail(self, f: LogFile, n: int, roles: dict[int, str], *, follow: bool) -> None:
        """The last `n` lines; a last line without its line break yet is kept for `poll` when following."""
        data = (self.logs / f.name).read_bytes()
        self.offsets[f.name] = len(data)
        lines, rest = split_lines(data.decode(errors="replace"))
        if rest and not follow:
            lines, rest = lines + [rest], ""
        self.pending[f.name] = rest
        for line in lines[-n:] if n > 0 else []:
            print(f"[{f.prefix(roles)}] {line}", file=self.out)

    def poll(self, f: LogFile, roles: dict[int, str]) -> int:
        path = self.logs / f.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0
        offset = self.offsets.get(f.name, 0)
        if size < offset:  # truncated or replaced: start again from its beginning
            offset, self.pending[f.name] = 0, ""
        if size == offset:
            return 0
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(size - offset)
        self.offsets[f.name] = offset + len(data)
        lines, self.pending[f.name] = split_lines(self.pending.get(f.name, "") + data.decode(errors="replace"))
        for line in lines:
            print(f"[{f.prefix(roles)}] {line}", file=self.out)
        self.out.flush()
        return len(lines)


def _roles(store: object) -> dict[int, str]:
    return {int(r["rank"]): str(r["role"]) for r in store.ranks()}  # type: ignore[attr-defined]


def _run_over(run_dir: Path, store: object) -> bool:
    from tiderl.slurm.cancel import live_job_ids
    from tiderl.slurm.runjobs import slurm_jobs_of_run
    from tiderl.store.types import RunState

    if not RunState(store.run_info()["state"]).is_terminal:  # type: ignore[attr-defined]
        return False
    return not live_job_ids(slurm_jobs_of_run(run_dir))


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from tiderl.rundir import RunDirError, open_run

    try:
        _, store = open_run(args.run_dir)
    except RunDirError as e:
        print(f"tiderl logs: {e}", file=sys.stderr)
        return 2
    follower = _Follower(args.run_dir, out)
    try:
        roles = _roles(store)
        chosen = select(follower.files(), rank=args.rank, role=args.role, control=args.control, roles=roles)
        if not chosen and not args.follow:
            print(f"tiderl logs: {args.run_dir / 'logs'}: no log file of that selection yet", file=sys.stderr)
            return 1
        for f in chosen:
            follower.show_tail(f, args.lines, roles, follow=args.follow)
        out.flush()
        if not args.follow:
            return 0
        roles_at = time.monotonic()
        while True:
            over = _run_over(args.run_dir, store)  # read before the last poll, so nothing written is missed
            if time.monotonic() - roles_at >= ROLES_EVERY_S:
                roles, roles_at = _roles(store), time.monotonic()
            for f in select(follower.files(), rank=args.rank, role=args.role, control=args.control, roles=roles):
                if f.name not in follower.offsets:
                    follower.offsets[f.name] = 0  # a file that appeared while following: all of it is new
                follower.poll(f, roles)
            if over:
                return 0
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()
