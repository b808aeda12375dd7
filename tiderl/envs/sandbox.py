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
  included) where a cgroup is writable: v2 (`memory.max`, `memory.swap.max`, `pids.max`), or
  v1 (`memory.limit_in_bytes` and `memory.memsw.limit_in_bytes`, `pids.max`). As root that is
  most machines; without root only a delegated cgroup. `SandboxResult.memory_exceeded` says
  when that limit killed a process. The runs' cgroups are children of the server's own (so a
  job's limits still hold); for v2 a server alone in its cgroup first moves into a child
  `tiderl-server`, since a v2 cgroup with processes cannot give controllers to children.
- without such a cgroup: memory is limited per process (RLIMIT_AS) only, so a run may use
  `max_processes` times `memory_mb`, plus its two tmpfs and shared memory it does not keep
  mapped (memfd, SysV); under Slurm the job's cgroup still bounds the server and its runs
  together. The process cap is RLIMIT_NPROC, which Linux 5.14+ counts inside the run's user
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
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Iterator

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


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the code failing: that is a result)."""


class SandboxUnavailableError(SandboxError):
    """The `bwrap` isolation cannot work on this machine; the message says why."""


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               isolation: Isolation = Isolation.BWRAP) -> SandboxResult:
    """Run `code` as a script under `limits`; never raises because of what the code does.
    With `Isolation.BWRAP` it raises `SandboxUnavailableError` where bwrap cannot work."""
    if isolation is Isolation.BWRAP:
        check_bwrap(limits)
    with _uid_slot(limits) as uid:
        if isolation is Isolation.BWRAP:
            return _run_bwrap(code, limits, uid)
        return _run_unsafe(code, limits, uid)


# uid slots (root) ------------------------------------------------------------------


def _lock_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "tiderl-sandbox-locks"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@contextmanager
def _uid_slot(limits: SandboxLimits) -> Iterator[int]:
    """A free sandbox uid (-1 when not root), held for the block."""
    if os.geteuid() != 0:
        yield -1
        return
    lock_dir = _lock_dir()
    deadline = time.monotonic() + 60.0
    while True:
        for slot in range(limits.uid_slots):
            fd = os.open(lock_dir / f"uid-{limits.uid_base + slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield limits.uid_base + slot
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"all {limits.uid_slots} sandbox uids busy for 60 s")
        time.sleep(0.05)


def _processes_of_uid(uid: int) -> dict[int, bytes]:
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


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes owned by `uid`."""
    return [pid for pid, state in _processes_of_uid(uid).items() if state not in (b"Z", b"X")]


def _own_process_count() -> int:
    return len(_pids_of_uid(os.getuid()))


def _read_capped(proc: subprocess.Popen[bytes], limits: SandboxLimits) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until EOF, the output cap or the wall-clock limit."""
    assert proc.stdout is not None and proc.stderr is not None
    chunks: dict[IO[bytes], bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + limits.wall_s
    total = 0
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
        for stream in chunks:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
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
    return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), timed_out, truncated


def _runner_args(limits: SandboxLimits, nproc: int, uid: int, script: str) -> list[str]:
    return [
        "-I", "-u", "-c", _RUNNER,
        str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.file_mb << 20),
        str(limits.open_files), str(nproc), str(uid), script, ",".join(limits.preload),
    ]


# bwrap -----------------------------------------------------------------------------

_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
_bwrap_lock = threading.Lock()
_bwrap_checked = False  # a probe run worked in this process


def find_bwrap() -> str | None:
    return shutil.which("bwrap") or ("/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None)


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
            with _uid_slot(limits) as uid:
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


def _system_mounts() -> list[str]:
    argv = ["--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    return argv


def bwrap_argv(bwrap: str, *, system_mounts: Sequence[str], python_dirs: Sequence[str], tmpfs_mb: int,
               code_fd: int, info_fd: int, sync_fd: int, as_root: bool) -> list[str]:
    """The bwrap command line of one run, up to the command (`--`). The run waits on `sync_fd`
    until the server has written its uid map (as root) and put it into its cgroup."""
    size = str(tmpfs_mb << 20)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--info-fd", str(info_fd)]
    if as_root:  # the server maps the run's uid; the run needs these two to drop to it
        argv += ["--userns-block-fd", str(sync_fd), "--cap-drop", "ALL",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--block-fd", str(sync_fd), "--disable-userns"]
    argv += [*system_mounts, "--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    # bwrap would copy the modes of the host's parents (e.g. a 0700 home): the run's uid could not enter
    ancestors = {str(a) for d in python_dirs for a in Path(d).parents} - {"/", "/tmp", "/dev", "/proc"}
    for path in sorted(ancestors):
        argv += ["--perms", "0755", "--dir", path]
    for path in python_dirs:
        argv += ["--ro-bind", path, path]
    argv += ["--perms", "0444", "--file", str(code_fd), "/tmp/main.py",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--"]
    return argv


def exit_code_of_bwrap(status: int) -> int:
    """bwrap exits 128 + N when the run's first process died of signal N (like a shell)."""
    return -(status - 128) if 128 < status <= 128 + 64 else status


