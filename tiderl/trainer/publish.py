"""Weight publishing and optimizer checkpoints: atomic directories on the shared filesystem.

Weights version N lives in ``weights/vN/``: ``config.json``, safetensors
weights, the tokenizer files of the base model, and ``SHA256SUMS`` (one
``<hex>  <file>`` line per file). It is written into ``weights/.vN.tmp-*``
and renamed into place with ``os.replace``, so a reader sees either no
``vN`` or a complete one. Only the last ``keep_versions`` versions stay.

A checkpoint (``ckpt/stepN/``: weights and optimizer state as a DCP directory,
each rank of a sharded actor writing its own shards, plus the trainer state) is
committed the same way every ``checkpoint_every`` steps; resuming loads the
newest complete one, re-sharded onto whichever actor ranks read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tiderl.paths import checkpoint_dir, checkpoint_steps_in, version_dir, weight_versions_in, when_room
from tiderl.trainer.backend import ActorBackend

CHECKSUM_FILE = "SHA256SUMS"
TRAINER_STATE = "trainer_state.json"
# Files of a model directory that are weights or config (written by the backend), not tokenizer.
_MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|.*\.safetensors|.*\.safetensors\.index\.json|"
                          r".*\.bin|" + CHECKSUM_FILE + r"|tiderl-model\.json)$")


class ChecksumError(RuntimeError):
    """A published weights directory does not match its SHA256SUMS."""


@dataclass(frozen=True, slots=True)
class PublishedVersion:
    version: int
    path: Path
    checksum: str  # sha256 of the SHA256SUMS file: one digest for the whole version


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_checksums(directory: Path) -> str:
    lines = [f"{sha256_file(p)}  {p.name}" for p in sorted(directory.iterdir()) if p.is_file() and p.name != CHECKSUM_FILE]
    text = "\n".join(lines) + "\n"
    (directory / CHECKSUM_FILE).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def verify(directory: Path) -> str:
    """Check every file against SHA256SUMS; returns the version checksum. Raises ChecksumError."""
    sums = directory / CHECKSUM_FILE
    if not sums.is_file():
        raise ChecksumError(f"{directory}: no {CHECKSUM_FILE}")
    text = sums.read_text()
    listed = set()
    for i, line in enumerate(text.splitlines(), 1):
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name or "/" in name:
            raise ChecksumError(f"{directory}: {CHECKSUM_FILE} line {i} is not '<sha256>  <file>': {line!r}")
        if not (directory / name).is_file():
            raise ChecksumError(f"{directory}: {name} listed in {CHECKSUM_FILE} is missing")
        if sha256_file(directory / name) != digest:
            raise ChecksumError(f"{directory}: {name} does not match its checksum")
        listed.add(name)
    if not listed:
        raise ChecksumError(f"{directory}: {CHECKSUM_FILE} lists no files")
    # A file nobody listed would still be loaded (vLLM reads every *.safetensors of the directory).
    unlisted = sorted(p.name for p in directory.iterdir() if p.name != CHECKSUM_FILE and p.name not in listed)
    if unlisted:
        raise ChecksumError(f"{directory}: not listed in {CHECKSUM_FILE}: {', '.join(unlisted)}")
    return hashlib.sha256(text.encode()).hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))


def _commit_dir(tmp: Path, final: Path) -> None:
    for p in tmp.iterdir():
        with p.open("rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        # Re-publishing the same version after a crash between rename and the version row.
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


class WeightPublisher:
    """Writes ``weights/v{N}/`` after each optimizer step and prunes old versions."""

    def __init__(self, weights_root: Path, tokenizer_dir: Path, keep_versions: int,
                 disk_full_wait_s: float = 0.0) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.root = Path(weights_root)
        self.disk_full_wait_s = disk_full_wait_s
        self.tokenizer_files = [
            p for p in sorted(Path(tokenizer_dir).iterdir()) if p.is_file() and not _MODEL_FILES.match(p.name)
        ]
        self.keep_versions = keep_versions

    def publish(self, actor: ActorBackend, version: int) -> PublishedVersion:
        """Write and commit ``v{version}`` (whole or nothing: retried while the disk is full, for up to
        ``disk_full_wait_s``), then prune."""
        published = when_room(lambda: self._publish(actor, version), wait_s=self.disk_full_wait_s,
                              what=f"publishing weights v{version} in {self.root}")
        self.prune()
        return published

    def _publish(self, actor: ActorBackend, version: int) -> PublishedVersion:
        final = version_dir(self.root, version)
        tmp = _atomic_dir(final)
        try:
            actor.save_weights(tmp)
            for p in self.tokenizer_files:
                shutil.copy2(p, tmp / p.name)
            checksum = _write_checksums(tmp)
            _commit_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return PublishedVersion(version=version, path=final, checksum=checksum)

    def prune(self) -> list[int]:
        """Delete all but the newest ``keep_versions`` versions and stale tmp dirs; returns the deleted."""
        versions = weight_versions_in(self.root)
        doomed = versions[: max(0, len(versions) - self.keep_versions)]
        for v in doomed:
            shutil.rmtree(version_dir(self.root, v), ignore_errors=True)
        # This publisher is the run's only writer of weights/ and has just committed its own: any
        # temporary directory left is that of a publish that was interrupted (a killed trainer).
        for tmp in self.root.glob(".v*.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        return doomed


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    version: int
    path: Path
    extra: dict[str, Any]


class Checkpointer:
    """Checkpoints in ``ckpt/step{N}/``: every ``every`` steps, the newest ``keep`` kept. Each is a DCP
    directory (tiderl.trainer.state) with the trainer state and checksums beside it."""

    def __init__(self, ckpt_root: Path, every: int, keep: int = 2, disk_full_wait_s: float = 0.0) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"checkpoint every/keep must be >= 1, got {every}/{keep}")
        self.root = Path(ckpt_root)
        self.disk_full_wait_s = disk_full_wait_s
        self.every = every
        self.keep = keep

    def is_due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, actor: ActorBackend, step: int, version: int, extra: dict[str, Any] | None = None) -> Path | None:
        """Write and commit ``step{step}`` (whole or nothing: retried while the disk is full, for up to
        ``disk_full_wait_s``), then drop all but the newest ``keep``. A collective for a sharded actor: every
        rank of its group calls it and writes its shards; the group's first rank commits the directory and
        returns it, the others None."""
        group = actor.checkpoint_group
        final = when_room(lambda: self._save(actor, group, step, version, extra), wait_s=self.disk_full_wait_s,
                          what=f"checkpoint step {step} in {self.root}")
        if final is not None:
            for old in checkpoint_steps_in(self.root)[: -self.keep]:
                shutil.rmtree(checkpoint_dir(self.root, old), ignore_errors=True)
            for tmp in self.root.glob(".step*.tmp-*"):  # of a save that was interrupted (a killed trainer)
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _save(self, actor: ActorBackend, group: Any, step: int, version: int, extra: dict[str, Any] | None
              ) -> Path | None:
        final = checkpoint_dir(self.root, step)
        tmp = final.parent / f".{final.name}.tmp-dcp"  # one name for every writer of the group
        first = group is None or dist.get_rank(group) == 0
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if group is not None:
            dist.barrier(group=group)  # the directory is there, and empty, before any rank writes
        try:
            actor.save_checkpoint(tmp)  # DCP: the first rank's metadata last, once every rank has written
            if not first:
                return None
            meta = {"step": step, "version": version, "extra": extra or {}}
            (tmp / TRAINER_STATE).write_text(json.dumps(meta, sort_keys=True))
            _write_checksums(tmp)
            _commit_dir(tmp, final)
        except BaseException:
            if first:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose files match their checksums (a damaged one is skipped)."""
        for step in reversed(checkpoint_steps_in(self.root)):
            path = checkpoint_dir(self.root, step)
            try:
                verify(path)
            except ChecksumError:
                continue
            meta = json.loads((path / TRAINER_STATE).read_text())
            return Checkpoint(step=meta["step"], version=meta["version"], path=path, extra=meta["extra"])
        return None

    def restore(self, actor: ActorBackend, ckpt: Checkpoint, *, weights: bool = True) -> None:
        """Weights and optimizer state of ``ckpt``, re-sharded onto the actor's group (a collective with
        one); ``weights=False``: the optimizer state only (the weights come from a published version)."""
        actor.load_checkpoint(ckpt.path, weights=weights)
