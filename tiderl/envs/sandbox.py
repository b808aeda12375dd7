"""Run untrusted Python code in a separate, limited process.

Each run gets:
- its own process (a new session), started by `python -I -u` (isolated mode, unbuffered output) with an
  empty environment: none of the server's variables, tokens or paths;
- a fresh scratch directory as working directory, deleted afterwards;
- rlimits set in the child before the code runs: CPU seconds, address space
  (memory), size of any file written, open files, no core dumps;
- a wall-clock limit and an output cap (stdout + stderr), enforced by the parent,
  which kills the run when either is exceeded;
- when the server runs as root (the recommended setup for untrusted code): its own
  unprivileged uid/gid (one per concurrent run, `uid_base + slot`, slots locked with
  flock so several servers on a machine never share one). The run cannot read files
  the server keeps private (e.g. a 0600 token file), RLIMIT_NPROC caps its processes
  (a fork bomb stops at `max_processes`), and after the run every process of that uid
  is killed, also ones that escaped the process group.

Without root the run keeps the server's uid: rlimits, the empty environment, the
scratch directory, killing the process group and a best-effort process cap still
apply, but files readable by the server's user are readable by the code.
Not contained (needs namespaces or a container): network access, and reading
world-readable files.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

# Runs first in the child: applies the limits, drops privileges, then runs the code.
_RUNNER = r"""
import os, resource, sys
cpu_s, mem, fsize, nofile, nproc, uid = (int(a) for a in sys.argv[1:7])
path = sys.argv[7]
preload = [m for m in sys.argv[8].split(",") if m]
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


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_mb: int = 16
    open_files: int = 64
    max_processes: int = 16
    uid_base: int = 1_900_000_000  # sandbox uids: uid_base .. uid_base + uid_slots - 1
    uid_slots: int = 256
    # Imported before privileges are dropped: the sandbox uid may not be allowed to
    # read the Python installation (e.g. one under a 0700 home directory).
    preload: tuple[str, ...] = PRELOAD


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    timed_out: bool  # the wall-clock limit was hit
    output_truncated: bool  # the output cap was hit (the run was killed)
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the code failing: that is a result)."""


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


_is_subreaper = False


def _become_subreaper() -> None:
    """Orphaned sandbox processes are reparented to this process (not to PID 1, which in
    a container may never reap them), so `_kill_uid` can reap their zombies: zombies
    count against the uid's RLIMIT_NPROC and fill the process table."""
    global _is_subreaper
    if not _is_subreaper:
        libc = ctypes.CDLL(None, use_errno=True)
        _is_subreaper = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return None


_PR_SET_CHILD_SUBREAPER = 36


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


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a script under `limits`; never raises because of what the code does."""
    started = time.monotonic()
    with _uid_slot(limits) as uid:
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
            args = [
                sys.executable, "-I", "-u", "-c", _RUNNER,
                str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.file_mb << 20),
                str(limits.open_files), str(nproc), str(uid), str(script), ",".join(limits.preload),
            ]
            proc = subprocess.Popen(
                args, cwd=scratch, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
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