def _nproc_counts_per_userns() -> bool:
    """Since Linux 5.14 RLIMIT_NPROC counts a uid's processes per user namespace."""
    release = os.uname().release.split("-")[0].split(".")
    try:
        return (int(release[0]), int(release[1])) >= (5, 14)
    except (ValueError, IndexError):
        return False


def _read_child_pid(fd: int, timeout_s: float = 10.0) -> int | None:
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


def _map_ids(pid: int, uid: int) -> None:
    """Root and the run's uid map to themselves in the run's user namespace: bwrap sets the
    namespace up as root, the run then drops to `uid`."""
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(f"0 0 1\n{uid} {uid} 1\n")


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
        nproc = _own_process_count() + limits.max_processes + 1
    fds: dict[str, int] = {}  # what this process still has to close
    cgroup: RunCgroup | None = None
    proc: subprocess.Popen[bytes] | None = None
    pidfd: int | None = None
    memory_exceeded = False
    try:
        cgroup = RunCgroup.create(limits)
        fds["code"] = os.memfd_create("main.py", os.MFD_CLOEXEC)
        fds["info_r"], fds["info_w"] = os.pipe()
        fds["sync_r"], fds["sync_w"] = os.pipe()
        data = code.encode()
        while data:
            data = data[os.write(fds["code"], data):]
        os.lseek(fds["code"], 0, os.SEEK_SET)
        argv = bwrap_argv(bwrap, system_mounts=_system_mounts(), python_dirs=python_dirs(),
                          tmpfs_mb=limits.tmpfs_mb, code_fd=fds["code"], info_fd=fds["info_w"],
                          sync_fd=fds["sync_r"], as_root=uid >= 0)
        argv += [sys.executable, *_runner_args(limits, nproc, uid, "/tmp/main.py")]
        try:
            proc = subprocess.Popen(
                argv, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, pass_fds=(fds["code"], fds["info_w"], fds["sync_r"]),
            )
            for name in ("code", "info_w", "sync_r"):
                os.close(fds.pop(name))
            child = _read_child_pid(fds["info_r"])
            os.close(fds.pop("info_r"))
            if child is None:
                proc.wait()
                detail = proc.stderr.read().decode(errors="replace").strip()  # type: ignore[union-attr]
                raise SandboxError(f"bwrap failed: {detail}")
            pidfd = _pidfd_open(child)  # the run waits on sync_r: this is the right process
            if uid >= 0:
                _map_ids(child, uid)
            if cgroup is not None:
                cgroup.add(child)
        except OSError as e:
            raise SandboxError(f"setting up the bwrap run failed: {e}") from e
        os.close(fds.pop("sync_w"))  # lets the run go on
        stdout, stderr, timed_out, truncated = _read_capped(proc, limits)
    finally:
        status = _end_bwrap(proc, pidfd)  # before closing sync_w: a run that was not set up never starts
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


