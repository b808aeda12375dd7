"""Child processes of a local run: each in its own process group, logs in RUN_DIR/logs, stopped cleanly.

A child gets SIGKILL from the kernel if the launcher dies (PR_SET_PDEATHSIG),
so a killed launcher leaves no rank behind; `stop` signals the whole process
group of each child (a rank's vLLM engine-core process included). The
grandchildren of a killed launcher (a rank's vLLM engine core) do not inherit
PR_SET_PDEATHSIG; `reap_leftovers` kills what is left of a run's processes
before the run resumes, found two ways: every child carries `TIDERL_RUN_DIR`
in its environment, which its own children inherit unless they are started
with an environment of their own (vLLM's CPU engine core is: two were found
alive, untagged, after a launcher was killed), and every child leads its own
session, which its children keep whatever their environment, so a process
whose session leader was a rank the run store recorded, and is gone, is a
leftover too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def launcher_child_setup() -> None:
    """preexec_fn of every child the launcher (or a rank's supervisor) starts. Two things: the child dies
    with its parent (PR_SET_PDEATHSIG: SIGKILL), and it ignores SIGUSR2: Slurm's time-limit warning of a plain sbatch run (`--signal=USR2@N`) reaches every process of the
    step, and only the launcher acts on it (it stops the children with SIGTERM and requeues the job). A child
    that died of it first made the launcher record the run as failed. The disposition holds across exec, for
    the child's own children too (a rank's vLLM engine core)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll()


RUN_DIR_ENV = "TIDERL_RUN_DIR"


def launch_marker(name: str, note: str) -> str:
    """The line a child's log starts each launch with (logging's time format, so `tiderl logs` sorts it)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
    return f"{stamp} {name} INFO tiderl.launcher: ===== {note} =====\n"


def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
          marker: str | None = None) -> Child:
    """Start `argv` with its output appended to `log_path`, after a `marker` line (see `launch_marker`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        if marker is not None:
            log.write(launch_marker(name, marker).encode())
            log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=launcher_child_setup,
                                env={**os.environ, **(env or {})})
    return Child(name, proc, log_path)


STOP_GRACE_S = 10.0


def stop(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child's process group, then SIGKILL what is still there after `grace_s`."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # past the grace period: SIGKILL below
        _signal_group(child, signal.SIGKILL)
        child.proc.wait()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except ProcessLookupError:
        pass  # already gone, with its whole group


def reap_leftovers(run_dir: Path, sessions: Collection[int] = ()) -> list[int]:
    """SIGKILL every process of this user left by a killed launcher of `run_dir`: tagged with it, or in
    one of `sessions` (the pids of the run's ranks on this host, each its session's leader) whose leader
    is gone (a live leader of that number is another process that reused the pid)."""
    tag = f"{RUN_DIR_ENV}={Path(run_dir).resolve()}".encode() + b"\0"
    me, uid = os.getpid(), os.getuid()
    orphaned = {sid for sid in sessions if sid > 0 and not _running(Path(f"/proc/{sid}"))}
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            if tag not in (entry / "environ").read_bytes() + b"\0" and _session(entry) not in orphaned:
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return killed


def _stat(proc_dir: Path) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    [0] the state, [3] the session id."""
    stat = (proc_dir / "stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def _running(proc_dir: Path) -> bool:
    """The process exists and is not a zombie waiting for its parent."""
    try:
        return _stat(proc_dir)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _session(proc_dir: Path) -> int:
    return int(_stat(proc_dir)[3])
