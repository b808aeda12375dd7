"""Slurm commands (sbatch, squeue, sacct, scancel, scontrol) behind one small interface.

All the mechanism of talking to Slurm is here; the text each command takes and
prints is built and parsed by the pure `tiderl.slurm.sbatch` and
`tiderl.slurm.states`. Every command goes through one `Runner` (argv in,
stdout out), which unit tests replace with a function of their own.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tiderl.slurm.fit import NODE_FORMAT, NodeInfo, PartitionInfo, parse_nodes, parse_partitions
from tiderl.slurm.states import (
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    SQUEUE_REASON_FORMAT,
    JobRecord,
    JobState,
    QueueEntry,
    parse_sacct,
    parse_sbatch_parsable,
    parse_sinfo_nodes,
    parse_squeue,
    parse_squeue_reasons,
)

Runner = Callable[[Sequence[str]], str]

COMMAND_TIMEOUT_S = 60.0


class SlurmError(Exception):
    """Base of the errors of talking to Slurm."""


class SlurmUnavailable(SlurmError):
    """A Slurm command is not installed, or the controller does not answer."""


class SlurmCommandError(SlurmError):
    """A Slurm command exited non-zero. Carries the command, its exit status and stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, stdout: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        # Some commands (scontrol ping) say what is wrong on stdout only.
        said = stderr.strip() or stdout.strip() or "(no output)"
        super().__init__(f"`{' '.join(argv)}` exited {returncode}: {said}")


def subprocess_runner(argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S,
                      env: Mapping[str, str] | None = None) -> str:
    """Run one Slurm command (with `env` added to this process's environment); its stdout, or a named
    error saying what failed and why."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                              env={**os.environ, **env} if env else None)
    except FileNotFoundError as e:
        raise SlurmUnavailable(
            f"`{argv[0]}` not found: Slurm's client commands are not installed on this machine "
            "(for a development cluster run slurm/dev-cluster-start.sh)"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise SlurmUnavailable(f"`{' '.join(argv)}` gave no answer in {timeout_s:.0f} s: is slurmctld up?") from e
    if done.returncode != 0:
        raise SlurmCommandError(argv, done.returncode, done.stderr, done.stdout)
    return done.stdout


class SlurmCluster:
    """The Slurm controller, as seen from its client commands. Set SLURM_CONF where the cluster needs it."""

    def __init__(self, runner: Runner = subprocess_runner) -> None:
        self._run = runner

    def ping(self) -> None:
        """Return when the controller answers; SlurmUnavailable otherwise."""
        try:
            out = self._run(["scontrol", "ping"])
        except SlurmCommandError as e:
            raise SlurmUnavailable(f"the Slurm controller does not answer: {e}") from e
        if not re.search(r"\bis UP\b", out):
            raise SlurmUnavailable(f"the Slurm controller does not answer: {out.strip()}")

    def node_names(self) -> list[str]:
        """The cluster's nodes, in sinfo's order."""
        return parse_sinfo_nodes(self._run(["sinfo", "--noheader", "--Node", "--format=%N"]))

    def partitions(self) -> list[PartitionInfo]:
        """Every partition with its limits (`scontrol show partition --oneliner`)."""
        return parse_partitions(self._run(["scontrol", "show", "partition", "--oneliner"]))

    def partition_nodes(self, partition: str) -> list[NodeInfo]:
        """The nodes of a partition with their CPUs, memory and GPUs."""
        return parse_nodes(self._run(["sinfo", "--noheader", "--Node", f"--partition={partition}",
                                      f"--format={NODE_FORMAT}"]))

    def submit(self, script: Path) -> str:
        """`sbatch` a script file; the job id."""
        return parse_sbatch_parsable(self._run(["sbatch", "--parsable", str(script)]))

    def queue(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        """States of the given jobs still in the queue (pending, running, completing)."""
        if not job_ids:
            return {}
        try:
            out = self._run(["squeue", "--noheader", f"--format={SQUEUE_FORMAT}", "--jobs=" + ",".join(job_ids)])
        except SlurmCommandError as e:
            # squeue fails, rather than printing nothing, when every job asked for has left the queue.
            if "Invalid job id" in e.stderr:
                return {}
            raise
        return parse_squeue(out)

    def queue_reasons(self, job_ids: Sequence[str]) -> dict[str, QueueEntry]:
        """Like `queue`, with the reason squeue gives (why a job waits: `Resources`, `BeginTime`, ...)."""
        if not job_ids:
            return {}
        try:
            out = self._run(["squeue", "--noheader", f"--format={SQUEUE_REASON_FORMAT}",
                             "--jobs=" + ",".join(job_ids)])
        except SlurmCommandError as e:
            if "Invalid job id" in e.stderr:
                return {}
            raise
        return parse_squeue_reasons(out)

    def accounting(self, job_ids: Sequence[str]) -> dict[str, JobRecord]:
        """sacct records of the given jobs and their steps, finished or not."""
        if not job_ids:
            return {}
        out = self._run([
            "sacct", "--parsable2", "--format=" + ",".join(SACCT_FIELDS), "--jobs=" + ",".join(job_ids),
        ])
        return parse_sacct(out)

    def state(self, job_id: str) -> JobState | None:
        """The job's state from accounting (what submitit reads too); None before sacct knows the job."""
        record = self.accounting([job_id]).get(job_id)
        return record.state if record else None

    def wait(self, job_id: str, *, timeout_s: float, poll_s: float = 0.5,
             until: Callable[[JobState], bool] = lambda s: s.is_finished) -> JobState:
        """Poll accounting until `until(state)` holds; SlurmError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state(job_id)
            if state is not None and until(state):
                return state
            if time.monotonic() >= deadline:
                raise SlurmError(f"job {job_id}: still {state.value if state else 'unknown to sacct'} "
                                 f"after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def cancel(self, job_ids: Sequence[str], *, signal: str | None = None, batch_only: bool = False) -> None:
        """`scancel` the jobs (or send them `signal`, e.g. USR2, without ending them). `batch_only`: signal
        only the batch step's own process, as `--signal=B:...` does before the time limit."""
        if not job_ids:
            return
        argv = ["scancel"] + (["--batch"] if batch_only else []) + ([f"--signal={signal}"] if signal else [])
        argv += list(job_ids)
        self._run(argv)

    def requeue(self, job_ids: Sequence[str]) -> None:
        """`scontrol requeue`: end the running attempt and queue the job again (what preemption does)."""
        if job_ids:
            self._run(["scontrol", "requeue", ",".join(job_ids)])
