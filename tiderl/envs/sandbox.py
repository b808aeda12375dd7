"""Run untrusted Python code in a separate, limited process.

Two isolations (`Isolation`); pytool's option `sandbox` picks one, `bwrap` unless the job says
`unsafe`. Both start the code with `python -I -u` (isolated mode, unbuffered output) and an empty
environment (none of the server's variables, tokens or paths), set rlimits in the run before the
code runs (CPU seconds, address space, size of a file written, open files, processes, no core
dumps), and enforce a wall-clock limit and an output cap (stdout + stderr) from the server.

`bwrap` (the default): each run is a bubblewrap sandbox with its own user, PID, network, IPC,
UTS, cgroup and mount namespaces. `check_bwrap` refuses (`SandboxUnavailableError`) where
`bwrap` is missing or cannot make one. In the run:
- the file system is an empty, read-only root holding, read-only: /usr (and /bin, /sbin,
  /lib*), ld.so.cache, localtime and alternatives of /etc, and the Python install the server
  runs (its prefixes; also one under a home directory); nothing else of the host: not the
  server's home, run directory or token file;
- /tmp (the working directory, holding main.py) and /dev/shm are tmpfs of `tmpfs_mb` each,
  fresh for each run and gone with it; / and /dev are read-only;
- no network: the run's network namespace has only its own loopback;
- the server is out of reach: /proc shows only the run's processes; their parent is the
  namespace's init, which ignores their signals; when the run's first process ends or the
  server ends the run, the kernel kills every process of the namespace, also ones in a session
  of their own (`--die-with-parent`: the run also dies with the server; `--new-session`);
- no capabilities, no new privileges (setuid binaries do nothing).

What holds where:
- as root: each run also has an unprivileged uid of its own (`uid_base + slot`, slots locked
  with flock so servers on one machine never share one). bwrap starts as root (so it can reach a
  Python install under a 0700 home), the server maps the run's uid into the run's user
  namespace and the run drops to it before the code runs (after `preload`). Files the bound
  trees hold that only root may read stay unreadable.
- without root the run keeps the server's uid (mapped into its namespace): everything it may
  see is bound read-only or is its own tmpfs. New user namespaces are disabled in the run
  (`--disable-userns`), so the code cannot mount a tmpfs of its own without a size limit. As
  root that flag cannot be combined with mapping the uid: the run's uid may make user
  namespaces as any unprivileged user can (what it mounts there counts against its cgroup).
- one memory and process limit for the whole run (all its processes, its tmpfs files
  included) where a cgroup is writable (v2 or v1, see `tiderl.envs.cgroups`): as root that is
  most machines; without root only a delegated cgroup. `SandboxResult.memory_exceeded` says
  when that limit killed a process.
- without such a cgroup: memory is limited per process (RLIMIT_AS), and for the whole run by
  the server itself (`MemoryWatch`): every `WATCH_S` it sums the resident memory of the run's
  processes and the files in its tmpfs, and kills the run past `memory_mb`
  (`SandboxResult.memory_exceeded`). Between two reads a run may briefly hold more (each
  process at most `memory_mb`). Shared memory the watch could not see is refused: a seccomp
  filter (`tiderl.envs.seccomp`) fails `shmget` and `memfd_create` with EPERM (x86_64 and
  aarch64; POSIX shared memory is files in the run's /dev/shm tmpfs, sized and counted); under Slurm the job's cgroup still bounds the server and its runs together. The process cap is RLIMIT_NPROC, which Linux 5.14+ counts inside the run's user
  namespace: the server user's other processes do not count (on older kernels they do, and
  the cap is set above their number).
- not contained: CPU time summed over a run's processes (each has `cpu_s`; the wall limit
  bounds the run), and kernel bugs.

`unsafe`: no namespaces. Each run gets a fresh scratch directory as working directory (deleted
afterwards), the rlimits above and its process group killed at the end; as root also its own
uid as above (it cannot read the server's 0600 files or signal the server, RLIMIT_NPROC caps
it, and every process of that uid is killed and reaped afterwards: the server becomes a child
subreaper). Without root the run has the server's uid: it can read the server's files, signal
the server, outlive the run from a session of its own, and use the network, /tmp and /dev/shm.

This module holds the limits, the result and the two runs; the mechanism lives in `bwrap` (the
command line and the bwrap process), `cgroups` (a run's cgroup), `uids` (a uid per run as root,
the processes of a uid) and `sandbox_errors`, all under `tiderl.envs`.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO

from tiderl.envs.bwrap import (
    bwrap_argv,
    end_bwrap,
    exit_code_of_bwrap,
    find_bwrap,
    map_ids,
    pidfd_open,
    python_dirs,
    read_child_pid,
    scratch_dir,
    system_mounts,
)
from tiderl.envs.cgroups import CgroupParent, RunCgroup, cgroup_candidates, cgroup_parent
from tiderl.envs.memory_watch import WATCH_S, MemoryWatch
from tiderl.envs.seccomp import filter_program
from tiderl.envs.sandbox_errors import SandboxError, SandboxUnavailableError
from tiderl.envs.uids import become_subreaper, kill_uid, own_process_count, uid_slot

__all__ = [
    "PRELOAD",
    "CgroupParent",
    "Isolation",
    "RunCgroup",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "bwrap_argv",
    "cgroup_candidates",
    "cgroup_parent",
    "check_bwrap",
    "exit_code_of_bwrap",
    "find_bwrap",
    "python_dirs",
    "run_python",
]

# Runs first in the child: applies the limits, drops privileges, then runs the code.
_RUNNER = r"""
import os, resource, sys
cpu_s, mem, fsize, nofile, nproc, uid = (int(a) for a in sys.argv[1:7])
path = sys.argv[7]
preload = [m for m in sys.argv[8].split(",") if m]
os.closerange(3, 1 << 16)  # bwrap's --info-fd and --block-fd stay open in its command
R = resource
R.setrlimit(R.RLIMIT_CORE, (0, 0))
R.setrlimit(R.RLIMIT_CPU, (cpu_s, cpu_s + 1))
R.setrlimit(R.RLIMIT_AS, (mem, mem))
R.setrlimit(R.RLIMIT_FSIZE, (fsize, fsize))
R.setrlimit(R.RLIMIT_NOFILE, (nofile, nofile))
import importlib
for name in preload:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # a preload is an optimisation: a module missing here fails later, inside the sandbox
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
if nproc > 0:
    R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