def _pidfd_open(pid: int) -> int | None:
    """A pidfd of `pid`; None before Linux 5.3 (the run is then ended through bwrap's --die-with-parent)."""
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return None
        raise


def _end_bwrap(proc: subprocess.Popen[bytes] | None, pidfd: int | None) -> int | None:
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


# cgroups ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupParent:
    """Where run cgroups are made: for v2 one directory whose children get memory and pids,
    for v1 the process's directory in the memory and in the pids hierarchy."""

    version: int
    memory_dir: Path
    pids_dir: Path  # == memory_dir for v2


def cgroup_candidates(mountinfo: str, proc_cgroup: str) -> dict[str, Path]:
    """This process's cgroup directories by hierarchy ("v2", "memory", "pids"), from the text of
    /proc/self/mountinfo and /proc/self/cgroup."""
    own: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        for name in (controllers.split(",") if hier != "0" else ["v2"]):
            own.setdefault(name, path)
    found: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 1:
            continue
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        fstype, options = rfields[0], (rfields[2] if len(rfields) > 2 else "").split(",")
        names = ["v2"] if fstype == "cgroup2" else [n for n in ("memory", "pids") if n in options]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        for name in names:
            if name in own and name not in found:
                path = own[name]
                if root != "/" and (path == root or path.startswith(root + "/")):
                    path = path[len(root):]
                found[name] = Path(mount_point) / path.lstrip("/")
    return found


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enable_v2(base: Path) -> bool:
    """Turn memory and pids on for the children of `base`. A cgroup (not the root) that holds
    processes cannot: then this process moves to a leaf `tiderl-server` first, if it is alone."""
    wanted = {"memory", "pids"}
    if not wanted <= set((base / "cgroup.controllers").read_text().split()):
        return False
    if wanted <= set((base / "cgroup.subtree_control").read_text().split()):
        return True
    try:
        _write(base / "cgroup.subtree_control", "+memory +pids")
        return True
    except OSError:
        pass
    if (base / "cgroup.procs").read_text().split() != [str(os.getpid())]:
        return False  # other processes live here: moving only this one would not help
    leaf = base / "tiderl-server"
    leaf.mkdir(exist_ok=True)
    try:
        _write(leaf / "cgroup.procs", str(os.getpid()))
        _write(base / "cgroup.subtree_control", "+memory +pids")
        return True
    except OSError:
        _write(base / "cgroup.procs", str(os.getpid()))
        leaf.rmdir()
        return False


