"""Which weights a rollout rank loads, checked before it loads them.

The trainer publishes `weights/vN/` with a `SHA256SUMS` and records the digest of that file in the
store (`versions.checksum`). Before a rank loads a version it checks both: every file against the
sums, and the sums against the store. A version that was pruned before the rank got to it (a rank
that was busy elsewhere while the trainer published and pruned) is not an error: the rank loads the
newest published version instead, which is never older than the one it asked for. An engine starts on
the base model (version 0, never pruned) and reloads (tiderl.run.rollout_role.rank_engine).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tiderl.paths import version_dir
from tiderl.rollout.engine import EngineError
from tiderl.store.runstore import RunStore
from tiderl.trainer.publish import ChecksumError, verify

log = logging.getLogger("tiderl.weights")
LOAD_ATTEMPTS = 3  # a version pruned during its load is followed to the newest this often


class WeightsRejected(RuntimeError):
    """A published version whose files do not match their checksums: it is not loaded."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"weights v{version} rejected: {reason}")
        self.version = version
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Weights:
    version: int
    path: Path
    asked: int  # the version that was asked for (older when it had been pruned)


@dataclass(frozen=True, slots=True)
class WeightsSource:
    """Where versions live: version 0 is the base model, version N >= 1 `weights_root/vN`."""

    store: RunStore
    weights_root: Path
    base_dir: Path

    def path(self, version: int) -> Path:
        return self.base_dir if version == 0 else version_dir(self.weights_root, version)

    def resolve(self, version: int) -> Weights:
        """The verified weights of `version`, or of the newest published version where `version` was
        pruned. Raises WeightsRejected for a damaged version."""
        asked = version
        while True:
            if version == 0:
                return Weights(0, self.base_dir, asked)  # the base model: not written by the trainer
            path = self.path(version)
            try:
                digest = verify(path)
            except ChecksumError as e:
                if path.is_dir():
                    raise WeightsRejected(version, str(e)) from e
                newest = self.store.position()[1]
                if newest <= version:
                    raise WeightsRejected(version, f"{path} does not exist") from e
                log.info("weights v%d were pruned before they were loaded: loading v%d", version, newest)
                version = newest
                continue
            recorded = self.store.version_checksum(version)
            if recorded is not None and recorded != digest:
                raise WeightsRejected(version, f"{path}: its SHA256SUMS is not the one the trainer "
                                               f"published (store checksum {recorded[:12]}, files {digest[:12]})")
            return Weights(version, path, asked)

    async def aload(self, version: int, load: Callable[[Weights], Awaitable[None]]) -> Weights:
        """`await load(weights)` of `version` (an engine's reload), following a version pruned while it
        loaded to the newest."""
        asked = version
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            weights = replace(self.resolve(version), asked=asked)
            try:
                await load(weights)
                return weights
            except (EngineError, OSError):
                if weights.path.is_dir() or attempt == LOAD_ATTEMPTS:
                    raise
                version = weights.version  # gone while loading: resolve again finds the newer one
        raise AssertionError("unreachable")
