"""Buckets in shared memory, for the engines on the trainer leader's own host.

An engine on the leader's host does not need the bytes sent to it: the server packs each version into
files of the host's shared-memory filesystem (``/dev/shm``, a tmpfs: pages of RAM with a name), and such an
engine maps them read-only and loads its model straight from the pages, as slime's engines take the
trainer's buffers through CUDA IPC. An engine on another host, or one that cannot open the files (another
user, another mount namespace), gets the same buckets over the connection instead.

- **Only the owner reads them.** Each file is created ``0600`` under a name with a random part.
- **No SIGBUS on a full tmpfs.** The space is reserved (``posix_fallocate``) before the file is mapped, so
  a full ``/dev/shm`` is an ``OSError`` at allocation (the server then keeps that version in its own
  memory), never a signal at a write.
- **Nothing left behind.** A version's files are unlinked when a newer version replaces it and when the
  server closes; an engine that mapped them keeps its pages until it drops them (Linux frees an unlinked
  file's pages with its last mapping). Files of a server that died without closing (its pid gone) are
  removed by the next server of the same user on that host.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
from pathlib import Path

import psutil
import torch

log = logging.getLogger("tiderl.weightsync")
SHM_DIR = Path("/dev/shm")
PREFIX = "tiderl-weights-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(\d+)-[0-9a-f]+-v\d+-b\d+$")  # pid namespace, pid, random


class ShmArena:
    """The shared-memory files of one server: allocate a version's buckets, release a version's files."""

    def __init__(self, directory: Path = SHM_DIR) -> None:
        self.directory = directory
        self.tag = f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
        self.usable = directory.is_dir() and os.access(directory, os.W_OK)
        if self.usable:
            sweep_dead(directory)
            atexit.register(self.release_all)  # a process that ends without closing its server

    def alloc(self, version: int, index: int, nbytes: int) -> tuple[torch.Tensor, str]:
        """A zeroed uint8 tensor of `nbytes` mapped from a new file, and the file's path. Raises OSError where
        the filesystem cannot hold it."""
        path = self.directory / f"{self.tag}-v{version}-b{index}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), str(path)
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8), str(path)

    def release(self, paths: list[str]) -> None:
        for p in paths:
            Path(p).unlink(missing_ok=True)

    def release_all(self) -> None:
        """Every file of this arena (the server closes)."""
        if self.usable:
            for p in self.directory.glob(f"{self.tag}-*"):
                p.unlink(missing_ok=True)


def map_bucket(path: str, nbytes: int) -> torch.Tensor:
    """A bucket another process put in shared memory, mapped copy-on-write (this process never writes it).
    Raises OSError where the file is gone (a newer version replaced it), not readable, or not of `nbytes`."""
    size = os.stat(path).st_size
    if size < max(nbytes, 1):
        raise OSError(f"{path}: {size} bytes, its layout says {nbytes}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)


def left_by_dead(directory: Path = SHM_DIR) -> list[Path]:
    """This user's servers' files on this host whose server process has ended (servers of this pid namespace
    only: another's pids cannot be told apart here)."""
    uid = os.getuid()
    found = []
    for p in directory.glob(f"{PREFIX}*"):
        m = _NAME.match(p.name)
        try:
            if (m is not None and p.stat().st_uid == uid and int(m.group(1)) == _pid_namespace()
                    and not psutil.pid_exists(int(m.group(2)))):
                found.append(p)
        except OSError:
            continue
    return found


def sweep_dead(directory: Path = SHM_DIR) -> list[str]:
    """Remove the files this user's servers left behind on this host when they died."""
    removed = []
    for p in left_by_dead(directory):
        try:
            p.unlink()
        except OSError:
            continue
        removed.append(p.name)
    if removed:
        log.info("removed %d shared-memory weight files of servers that died", len(removed))
    return removed


def _pid_namespace() -> int:
    """This process's pid namespace (a container on the same host may share /dev/shm but not its pids)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
