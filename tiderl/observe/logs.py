"""A run's log files read for `tiderl logs` (the command: `tiderl.observe_cli.logs`).

Every process of a run, local or on Slurm, writes one file in `RUN_DIR/logs/`:
`control.log`, `env{I}.log`, `rank{R}.log` (on Slurm: srun's per-task output),
and for a Slurm run also `slurm-{JOBID}.out`/`.err` (the batch step: launcher
progress, submitit) and `ranks-srun.log` (srun's own messages). Lines are
prefixed with where they come from: `[control]`, `[env0]`, `[rank1 rollout]`,
`[slurm 812]`, `[srun]`; a rank's role is the one it had when it wrote the
line (its last `rank N: role R from version V` since its process started; a
file without one: the rank's role now, from the run store).

A line's time is the timestamp it starts with (`parse_timestamp`); a line
without one (a traceback, a continuation, a progress bar) keeps the time of the
line before it in its file, so it stays under that line. A line redrawn with
carriage returns (a progress bar) shows as its last segment, as a terminal
would. vLLM's own DEBUG and INFO lines and what follows them are engine chatter
(`is_engine_chatter`), shown only on request; its warnings and errors, every
other logger's lines and tracebacks are always shown.

File naming, selection, timestamps, the noise filter and merging are pure
functions; `LogReader` reads the files from where each read stopped.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import AnyStr

from tiderl.roles import Role

_NAMES = (
    ("control", re.compile(r"^control\.log$")),
    ("env", re.compile(r"^env(\d+)\.log$")),
    ("rank", re.compile(r"^rank(\d+)\.log$")),
    ("srun", re.compile(r"^ranks-srun\.log$")),
    ("slurm", re.compile(r"^slurm-(\d+)\.(out|err)$")),
)
_ORDER = {kind: i for i, (kind, _) in enumerate(_NAMES)}

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_QUIET_LEVELS = frozenset({"DEBUG", "INFO"})
ENGINE_LOGGERS = ("vllm",)
_DATE = r"(\d{4})-(\d\d)-(\d\d)"
_TIME = r"(\d\d):(\d\d):(\d\d)"
# Python logging's %(asctime)s, as every basicConfig of the project starts its lines.
_ASCTIME = re.compile(rf"^{_DATE} {_TIME}[,.](\d{{3}})(?!\d)")
# submitit's "%(name)s %(levelname)s (%(asctime)s) - %(message)s" in slurm-*.out/.err.
_SUBMITIT = re.compile(rf"^submitit [A-Z]+ \({_DATE} {_TIME}[,.](\d{{3}})\)")
# Slurm's own messages: "[2026-12-01T13:29:16.353] ...".
_SLURM = re.compile(rf"^\[{_DATE}T{_TIME}(?:\.(\d{{1,6}}))?\]")
# vLLM's format "LEVEL MM-DD HH:MM:SS [file.py:12] msg" (no year), after "(EngineCore pid=7) " in its subprocesses.
_VLLM = re.compile(rf"^(?:\([^)]*\) )?({'|'.join(_LEVELS)}) (\d\d)-(\d\d) {_TIME}(?:\.\d+)? ")
_TRACEBACK = "Traceback (most recent call last):"
# What a rank logs at each change of role, and at each start of its process (tiderl.run.rank).
_ROLE_CHANGE = re.compile(rf": rank \d+: role ({'|'.join(r.value for r in Role)}) from version \d+\s*$")
_RANK_START = re.compile(r": ===== rank \d+ starts: ")


@dataclass(frozen=True, slots=True)
class LogFile:
    """One log file of a run: its kind (control, env, rank, srun, slurm), index (env/rank number, job id)."""

    name: str
    kind: str
    index: int | None = None

    def prefix(self, roles: dict[int, str], line: "LogLine | None" = None, announced: bool = False) -> str:
        """A rank's `line`: its role then (`announced`: its file announces roles), else its role now in `roles`."""
        if self.kind == "rank":
            role = line.role if announced and line is not None else roles.get(self.index)  # type: ignore
            return f"rank{self.index}" + (f" {role}" if role else "")
        if self.kind == "env":
            return f"env{self.index}"
        if self.kind == "slurm":
            return f"slurm {self.index}" + (" err" if self.name.endswith(".err") else "")
        return self.kind


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line as shown: its text (progress-bar redraws resolved) and time (its own, or the latest before it in its
    file; None before the file's first timestamp). `is_engine_chatter`: a vLLM DEBUG/INFO line or what follows one.
    `role`: a rank's role when it wrote the line (None: none announced since its start)."""

    at: datetime | None
    text: str
    is_engine_chatter: bool = False
    role: str | None = None


@dataclass(frozen=True, slots=True)
class Cursor:
    """What reading one file has seen so far, for the lines still to come: the latest time, whether the last stamped
    line was engine chatter, whether a traceback has started since, the rank's role, whether the file announced one."""

    at: datetime | None = None
    is_engine_chatter: bool = False
    in_traceback: bool = False
    role: str | None = None
    roles_announced: bool = False


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


def ranks_text(ranks: Iterable[int]) -> str:
    """`rank 0`, `ranks 0-3`, `ranks 1-2, 5`."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(spans) == 1 and spans[0][0] == spans[0][1] else "ranks ") + text


def selection_problem(*, rank: int | None, role: str | None, num_ranks: int | None, roles: dict[int, str],
                      follow: bool) -> str | None:
    """Why `--rank`/`--role` can never match, naming what the run has; None when it can (now or later).

    `num_ranks` None: the run's rank count is unknown, every rank may exist. A role no rank holds now is fine
    with `-f` (ERS may move a rank to it) and before any rank has registered.
    """
    if rank is not None and num_ranks is not None and not 0 <= rank < num_ranks:
        return f"rank {rank}: the run has {ranks_text(range(num_ranks))}"
    if role is not None and roles and not follow and role not in roles.values():
        holders: dict[str, list[int]] = {}
        for r in sorted(roles):
            holders.setdefault(roles[r], []).append(r)
        now = "; ".join(f"{held}: {ranks_text(ranks)}" for held, ranks in holders.items())
        return f"role {role}: no rank holds it now ({now})"
    return None


def split_lines(pending: AnyStr) -> tuple[list[AnyStr], AnyStr]:
    """Complete lines of `pending` and what is left after its last line break (a line still being written)."""
    *lines, rest = pending.split("\n" if isinstance(pending, str) else b"\n")  # type: ignore[arg-type]
    return lines, rest


def last_segment(line: str) -> str:
    """What a terminal shows of a line redrawn with carriage returns (a progress bar): its last non-blank segment."""
    if "\r" not in line:
        return line
    return next((s for s in reversed(line.split("\r")) if s.strip()), "")


def _at(year: int, month: str, day: str, hour: str, minute: str, second: str, microsecond: int = 0) -> datetime:
    return datetime(year, int(month), int(day), int(hour), int(minute), int(second), microsecond)


def parse_timestamp(line: str, now: datetime) -> datetime | None:
    """The time `line` starts with; None for a line without one (a traceback, a continuation, a progress bar).

    Formats: Python logging's `2026-12-01 13:29:15,123` (every logger of the project), submitit's
    `submitit INFO (2026-12-01 13:29:15,123) - `, Slurm's `[2026-12-01T13:29:16.353]`, and vLLM's
    `INFO 12-01 13:29:15 [file.py:12]` (possibly after `(EngineCore pid=7) `), which has no year: `now`'s,
    or the year before when that would put the line more than a day after `now` (the file's last write).
    """
    try:
        m = _ASCTIME.match(line) or _SUBMITIT.match(line)
        if m:
            g = m.groups()
            return _at(int(g[0]), *g[1:6], microsecond=int(g[6]) * 1000)
        m = _SLURM.match(line)
        if m:
            g = m.groups()
            return _at(int(g[0]), *g[1:6], microsecond=int((g[6] or "0").ljust(6, "0")))
        m = _VLLM.match(line)
        if m:
            at = _at(now.year, *m.groups()[1:6])
            return at.replace(year=now.year - 1) if at > now + timedelta(days=1) else at
    except ValueError:  # digits where a date would be that make no date (month 13, Feb 29 of another year)
        return None
    return None


def _is_engine_logger(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in ENGINE_LOGGERS)


def is_engine_chatter(line: str) -> bool:
    """A stamped line of vLLM at DEBUG or INFO: in vLLM's own format, or through the project's logging formats
    (`... rank1 INFO vllm.x: msg`, `... control INFO name: msg`; the env servers' `... name INFO msg`)."""
    m = _VLLM.match(line)
    if m:
        return m.group(1) in _QUIET_LEVELS
    m = _ASCTIME.match(line)
    if not m:
        return False
    words = line[m.end():].split(None, 3)[:3]
    for i, word in enumerate(words):
        if word in _LEVELS:
            after = words[i + 1] if i + 1 < len(words) else ""
            name = after[:-1] if after.endswith(":") else (words[i - 1] if i > 0 else "")
            return word in _QUIET_LEVELS and _is_engine_logger(name)
    return False


def read_lines(raw: Iterable[str], cursor: Cursor, now: datetime) -> tuple[list[LogLine], Cursor]:
    """Complete lines of one file, in order, from where `cursor` stands; and the cursor after them.

    Times never go back within a file (a line stamped earlier than one before it, e.g. vLLM's whole seconds
    after a millisecond stamp, takes the later time), so each file is a sorted stream for `merge_by_time`.
    An unstamped line belongs to the stamped line before it: it is engine chatter if that line is, except from
    a `Traceback` on, so a crash under an engine line is never hidden. A role: from a rank's `role R` line on."""
    lines = []
    for text in map(last_segment, raw):
        stamp = parse_timestamp(text, now)
        if stamp is not None:
            role, announced = cursor.role, cursor.roles_announced
            change = _ROLE_CHANGE.search(text)
            if change:
                role, announced = change.group(1), True
            elif _RANK_START.search(text):
                role = None
            at = stamp if cursor.at is None else max(cursor.at, stamp)
            cursor = Cursor(at, is_engine_chatter(text), in_traceback=False, role=role, roles_announced=announced)
        elif text.startswith(_TRACEBACK) and not cursor.in_traceback:
            cursor = Cursor(cursor.at, cursor.is_engine_chatter, True, cursor.role, cursor.roles_announced)
        lines.append(LogLine(cursor.at, text, cursor.is_engine_chatter and not cursor.in_traceback, cursor.role))
    return lines, cursor


def shown(lines: Sequence[LogLine], *, engine: bool, last: int | None = None) -> list[LogLine]:
    """The lines to print (engine chatter only with `engine`), the `last` ones of them when given."""
    kept = [line for line in lines if engine or not line.is_engine_chatter]
    return kept if last is None else kept[-last:] if last > 0 else []


def merge_by_time(streams: Sequence[Sequence[LogLine]]) -> list[tuple[int, LogLine]]:
    """(stream index, line) of every line, in time order; each stream keeps its own order, lines before any
    timestamp come first, ties go to the earlier stream. Each stream must be sorted (as `read_lines` makes it)."""
    indexed = [[(i, line) for line in stream] for i, stream in enumerate(streams)]
    return list(heapq.merge(*indexed, key=lambda item: item[1].at or datetime.min))


class LogReader:
    """Reads a run's log files from where each read stopped: byte offset, unfinished last line, cursor."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.offsets: dict[str, int] = {}
        self.pending: dict[str, bytes] = {}
        self.cursors: dict[str, Cursor] = {}

    def announced(self) -> frozenset[str]:  # the files that announce a rank's roles (`read_lines`)
        return frozenset(name for name, c in self.cursors.items() if c.roles_announced)

    def files(self) -> list[LogFile]:
        return classify(p.name for p in self.logs.iterdir()) if self.logs.is_dir() else []

    def read(self, f: LogFile, *, to_end: bool) -> list[LogLine]:
        """Lines of `f` completed since the last read (all of it the first time); with `to_end`, also a last
        line still without its line break, else that one waits for the next read."""
        path = self.logs / f.name
        try:
            stat = path.stat()
            offset = self.offsets.get(f.name, 0)
            if stat.st_size < offset:  # truncated or replaced: start again from its beginning
                offset, self.pending[f.name], self.cursors[f.name] = 0, b"", Cursor()
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offsets[f.name] = offset + len(data)
        complete, rest = split_lines(self.pending.get(f.name, b"") + data)
        if to_end and rest:
            complete, rest = complete + [rest], b""
        self.pending[f.name] = rest
        lines, self.cursors[f.name] = read_lines((c.decode(errors="replace") for c in complete),
                                                 self.cursors.get(f.name, Cursor()),
                                                 datetime.fromtimestamp(stat.st_mtime))
        return lines
