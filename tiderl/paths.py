"""Every on-disk path of a run, built in one place.

    RUN_DIR/
      run.db                 run store (SQLite)
      config.yaml            resolved job config
      weights/v{N}/          published weights version N (safetensors, config, tokenizer, checksum)
      ckpt/step{N}/          optimizer checkpoints
      logs/                  one log file per process (control.log, rank{R}.log, env{I}.log)
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

_VERSION_DIR = re.compile(r"^v(\d+)$")


@dataclass(frozen=True, slots=True)
class RunPaths:
    root: Path

    @property
    def db(self) -> Path:
        return self.root / "run.db"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def weights_version(self, version: int) -> Path:
        return self.weights / f"v{version}"

    def checkpoint(self, step: int) -> Path:
        return self.ckpt / f"step{step}"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def control_log(self) -> Path:
        return self.logs / "control.log"

    def env_log(self, index: int) -> Path:
        return self.logs / f"env{index}.log"

    def weight_versions(self) -> list[int]:
        """Published weight versions on disk, ascending (half-written `*.tmp` dirs excluded)."""
        if not self.weights.is_dir():
            return []
        found = (_VERSION_DIR.match(p.name) for p in self.weights.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def create(self) -> "RunPaths":
        for d in (self.root, self.weights, self.ckpt, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        return self


def _umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def when_room(fn: Callable[[], T], *, wait_s: float, what: str, retry_s: float = 1.0,
              sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> T:
    """`fn()`, run again every `retry_s` while it fails for want of space (ENOSPC, EDQUOT), for up to
    `wait_s`; then the OSError, its message naming `what`. `fn` must be whole or nothing (an atomic
    write or publish), so that running it again is safe."""
    since = clock()
    warned = False
    while True:
        try:
            return fn()
        except OSError as e:
            if e.errno not in DISK_FULL_ERRNOS:
                raise
            waited = clock() - since
            if waited >= wait_s:
                raise OSError(e.errno, f"{what}: the disk is still full after {waited:.0f} s ({e.strerror})",
                              e.filename) from e
            if not warned:
                logging.getLogger("tiderl.paths").warning("%s: the disk is full (%s); retrying every %.0f s for "
                                                          "up to %.0f s", what, e, retry_s, wait_s)
                warned = True
            sleep(retry_s)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`.

    The file gets `mode`, by default what a plain `open` would give (0666 less the umask): a run's
    files are for the team to read on a shared cluster, not 0600 as a temporary file would be.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
