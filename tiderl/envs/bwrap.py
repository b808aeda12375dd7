"""Bubblewrap (`bwrap`) for a sandbox run: its command line and the handling of its process.

`bwrap_argv` builds the command line (a pure function of what it is given): namespaces, the
read-only system and Python trees, the run's tmpfs and the code as /tmp/main.py; what that
leaves the run is described in `tiderl.envs.sandbox`. The server then reads the pid of the
run's namespace init from bwrap's --info-fd (`read_child_pid`), as root maps the run's uid
(`map_ids`), and ends the run through that init (`end_bwrap`).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tiderl.envs.sandbox_errors import SandboxError, SandboxUnavailableError

_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")


def find_bwrap() -> str | None:
    return shutil.which("bwrap") or ("/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None)


def python_dirs() -> list[str]:
    """The directories of the Python install this process runs, which a run binds read-only:
    the prefixes (a venv's and its base's) and the real executable's, as given and resolved."""
    real_bin = os.path.dirname(os.path.realpath(sys.executable))
    candidates = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                  os.path.dirname(real_bin) if os.path.basename(real_bin) == "bin" else real_bin]
    found = sorted({os.path.normpath(q) for p in candidates for q in (os.path.abspath(p), os.path.realpath(p))})
    home = os.path.realpath(os.path.expanduser("~"))
    kept: list[str] = []
    for path in found:
        if path == "/" or home == path or home.startswith(path + "/"):
            raise SandboxUnavailableError(
                f"the Python install at {path} contains the home directory {home}: a sandbox binding it "
                "would show all of that home; run the server from a Python installed elsewhere (e.g. a venv)"
            )
        if not any(path.startswith(k + "/") for k in kept) and not path.startswith("/usr/"):
            kept.append(path)
    return [p for p in kept if p != "/usr"]


def system_mounts() -> list[str]:
    argv = ["--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    return argv


def scratch_dir(python_dirs: Sequence[str]) -> str:
    """The run's working directory, a tmpfs holding only main.py: /tmp, unless a bound Python tree
    lies under /tmp (a checkout or venv there: its first component would show in /tmp), then the
    first of /sandbox, /sandbox-scratch that no bound tree overlaps."""
    for candidate in ("/tmp", "/sandbox", "/sandbox-scratch"):
        if not any(d == candidate or d.startswith(candidate + "/") or candidate.startswith(d + "/")
                   for d in python_dirs):
            return candidate
    raise SandboxUnavailableError(f"no scratch directory for the sandbox that the Python trees {list(python_dirs)} "
                                  "do not overlap")


def bwrap_argv(bwrap: str, *, system_mounts: Sequence[str], python_dirs: Sequence[str], tmpfs_mb: int,
               code_fd: int, info_fd: int, sync_fd: int, as_root: bool, seccomp_fd: int | None = None) -> list[str]:
    """The bwrap command line of one run, up to the command (`--`). The run waits on `sync_fd`
    until the server has written its uid map (as root) and put it into its cgroup. Its working
    directory is `scratch_dir(python_dirs)`; `seccomp_fd`: a filter (`tiderl.envs.seccomp`) bwrap applies."""
    size = str(tmpfs_mb << 20)
    scratch = scratch_dir(python_dirs)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--info-fd", str(info_fd)]
    if as_root:  # the server maps the run's uid; the run needs these two to drop to it
        argv += ["--userns-block-fd", str(sync_fd), "--cap-drop", "ALL",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--block-fd", str(sync_fd), "--disable-userns"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += [*system_mounts, "--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    # bwrap would copy the modes of the host's parents (e.g. a 0700 home): the run's uid could not enter
    ancestors = {str(a) for d in python_dirs for a in Path(d).parents} - {"/", "/tmp", "/dev", "/proc"}
    for path in sorted(ancestors):
        argv += ["--perms", "0755", "--dir", path]
    for path in python_dirs:
        argv += ["--ro-bind", path, path]
    if scratch != "/tmp":
        argv += ["--perms", "1777", "--size", size, "--tmpfs", scratch]
    argv += ["--perms", "0444", "--file", str(code_fd), f"{scratch}/main.py",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", scratch, "--"]
    return argv


def exit_code_of_bwrap(status: int) -> int:
    """bwrap exits 128 + N when the run's first process died of signal N (like a shell)."""
    return -(status - 128) if 128 < status <= 128 + 64 else status


def read_child_pid(fd: int, timeout_s: float = 10.0) -> int | None:
    """The pid of the run's namespace init from bwrap's --info-fd; None if bwrap exited first."""
    data = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"}" not in data:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                raise SandboxError(f"bwrap reported no sandbox within {timeout_s} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            data += chunk
    return int(json.loads(data[: data.index(b"}") + 1])["child-pid"])


def map_ids(pid: int, uid: int) -> None:
    """Root and the run's uid map to themselves in the run's user namespace: bwrap sets the
    namespace up as root, the run then drops to `uid`."""
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(f"0 0 1\n{uid} {uid} 1\n")


def pidfd_open(pid: int) -> int | None:
    """A pidfd of `pid`; None before Linux 5.3 (the run is then ended through bwrap's --die-with-parent)."""
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return None
        raise


def end_bwrap(proc: subprocess.Popen[bytes] | None, pidfd: int | None) -> int | None:
    """Kill the run's namespace init (the kernel then kills all of the namespace) and wait for
    bwrap, which exits once the init is reaped: then no process of the run is left."""
    if proc is None:
        return None
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the run ended by itself
        os.close(pidfd)
    elif proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's pid is unknown: --die-with-parent takes it along
    try:
        status = proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # --die-with-parent takes the run along
        status = proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]
    return status