del os, resource, R, cpu_s, mem, fsize, nofile, nproc, uid, importlib, preload
sys.argv = ["main.py"]
with open(path) as f:
    code = compile(f.read(), "main.py", "exec")
try:
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


PRELOAD = (
    "pkgutil", "traceback", "linecache", "tokenize", "math", "cmath", "fractions", "decimal",
    "itertools", "functools", "collections", "re", "json", "random", "statistics", "string",
    "heapq", "bisect", "datetime", "operator", "typing", "dataclasses", "copy", "textwrap",
    "numbers", "array", "time", "io", "enum",
)


class Isolation(Enum):
    BWRAP = "bwrap"  # namespaces (bubblewrap), see the module docstring; the default
    UNSAFE = "unsafe"  # rlimits, and an own uid as root; only when the job asks for it


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512  # per process (RLIMIT_AS), and for the whole run where a cgroup is writable
    output_bytes: int = 64 * 1024
    file_mb: int = 16
    open_files: int = 64
    max_processes: int = 16
    tmpfs_mb: int = 64  # bwrap: size of the run's /tmp and of its /dev/shm, each
    uid_base: int = 1_900_000_000  # sandbox uids: uid_base .. uid_base + uid_slots - 1
    uid_slots: int = 256
    # Imported before privileges are dropped: the sandbox uid may not be allowed to
    # read all of the Python installation.
    preload: tuple[str, ...] = PRELOAD


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    timed_out: bool  # the wall-clock limit was hit
    output_truncated: bool  # the output cap was hit (the run was killed)
    wall_s: float
    memory_exceeded: bool = False  # the run's cgroup memory limit killed a process

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               isolation: Isolation = Isolation.BWRAP) -> SandboxResult:
    """Run `code` as a script under `limits`; never raises because of what the code does.
    With `Isolation.BWRAP` it raises `SandboxUnavailableError` where bwrap cannot work."""
    if isolation is Isolation.BWRAP:
        check_bwrap(limits)
    with uid_slot(limits.uid_base, limits.uid_slots) as uid:
        if isolation is Isolation.BWRAP:
            return _run_bwrap(code, limits, uid)
        return _run_unsafe(code, limits, uid)


