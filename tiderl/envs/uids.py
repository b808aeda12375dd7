"""Sandbox uids (as root): a uid of its own for each run, and the processes a uid owns.

A run as root holds one uid of `uid_base .. uid_base + num_slots - 1` for as long as it runs;
the slots are locked with flock, so servers on one machine never share one. The lock files live
in `LOCK_DIR` (/run/tiderl-sandbox-uids): under /run, which only root may write, never a shared
/tmp path another user could create first. The directory is checked before each use (a real
directory, not a symlink, owned by this user, mode 0700) and the files are opened with
O_NOFOLLOW; a slot is released when its block ends, however it ends. Processes are read from /proc. `kill_uid` ends every process of a
run's uid afterwards; `become_subreaper` lets this process reap the zombies they leave.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tiderl.envs.sandbox_errors import SandboxError


LOCK_DIR = Path("/run/tiderl-sandbox-uids")


def lock_dir(path: Path = LOCK_DIR) -> Path:
    """`path`, created private (mode 0700) if missing; `SandboxError` naming what is wrong when it
    is not a directory of this user's alone (a symlink, another owner, group or world access)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # an existing one is checked below, as a new one is
    except OSError as e:
        raise SandboxError(f"cannot create the sandbox uid lock directory {path}: {e}") from e
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not {os.geteuid()}"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if problem is not None:
        raise SandboxError(f"sandbox uid lock directory {path} {problem}: someone else may have made it; "
                           "remove it (the server creates it)")
    return path


@contextmanager
def uid_slot(uid_base: int, num_slots: int, directory: Path = LOCK_DIR) -> Iterator[int]:
    """A free sandbox uid (-1 when not root), held for the block."""
    if os.geteuid() != 0:
        yield -1
        return
    locks = lock_dir(directory)
    deadline = time.monotonic() + 60.0
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        for slot in range(num_slots):
            try:
                fd = os.open(locks / f"uid-{uid_base + slot}.lock", flags, 0o600)
            except OSError as e:
                raise SandboxError(f"cannot open sandbox uid lock {locks}/uid-{uid_base + slot}.lock: {e}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield uid_base + slot
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"all {num_slots} sandbox uids busy for 60 s")
        time.sleep(0.05)


def processes_of_uid(uid: int) -> dict[int, bytes]:
    """pid -> state letter of every process owned by `uid` (zombies included)."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid != uid:
                    continue
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    found[int(entry.name)] = f.read().rpartition(b")")[2].split()[0]
            except (OSError, IndexError):
                continue  # the process exited meanwhile
    return found


def pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes owned by `uid`."""
    return [pid for pid, state in processes_of_uid(uid).items() if state not in (b"Z", b"X")]


def own_process_count() -> int:
    return len(pids_of_uid(os.getuid()))


_is_subreaper = False
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned sandbox processes are reparented to this process (not to PID 1, which in
    a container may never reap them), so `kill_uid` can reap their zombies: zombies
    count against the uid's RLIMIT_NPROC and fill the process table."""
    global _is_subreaper
    if not _is_subreaper:
        libc = ctypes.CDLL(None, use_errno=True)
        _is_subreaper = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` until none is left (they may be forking), and reap
    the zombies that were reparented to this process."""
    for _ in range(200):
        processes = processes_of_uid(uid)
        if not processes:
            return
        live = 0
        for pid, state in processes.items():
            try:
                if state in (b"Z", b"X"):
                    os.waitpid(pid, os.WNOHANG)
                else:
                    live += 1
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, ChildProcessError):
                pass  # gone already, or a zombie that is not ours to reap
        if not live and all(
            state in (b"Z", b"X") for state in processes_of_uid(uid).values()
        ) and not _is_subreaper:
            return  # only foreign zombies left: nothing more this process can do
        time.sleep(0.01)
    if pids_of_uid(uid):
        raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL")
