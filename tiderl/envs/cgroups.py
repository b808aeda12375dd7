"""A sandbox run's cgroup: one memory and process limit for all of the run's processes.

Where a cgroup is writable: v2 (`memory.max`, `memory.swap.max`, `pids.max`), or v1
(`memory.limit_in_bytes` and `memory.memsw.limit_in_bytes`, `pids.max`). As root that is most
machines; without root only a delegated cgroup. The runs' cgroups are children of the server's
own (so a job's limits still hold); for v2 a server alone in its cgroup first moves into a child
`tiderl-server`, since a v2 cgroup with processes cannot give controllers to children. Where
none is writable, `cgroup_parent` is None and `RunCgroup.create` gives None.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tiderl.envs.sandbox_errors import SandboxError

# The probe cgroup's limits: those of a default `SandboxLimits` (any limit the kernel takes would do).
_PROBE_MEMORY_BYTES = 512 << 20
_PROBE_MAX_PIDS = 16 + 1


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


def write_control(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enable_v2(base: Path, write: Callable[[Path, str], None] = write_control) -> bool:
    """Turn memory and pids on for the children of `base`. A cgroup (not the root) that holds
    processes cannot: then this process moves to a leaf `tiderl-server` first, if it is alone.
    `write` writes a control file (a test gives a fake cgroupfs)."""
    wanted = {"memory", "pids"}
    if not wanted <= set((base / "cgroup.controllers").read_text().split()):
        return False
    if wanted <= set((base / "cgroup.subtree_control").read_text().split()):
        return True
    try:
        write(base / "cgroup.subtree_control", "+memory +pids")
        return True
    except OSError:
        pass  # refused while this cgroup holds processes: the next step moves this one out first
    if (base / "cgroup.procs").read_text().split() != [str(os.getpid())]:
        return False  # other processes live here: moving only this one would not help
    leaf = base / "tiderl-server"
    leaf.mkdir(exist_ok=True)
    try:
        write(leaf / "cgroup.procs", str(os.getpid()))
        write(base / "cgroup.subtree_control", "+memory +pids")
        return True
    except OSError:
        write(base / "cgroup.procs", str(os.getpid()))
        leaf.rmdir()
        return False


def _find_cgroup_parent() -> CgroupParent | None:
    try:
        found = cgroup_candidates(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    if "v2" in found:
        try:
            if enable_v2(found["v2"]):
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
                    RunCgroup(parent, f"tiderl-sandbox-{os.getpid()}-probe", memory_bytes=_PROBE_MEMORY_BYTES,
                              max_pids=_PROBE_MAX_PIDS).remove()
                except OSError:
                    parent = None
            _cgroup_parent.append(parent)
        return _cgroup_parent[0]


class RunCgroup:
    """One run's cgroup: one memory limit (`memory_bytes`) and one process limit (`max_pids`)
    for all of the run's processes."""

    def __init__(self, parent: CgroupParent, name: str, *, memory_bytes: int, max_pids: int) -> None:
        self.version = parent.version
        self.memory_dir = parent.memory_dir / name
        self.pids_dir = parent.pids_dir / name
        self.dirs = [self.memory_dir] if self.memory_dir == self.pids_dir else [self.memory_dir, self.pids_dir]
        for d in self.dirs:
            d.mkdir(exist_ok=True)  # exists: left by a killed server of the same pid
        try:
            memory = str(memory_bytes)
            if self.version == 2:
                write_control(self.memory_dir / "memory.max", memory)
                if (self.memory_dir / "memory.swap.max").exists():
                    write_control(self.memory_dir / "memory.swap.max", "0")
            else:
                write_control(self.memory_dir / "memory.limit_in_bytes", memory)
                if (self.memory_dir / "memory.memsw.limit_in_bytes").exists():
                    write_control(self.memory_dir / "memory.memsw.limit_in_bytes", memory)
            write_control(self.pids_dir / "pids.max", str(max_pids))
        except OSError:
            self.remove()
            raise

    @classmethod
    def create(cls, *, memory_bytes: int, max_pids: int) -> RunCgroup | None:
        parent = cgroup_parent()
        if parent is None:
            return None
        try:
            return cls(parent, f"tiderl-sandbox-{os.getpid()}-{next(_cgroup_names)}",
                       memory_bytes=memory_bytes, max_pids=max_pids)
        except OSError as e:
            raise SandboxError(f"cannot make the run's cgroup under {parent.memory_dir}: {e}") from e

    def add(self, pid: int) -> None:
        for d in self.dirs:
            write_control(d / "cgroup.procs", str(pid))

    def memory_exceeded(self) -> bool:
        """The memory limit killed a process (False on an old kernel without the counter)."""
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
                        write_control(d / "cgroup.kill", "1")
                    else:
                        for pid in (d / "cgroup.procs").read_text().split():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except ProcessLookupError:
                                pass  # exited meanwhile
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SandboxError(f"cannot remove the run's cgroup {d}: processes stay in it") from None
                    time.sleep(0.01)
