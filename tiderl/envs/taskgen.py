"""pytool's tasks, generated outside the server's threads under a time and memory limit.

`reasoning_gym.create_dataset(name, seed=seed, size=1, **config)[0]` runs what a client's
options ask for: a `dataset_config` of many long terms can take minutes and gigabytes. Each
generation therefore runs in a process of its own, forked by a helper process that imported
`reasoning_gym` once (a fork costs milliseconds): the child has `RLIMIT_AS` of `memory_bytes`
and `RLIMIT_CPU` of the time limit, and the helper kills it at its deadline. The caller waits
on its own pipe for at most the time limit (plus a second) and then gets `TaskGenError`: no
server thread waits longer. The dataset object and its entry come back pickled (the server
scores answers with them). The helper ends when the server does (its socket closes).
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

GEN_TIMEOUT_S = 10.0  # one task's generation
MEMORY_BYTES = 2 << 30  # address space of a generating process
MAX_RESULT_BYTES = 16 << 20  # the pickled dataset and entry
FIRST_CALL_EXTRA_S = 60.0  # the first generation also waits for the helper's import of reasoning_gym
_ROOT = str(Path(__file__).resolve().parents[2])


class TaskGenError(ValueError):
    """The task could not be made within the limits, or the dataset refused its config."""


class _Helper:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.is_warm = False

    def send(self, request: dict[str, Any], fd: int) -> None:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {_ROOT!r}); "
                     f"from tiderl.envs.taskgen import _serve; _serve({theirs.fileno()})"],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
                theirs.close()
                self.sock, self.is_warm = ours, False
            assert self.sock is not None
            socket.send_fds(self.sock, [json.dumps(request).encode()], [fd])


_helper = _Helper()


def make_task(name: str, seed: int, config: dict[str, Any], *, timeout_s: float = GEN_TIMEOUT_S,
              memory_bytes: int = MEMORY_BYTES) -> tuple[Any, dict[str, Any]]:
    """(dataset, entry) of reasoning-gym dataset `name` for `seed`; `TaskGenError` naming what went
    wrong (its config refused, over `timeout_s`, over `memory_bytes`). A helper that died with the
    request (killed from outside) is started again and the request sent once more."""
    try:
        return _make_task_once(name, seed, config, timeout_s, memory_bytes)
    except _HelperGone:
        return _make_task_once(name, seed, config, timeout_s, memory_bytes)


class _HelperGone(TaskGenError):
    """The helper process ended with the request (killed from outside): `make_task` starts it again once."""


def _make_task_once(name: str, seed: int, config: dict[str, Any], timeout_s: float,
                    memory_bytes: int) -> tuple[Any, dict[str, Any]]:
    read_fd, write_fd = os.pipe()
    try:
        try:
            _helper.send({"name": name, "seed": seed, "config": config, "timeout_s": timeout_s,
                          "memory_bytes": memory_bytes}, write_fd)
        finally:
            os.close(write_fd)
        wait_s = timeout_s + 1.0 + (0.0 if _helper.is_warm else FIRST_CALL_EXTRA_S)
        deadline = time.monotonic() + wait_s
        data = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                raise TaskGenError(f"generating the task took longer than {timeout_s:g} s (stopped)")
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_RESULT_BYTES + 4096:
                raise TaskGenError(f"the task is more than {MAX_RESULT_BYTES} bytes")
    finally:
        os.close(read_fd)
    _helper.is_warm = True
    if data[:3] == b"ok\n":
        return pickle.loads(bytes(data[3:]))
    if data[:4] == b"err\n":
        raise TaskGenError(bytes(data[4:]).decode(errors="replace"))
    proc = _helper.proc
    if proc is not None and proc.poll() is not None:
        raise _HelperGone(f"the task generator ended ({proc.returncode}) while making the task")
    raise TaskGenError(f"generating the task took longer than {timeout_s:g} s or needed more than "
                       f"{memory_bytes >> 20} MB (stopped)")


def _generate(request: dict[str, Any], fd: int) -> None:
    """In a forked child: build the task, write b"ok\\n" + pickle or b"err\\n" + message to `fd`."""
    import resource

    cpu_s = int(request["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (request["memory_bytes"], request["memory_bytes"]))
    try:
        import reasoning_gym

        dataset = reasoning_gym.create_dataset(request["name"], seed=request["seed"], size=1, **request["config"])
        out = b"ok\n" + pickle.dumps((dataset, dataset[0]))
    except MemoryError:
        out = f"err\ngenerating it needed more than {request['memory_bytes'] >> 20} MB".encode()
    except BaseException as e:  # the config's fault, as the dataset says
        out = f"err\n{type(e).__name__}: {e}".encode()[:4000]
    _write_all(fd, out)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _serve(sock_fd: int) -> None:
    """The helper's loop: fork a child per request, kill it at its deadline, reap it."""
    # No PR_SET_PDEATHSIG: it fires when the *thread* that started the helper ends (a server worker
    # thread), not the server. The server's end closes the socket, and the loop below returns.
    import reasoning_gym  # noqa: F401  (once, here: every child has it)

    sock = socket.socket(fileno=sock_fd)
    deadlines: dict[int, float] = {}
    while True:
        now = time.monotonic()
        for pid, deadline in list(deadlines.items()):
            if deadline <= now:
                os.kill(pid, signal.SIGKILL)
        while deadlines:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            deadlines.pop(pid, None)
        wait_s = max(0.0, min(deadlines.values()) - time.monotonic()) + 0.01 if deadlines else None
        if not select.select([sock], [], [], wait_s)[0]:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 65536, 1)
        if not message:
            return  # the server is gone
        request = json.loads(message)
        try:
            pid = os.fork()
        except OSError as e:  # out of processes (a cgroup's pids.max, RLIMIT_NPROC): this task only
            _write_all(fds[0], f"err\nno process to generate it in: {e}".encode())
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            try:
                sock.close()
                _generate(request, fds[0])
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        deadlines[pid] = time.monotonic() + float(request["timeout_s"])