def _read_capped(proc: subprocess.Popen[bytes], limits: SandboxLimits,
                 watch: MemoryWatch | None = None) -> tuple[bytes, bytes, bool, bool, bool]:
    """Read stdout and stderr until EOF, the output cap, the wall-clock limit or (with `watch`) the run's
    memory past its limit. Returns (stdout, stderr, timed out, truncated, memory exceeded)."""
    assert proc.stdout is not None and proc.stderr is not None
    chunks: dict[IO[bytes], bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + limits.wall_s
    total = 0
    timed_out = truncated = over = False
    with selectors.DefaultSelector() as sel:
        for stream in chunks:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(remaining, WATCH_S if watch is not None else 0.5)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                room = limits.output_bytes - total
                chunks[key.fileobj] += data[:room]  # type: ignore[index]
                total += len(data)
                if total > limits.output_bytes:
                    truncated = True
                    break
            if truncated:
                break
            if watch is not None and watch.exceeded():
                over = True  # the caller kills the run
                break
    return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), timed_out, truncated, over


def _runner_args(limits: SandboxLimits, nproc: int, uid: int, script: str) -> list[str]:
    return [
        "-I", "-u", "-c", _RUNNER,
        str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.file_mb << 20),
        str(limits.open_files), str(nproc), str(uid), script, ",".join(limits.preload),
    ]


# bwrap -----------------------------------------------------------------------------

_bwrap_lock = threading.Lock()
_bwrap_checked = False  # a probe run worked in this process


def check_bwrap(limits: SandboxLimits = SandboxLimits()) -> None:
    """Raise `SandboxUnavailableError` unless bwrap is installed and a probe run works here
    (checked until it works once per process)."""
    global _bwrap_checked
    if _bwrap_checked:
        return
    with _bwrap_lock:
        if _bwrap_checked:
            return
        bwrap = find_bwrap()
        if bwrap is None:
            raise SandboxUnavailableError(
                "bubblewrap (`bwrap`) is not installed: install the Debian/Ubuntu package `bubblewrap` "
                "(tools/setup_env.sh does so as root)"
            )
        try:
            with uid_slot(limits.uid_base, limits.uid_slots) as uid:
                result = _run_bwrap("print('ok')", limits, uid)
        except SandboxError as e:
            raise SandboxUnavailableError(f"bubblewrap ({bwrap}) cannot make a sandbox here: {e}") from e
        if result.stdout != "ok\n":
            detail = (result.stderr.strip() or f"exit {result.exit_code}")[-500:]
            raise SandboxUnavailableError(
                f"bubblewrap ({bwrap}) cannot make a sandbox here: {detail} (it needs bubblewrap 0.8 or "
                "later and user namespaces: sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone)"
            )
        _bwrap_checked = True


def _nproc_counts_per_userns() -> bool:
    """Since Linux 5.14 RLIMIT_NPROC counts a uid's processes per user namespace."""
    release = os.uname().release.split("-")[0].split(".")
    try:
        return (int(release[0]), int(release[1])) >= (5, 14)
    except (ValueError, IndexError):
        return False


