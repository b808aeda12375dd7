"""The fault campaign's processes (tools/chaos.py): a launcher's children found by their command line,
signalled by process group, stopped with a grace period, and whatever a run left behind reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

STOP_S = 30.0  # a launcher stopping its children (SIGINT) gets this long before SIGKILL


class ChaosError(RuntimeError):
    """A trial could not set up or inject its fault; the message says what."""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def child_of(launcher: int, needle: str) -> int:
    pids = [p for p in _children(launcher) if needle in _cmdline(p)]
    if not pids:
        raise ChaosError(f"no child of launcher {launcher} runs {needle!r}")
    return pids[0]


def _default_sigint() -> None:
    """In a child before exec: SIGINT back to its default. A background job of a shell starts with
    SIGINT ignored, and the launcher would inherit that and never stop on the SIGINT it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGINT, grace_s: float = STOP_S) -> None:
    """`sig` to a child still running (a launcher stops its own children on SIGINT), SIGKILL to its
    process group after `grace_s`."""
    if proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGCONT)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def reap_run(run_dir: Path) -> list[int]:
    """What is left of a run's processes (tagged with TIDERL_RUN_DIR, or in the session of a rank that is
    gone, as the launcher's resume finds them): continued, then SIGKILLed."""
    from tiderl.run.launcher import rank_sessions
    from tiderl.run.procs import reap_leftovers
    from tiderl.store import RunStore, StoreError

    tag = f"TIDERL_RUN_DIR={run_dir.resolve()}".encode()
    for entry in Path("/proc").iterdir():  # a stopped process dies of SIGKILL too; continue it anyway
        try:
            if entry.name.isdigit() and tag in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGCONT)
        except (OSError, ProcessLookupError):
            continue
    sessions: list[int] = []
    if (run_dir / "run.db").is_file():  # else a trial that failed before the run started: the tags find it all
        try:
            store = RunStore.for_run_dir(run_dir, read_only=True)
            try:
                sessions = rank_sessions(store)
            finally:
                store.close()
        except StoreError as e:
            print(f"chaos: the ranks' sessions of {run_dir} could not be read ({e}): reaping by tag only",
                  file=sys.stderr)
    return reap_leftovers(run_dir, sessions)
