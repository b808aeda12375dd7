"""Every on-disk path of a run, built in one place.

    RUN_DIR/
      run.db                 run store (SQLite)
      config.yaml            resolved job config
      weights/v{N}/          published weights version N (safetensors, config, tokenizer, checksum)
      ckpt/step{N}/          optimizer checkpoints
      logs/                  one log file per process (control.log, rank{R}.log, env{I}.log)
      tensorboard/           TensorBoard event files (monitor.tensorboard), written.json
      wandb/                 the offline Weights & Biases run (monitor.wandb)
      rendezvous/g{G}/v{N}   the trainer group's rendezvous file for plan version N, restart generation G
      rendezvous/g{G}/v{N}.data-ready   the leader's marker that version N's step input is ready
      env{I}.port            the port local environment server I listens on
      env.token              the run's own environment token (0600) when the job names none

Directories under weights/ and ckpt/ are numbered by :func:`version_dir` and :func:`checkpoint_dir`
(the publisher and the checkpointer take those roots, not a RunPaths).
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
_STEP_DIR = re.compile(r"^step(\d+)$")


def version_dir(weights_root: Path, version: int) -> Path:
    """Published weights version `version` under `weights_root`."""
    return Path(weights_root) / f"v{version}"


def checkpoint_dir(ckpt_root: Path, step: int) -> Path:
    """The optimizer checkpoint of step `step` under `ckpt_root`."""
    return Path(ckpt_root) / f"step{step}"


def _numbered(root: Path, pattern: re.Pattern[str]) -> list[int]:
    if not Path(root).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(root).iterdir() if (m := pattern.match(p.name)) and p.is_dir())


def weight_versions_in(weights_root: Path) -> list[int]:
    """Committed weight versions under `weights_root`, ascending (half-written `.vN.tmp-*` excluded)."""
    return _numbered(weights_root, _VERSION_DIR)


def checkpoint_steps_in(ckpt_root: Path) -> list[int]:
    """Committed checkpoint steps under `ckpt_root`, ascending."""
    return _numbered(ckpt_root, _STEP_DIR)


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

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous"

    @property
    def env_token(self) -> Path:
        return self.root / "env.token"

    @property
    def env_urls(self) -> Path:
        """The env servers' URLs of the launch (JSON list), which every rank and `tiderl status` read."""
        return self.root / "env_urls.json"

    @property
    def weight_server(self) -> Path:
        """Where the trainer leader's weight server listens (`host:port`, JSON), for the rollout ranks."""
        return self.rendezvous / "weight-server.json"

    @property
    def trainer_layout(self) -> Path:
        """Which actor ranks (and their processes) trained the newest version, written by its leader when
        the actor is sharded: the ranks of a new layout wait for those to hand the state over
        (tiderl.run.handoff)."""
        return self.rendezvous / "trainer-layout.json"

    def weights_version(self, version: int) -> Path:
        return version_dir(self.weights, version)

    def checkpoint(self, step: int) -> Path:
        return checkpoint_dir(self.ckpt, step)

    def rendezvous_generation(self, generation: int) -> Path:
        """The trainer group's rendezvous files of one restart generation (a restarted group meets afresh)."""
        return self.rendezvous / f"g{generation}"

    def rendezvous_version(self, version: int, generation: int) -> Path:
        return self.rendezvous_generation(generation) / f"v{version}"

    def bell(self, name: str) -> Path:
        """A bell's file (tiderl.run.bell): replaced after a commit to wake the processes that wait for it."""
        return self.root / "bells" / name

    def data_ready(self, version: int, generation: int, chunk: int = 0) -> Path:
        """The marker of a step's data chunk `chunk` (0: the first, which also names the step's group)."""
        return self.rendezvous_generation(generation) / (f"v{version}.data-ready" + (f".{chunk}" if chunk else ""))

    def env_port(self, index: int) -> Path:
        return self.root / f"env{index}.port"

    def rank_log(self, rank: int | str) -> Path:
        """Rank `rank`'s log; `rank` may be a pattern Slurm fills in per task (srun's ``%t``: the ranks' step
        writes each task's output there, ``tiderl.slurm.submit.rank_step_argv``)."""
        return self.logs / f"rank{rank}.log"

    def control_log(self) -> Path:
        return self.logs / "control.log"

    def env_log(self, index: int) -> Path:
        return self.logs / f"env{index}.log"

    def weight_versions(self) -> list[int]:
        """Published weight versions on disk, ascending (half-written `*.tmp` dirs excluded)."""
        return weight_versions_in(self.weights)

    def checkpoint_steps(self) -> list[int]:
        """Committed checkpoint steps on disk, ascending."""
        return checkpoint_steps_in(self.ckpt)

    def uncommitted(self, version: int) -> list[Path]:
        """The weight versions and checkpoints on disk newer than the store's `version`: written by a step
        that crashed before its commit (the actor deletes them before it trains again)."""
        return ([self.weights_version(v) for v in self.weight_versions() if v > version]
                + [self.checkpoint(step) for step in self.checkpoint_steps() if step > version])

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
        pass  # no readable /proc/self/status (not Linux): the usual default below
    return 0o022


PRIVATE_UMASK = 0o077  # what a run's processes add to their umask: files 0600, directories 0700


def use_private_umask() -> None:
    """From now on this process, and every process it starts, creates files 0600 and directories 0700
    at most (its umask gains 077): a run's files (the store, logs, weights, checkpoints) are its user's
    alone on a node shared with others, whatever umask the user runs with."""
    os.umask(_umask() | PRIVATE_UMASK)


def private_dir(path: Path) -> Path:
    """`path` as a directory of mode 0700 (made, with its missing parents, if absent; an existing one of
    this user's is narrowed). Returns `path`."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if path.stat().st_uid == os.geteuid():
            path.chmod(0o700)
    except OSError:
        pass  # not ours to change (a directory one may only read)
    return path


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

    The file gets `mode`, by default 0600 (less the umask): a run's files are its user's alone on a
    node shared with other users, whatever the umask (see `use_private_umask`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode if mode is not None else 0o600 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
