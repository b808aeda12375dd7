"""Slurm job states, and the text of `sbatch` (plain and `--parsable`), `squeue` and `sacct --parsable2` parsed.

Pure functions over strings; `tiderl.slurm.cluster` runs the commands with the
formats defined here, so parser and command agree.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

# squeue prints one line per job in this format; `%T` is the long state name.
SQUEUE_FORMAT = "%i|%T"
# The same with `%r`, the reason a job waits or ended (`None` when there is none).
SQUEUE_REASON_FORMAT = "%i|%T|%r"
# sacct columns read by `parse_sacct` (any order; the header line names them).
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Elapsed", "NodeList")


class SlurmOutputError(ValueError):
    """A Slurm command printed something this module does not understand. Names the line."""


class JobState(enum.Enum):
    """Job states as squeue's `%T` and sacct's `State` print them (Slurm 22.05)."""

    BOOT_FAIL = "BOOT_FAIL"
    CANCELLED = "CANCELLED"
    COMPLETED = "COMPLETED"
    COMPLETING = "COMPLETING"
    CONFIGURING = "CONFIGURING"
    DEADLINE = "DEADLINE"
    FAILED = "FAILED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    PENDING = "PENDING"
    PREEMPTED = "PREEMPTED"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESIZING = "RESIZING"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    REVOKED = "REVOKED"
    RUNNING = "RUNNING"
    SIGNALING = "SIGNALING"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    SUSPENDED = "SUSPENDED"
    TIMEOUT = "TIMEOUT"

    @property
    def is_finished(self) -> bool:
        """The job will not run again by itself (a requeue would start it anew)."""
        return self in _FINISHED

    @property
    def is_success(self) -> bool:
        return self is JobState.COMPLETED

    @classmethod
    def parse(cls, text: str) -> "JobState":
        """`RUNNING`, `CANCELLED by 0` (sacct names who cancelled), `CANCELLED+` (sacct's truncation mark)."""
        word = text.strip().split(" ", 1)[0].rstrip("+")
        try:
            return cls(word)
        except ValueError as e:
            raise SlurmOutputError(f"unknown Slurm job state {text!r}") from e


_FINISHED = frozenset({
    JobState.BOOT_FAIL, JobState.CANCELLED, JobState.COMPLETED, JobState.DEADLINE, JobState.FAILED,
    JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.PREEMPTED, JobState.REVOKED, JobState.TIMEOUT,
})


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job (or step) as sacct reports it."""

    job_id: str
    state: JobState
    name: str = ""
    exit_code: int | None = None
    exit_signal: int | None = None
    elapsed: str = ""
    nodes: str = ""

    @property
    def is_step(self) -> bool:
        """`123.batch`, `123.0`, `123.extern` are steps; `123` and array tasks `123_4` are jobs."""
        return "." in self.job_id


def parse_sbatch_parsable(text: str) -> str:
    """`sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`: the job id."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise SlurmOutputError("sbatch printed no job id")
    job_id = lines[-1].split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise SlurmOutputError(f"sbatch printed {lines[-1]!r}, expected a job id")
    return job_id


# Plain sbatch prints `Submitted batch job JOBID`, followed by ` on cluster NAME` when the job went to a named
# cluster (--clusters/-M); `--parsable` prints the same two as `JOBID;NAME`.
_SBATCH_CLUSTER = re.compile(r"Submitted batch job [0-9]+ on cluster (?P<cluster>\S+)")


def sbatch_cluster(text: str) -> str | None:
    """The cluster plain sbatch's `Submitted batch job JOBID on cluster NAME` names; None when it names none."""
    found = _SBATCH_CLUSTER.search(text)
    return found.group("cluster") if found else None


def parse_sinfo_nodes(text: str) -> list[str]:
    """`sinfo --noheader --Node --format=%N` -> node names, each once (a node in two partitions prints twice)."""
    names: list[str] = []
    for line in text.splitlines():
        name = line.strip()
        if name and name not in names:
            names.append(name)
    return names


def parse_squeue(text: str) -> dict[str, JobState]:
    """`squeue --noheader --format=%i|%T` -> {job id: state}. Jobs that left the queue are absent."""
    states: dict[str, JobState] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        job_id, sep, state = line.strip().partition("|")
        if not sep or not job_id:
            raise SlurmOutputError(f"squeue line {number}: expected JOBID|STATE, got {line!r}")
        states[job_id] = JobState.parse(state)
    return states


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """One job as `squeue --format=%i|%T|%r` shows it."""

    state: JobState
    reason: str | None = None


def parse_squeue_reasons(text: str) -> dict[str, QueueEntry]:
    """`squeue --noheader --format=%i|%T|%r` -> {job id: state and reason}; squeue's reason `None` is None."""
    entries: dict[str, QueueEntry] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.strip().split("|", 2)
        if len(parts) != 3 or not parts[0]:
            raise SlurmOutputError(f"squeue line {number}: expected JOBID|STATE|REASON, got {line!r}")
        job_id, state, reason = parts
        reason = reason.strip()
        entries[job_id] = QueueEntry(JobState.parse(state), None if reason in ("", "None") else reason)
    return entries


def _exit_code(text: str, number: int) -> tuple[int | None, int | None]:
    if not text:
        return None, None
    code, sep, signal = text.partition(":")
    if not sep or not code.isdigit() or not signal.isdigit():
        raise SlurmOutputError(f"sacct line {number}: ExitCode {text!r} is not CODE:SIGNAL")
    return int(code), int(signal)


def parse_sacct(text: str) -> dict[str, JobRecord]:
    """`sacct --parsable2 --format=...` (with its header line) -> {job or step id: record}.

    A requeued job appears once per attempt; the last row wins, which is the current attempt.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    header = lines[0].split("|")
    for required in ("JobID", "State"):
        if required not in header:
            raise SlurmOutputError(f"sacct header {lines[0]!r} lacks the {required} column")
    records: dict[str, JobRecord] = {}
    for number, line in enumerate(lines[1:], start=2):
        values = line.split("|")
        if len(values) != len(header):
            raise SlurmOutputError(
                f"sacct line {number}: {len(values)} fields, the header has {len(header)}: {line!r}"
            )
        row = dict(zip(header, values))
        exit_code, exit_signal = _exit_code(row.get("ExitCode", ""), number)
        record = JobRecord(
            job_id=row["JobID"],
            state=JobState.parse(row["State"]),
            name=row.get("JobName", ""),
            exit_code=exit_code,
            exit_signal=exit_signal,
            elapsed=row.get("Elapsed", ""),
            nodes=row.get("NodeList", ""),
        )
        records[record.job_id] = record
    return records