def _run_bwrap(code: str, limits: SandboxLimits, uid: int) -> SandboxResult:
    started = time.monotonic()
    bwrap = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailableError("bubblewrap (`bwrap`) is not installed")
    if uid >= 0:
        nproc = limits.max_processes
    elif _nproc_counts_per_userns():
        nproc = limits.max_processes + 1  # the namespace's init has the server's uid too
    else:
        nproc = own_process_count() + limits.max_processes + 1
    fds: dict[str, int] = {}  # what this process still has to close
    cgroup: RunCgroup | None = None
    proc: subprocess.Popen[bytes] | None = None
    pidfd: int | None = None
    memory_exceeded = False
    try:
        cgroup = RunCgroup.create(memory_bytes=limits.memory_mb << 20,
                                  max_pids=limits.max_processes + 1)  # + the namespace's init
        fds["code"] = os.memfd_create("main.py", os.MFD_CLOEXEC)
        program = filter_program() if cgroup is None else None  # no SysV shm or memfd the watch cannot see
        if program is not None:
            fds["seccomp"] = os.memfd_create("seccomp", os.MFD_CLOEXEC)
            os.write(fds["seccomp"], program)
            os.lseek(fds["seccomp"], 0, os.SEEK_SET)
        fds["info_r"], fds["info_w"] = os.pipe()
        fds["sync_r"], fds["sync_w"] = os.pipe()
        data = code.encode()
        while data:
            data = data[os.write(fds["code"], data):]
        os.lseek(fds["code"], 0, os.SEEK_SET)
        trees = python_dirs()
        scratch = scratch_dir(trees)
        argv = bwrap_argv(bwrap, system_mounts=system_mounts(), python_dirs=trees,
                          tmpfs_mb=limits.tmpfs_mb, code_fd=fds["code"], info_fd=fds["info_w"],
                          sync_fd=fds["sync_r"], as_root=uid >= 0, seccomp_fd=fds.get("seccomp"))
        argv += [sys.executable, *_runner_args(limits, nproc, uid, f"{scratch}/main.py")]
        passed = tuple(fds[name] for name in ("code", "info_w", "sync_r", "seccomp") if name in fds)
        try:
            proc = subprocess.Popen(
                argv, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, pass_fds=passed,
            )
            for name in ("code", "info_w", "sync_r", "seccomp"):
                if name in fds:
                    os.close(fds.pop(name))
            child = read_child_pid(fds["info_r"])
            os.close(fds.pop("info_r"))
            if child is None:
                proc.wait()
                detail = proc.stderr.read().decode(errors="replace").strip()  # type: ignore[union-attr]
                raise SandboxError(f"bwrap failed: {detail}")
            pidfd = pidfd_open(child)  # the run waits on sync_r: this is the right process
            if uid >= 0:
                map_ids(child, uid)
            if cgroup is not None:
                cgroup.add(child)
        except OSError as e:
            raise SandboxError(f"setting up the bwrap run failed: {e}") from e
        os.close(fds.pop("sync_w"))  # lets the run go on
        tmpfs = tuple(dict.fromkeys((scratch.lstrip("/"), "tmp", "dev/shm")))
        watch = MemoryWatch(child, limits.memory_mb << 20, tmpfs) if cgroup is None else None
        stdout, stderr, timed_out, truncated, memory_exceeded = _read_capped(proc, limits, watch)
    finally:
        status = end_bwrap(proc, pidfd)  # before closing sync_w: a run that was not set up never starts
        for fd in fds.values():
            os.close(fd)
        if cgroup is not None:
            memory_exceeded = cgroup.memory_exceeded()
            cgroup.remove()
    return SandboxResult(
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        exit_code=exit_code_of_bwrap(status) if status is not None and status >= 0 else status,
        timed_out=timed_out,
        output_truncated=truncated,
        wall_s=time.monotonic() - started,
        memory_exceeded=memory_exceeded,
    )


# unsafe ----------------------------------------------------------------------------


def _run_unsafe(code: str, limits: SandboxLimits, uid: int) -> SandboxResult:
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="tiderl-sandbox-"))
    try:
        script = scratch / "main.py"
        script.write_text(code)
        nproc = limits.max_processes
        if uid >= 0:
            become_subreaper()
            os.chown(scratch, uid, uid)
            os.chown(script, uid, uid)
        else:
            # Without a uid of its own the cap counts all of this user's processes.
            nproc = own_process_count() + limits.max_processes
        proc = subprocess.Popen(
            [sys.executable, *_runner_args(limits, nproc, uid, str(script))], cwd=scratch, env={},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True,
        )
        try:
            stdout, stderr, timed_out, truncated, _ = _read_capped(proc, limits)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the group is already gone
            exit_code = proc.wait()
            if uid >= 0:
                kill_uid(uid)
            proc.stdout.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return SandboxResult(
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        exit_code=exit_code,
        timed_out=timed_out,
        output_truncated=truncated,
        wall_s=time.monotonic() - started,
    )