def _find_cgroup_parent() -> CgroupParent | None:
    try:
        found = cgroup_candidates(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    if "v2" in found:
        try:
            if _enable_v2(found["v2"]):
                return CgroupParent(2, found["v2"], found["v2"])
        except OSError:
            pass  # not writable here
    if "memory" in found and "pids" in found:
        return CgroupParent(1, found["memory"], found["pids"])
    return None


_cgroup_lock = threading.Lock()
_cgroup_parent: list[CgroupParent | None] = []  # filled once: [parent or None]
_cgroup_names = itertools.count()


def cgroup_parent() -> CgroupParent | None:
    """Where this process makes run cgroups, or None where it cannot (found and probed once)."""
    with _cgroup_lock:
        if not _cgroup_parent:
            parent = _find_cgroup_parent()
            if parent is not None:
                try:
                    RunCgroup(parent, f"tiderl-sandbox-{os.getpid()}-probe", SandboxLimits()).remove()
                except OSError:
                    parent = None
            _cgroup_parent.append(parent)
        return _cgroup_parent[0]


class RunCgroup:
    """One run's cgroup: one memory and process limit for all of the run's processes."""

    def __init__(self, parent: CgroupParent, name: str, limits: SandboxLimits) -> None:
        self.version = parent.version
        self.memory_dir = parent.memory_dir / name
        self.pids_dir = parent.pids_dir / name
        self.dirs = [self.memory_dir] if self.memory_dir == self.pids_dir else [self.memory_dir, self.pids_dir]
        for d in self.dirs:
            d.mkdir(exist_ok=True)  # exists: left by a killed server of the same pid
        try:
            memory = str(limits.memory_mb << 20)
            if self.version == 2:
                _write(self.memory_dir / "memory.max", memory)
                if (self.memory_dir / "memory.swap.max").exists():
                    _write(self.memory_dir / "memory.swap.max", "0")
            else:
                _write(self.memory_dir / "memory.limit_in_bytes", memory)
                if (self.memory_dir / "memory.memsw.limit_in_bytes").exists():
                    _write(self.memory_dir / "memory.memsw.limit_in_bytes", memory)
            _write(self.pids_dir / "pids.max", str(limits.max_processes + 1))  # + the namespace's init
        except OSError:
            self.remove()
            raise

    @classmethod
    def create(cls, limits: SandboxLimits) -> RunCgroup | None:
        parent = cgroup_parent()
        if parent is None:
            return None
        try:
            return cls(parent, f"tiderl-sandbox-{os.getpid()}-{next(_cgroup_names)}", limits)
        except OSError as e:
            raise SandboxError(f"cannot make the run's cgroup under {parent.memory_dir}: {e}") from e

    def add(self, pid: int) -> None:
        for d in self.dirs:
            _write(d / "cgroup.procs", str(pid))

    def memory_exceeded(self) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.memory_dir / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        except (OSError, ValueError):
            pass  # an old kernel without the counter
        return False

    def remove(self) -> None:
        """Kill what is left in the cgroup (nothing, after the run's namespace ended) and remove it."""
        deadline = time.monotonic() + 5.0
        for d in self.dirs:
            while d.exists():
                try:
                    if (d / "cgroup.kill").exists():
                        _write(d / "cgroup.kill", "1")
                    else:
                        for pid in (d / "cgroup.procs").read_text().split():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SandboxError(f"cannot remove the run's cgroup {d}: processes stay in it") from None
                    time.sleep(0.01)


# unsafe ----------------------------------------------------------------------------

_is_subreaper = False
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Orphaned sandbox processes are reparented to this process (not to PID 1, which in
    a container may never reap them), so `_kill_uid` can reap their zombies: zombies
    count against the uid's RLIMIT_NPROC and fill the process table."""
    global _is_subreaper
    if not _is_subreaper:
        libc = ctypes.CDLL(None, use_errno=True)
        _is_subreaper = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` until none is left (they may be forking), and reap
    the zombies that were reparented to this process."""
    for _ in range(200):
        processes = _processes_of_uid(uid)
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
            state in (b"Z", b"X") for state in _processes_of_uid(uid).values()
        ) and not _is_subreaper:
            return  # only foreign zombies left: nothing more this process can do
        time.sleep(0.01)
    if _pids_of_uid(uid):
        raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL")


def _run_unsafe(code: str, limits: SandboxLimits, uid: int) -> SandboxResult:
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="tiderl-sandbox-"))
    try:
        script = scratch / "main.py"
        script.write_text(code)
        nproc = limits.max_processes
        if uid >= 0:
            _become_subreaper()
            os.chown(scratch, uid, uid)
            os.chown(script, uid, uid)
        else:
            # Without a uid of its own the cap counts all of this user's processes.
            nproc = _own_process_count() + limits.max_processes
        proc = subprocess.Popen(
            [sys.executable, *_runner_args(limits, nproc, uid, str(script))], cwd=scratch, env={},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True,
        )
        try:
            stdout, stderr, timed_out, truncated = _read_capped(proc, limits)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the group is already gone
            exit_code = proc.wait()
            if uid >= 0:
                _kill_uid(uid)
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
