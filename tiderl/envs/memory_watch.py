"""The whole-run memory limit of a sandboxed run where no cgroup is writable (an unprivileged server):
the server sums the run's memory itself and kills the run past its limit (tiderl.envs.sandbox).

Read from /proc, not psutil: the sandbox also serves from Pythons that have only the standard library,
as the tests' unprivileged servers do.
"""

from __future__ import annotations

import os

WATCH_S = 0.05  # how often the memory of a run without a cgroup is summed


class MemoryWatch:
    """The whole-run memory limit where no cgroup is writable: the resident memory of the run's processes
    (its namespace's init and every descendant) plus the files in its two tmpfs (`/tmp`, `/dev/shm`),
    against `limit_bytes`. Pages shared between the processes count once per process: the sum errs high."""

    def __init__(self, child: int, limit_bytes: int, tmpfs: tuple[str, ...] = ("tmp", "dev/shm")) -> None:
        self.child = child
        self.limit_bytes = limit_bytes
        self.tmpfs = tmpfs  # the run's own tmpfs mounts, relative to its root
        self.peak_bytes = 0

    def used_bytes(self) -> int:
        used = 0
        for pid in _tree(self.child):
            try:
                with open(f"/proc/{pid}/statm") as f:
                    used += int(f.read().split()[1]) * _PAGE_BYTES  # resident pages
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
        for mount in self.tmpfs:
            try:
                st = os.statvfs(f"/proc/{self.child}/root/{mount}")
            except OSError:
                continue  # the run has ended
            used += (st.f_blocks - st.f_bfree) * st.f_frsize
        self.peak_bytes = max(self.peak_bytes, used)
        return used

    def exceeded(self) -> bool:
        return self.used_bytes() > self.limit_bytes


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _tree(root: int) -> list[int]:
    """`root` and every descendant, from /proc/PID/task/TID/children; [] once `root` is gone."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        out.append(pid)
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
    return out
