"""Which weights a rollout rank loads, checked before it loads them; the trainer leader's weight server.

The trainer publishes `weights/vN/` with a `SHA256SUMS` and records the digest of that file in the
store (`versions.checksum`). Before a rank loads a version it checks both: every file against the
sums, and the sums against the store. A version that was pruned before the rank got to it (a rank
that was busy elsewhere while the trainer published and pruned) is not an error: the rank loads the
newest published version instead, which is never older than the one it asked for. An engine starts on
the base model (version 0, never pruned) and reloads (tiderl.run.rollout_role.rank_engine).

With `trainer.weight_sync: transfer` the engines get each version without files: the trainer leader
stages it in its :class:`~tiderl.weightsync.server.WeightServer` while it publishes, makes it servable once
the version row is committed, and names the server in `rendezvous/weight-server.json`; a rollout rank
asks it at its boundary (`receive`) and loads the files only where that fails.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.paths import atomic_write_text, version_dir
from tiderl.rollout.engine import Engine, EngineError, engine_dtype
from tiderl.store.runstore import RunStore
from tiderl.trainer.publish import ChecksumError, verify

if TYPE_CHECKING:
    import torch

    from tiderl.run.context import RankContext

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


# ---- weights without files (trainer.weight_sync: transfer) -----------------------------------------


def wire_dtype(ctx: RankContext) -> torch.dtype:
    """The dtype the engines hold (`rollout.dtype`; `auto`: bf16 with CUDA, fp32 on a CPU, as the engine)."""
    import torch

    return getattr(torch, engine_dtype(ctx.config.rollout.dtype, cpu=not torch.cuda.is_available()))


def stager(ctx: RankContext) -> Callable[[int, Mapping[str, torch.Tensor]], None] | None:
    """What an actor leader hands each version it publishes to (`ActorRank(stage=...)`), or None with
    `trainer.weight_sync: files`. The server starts on first use and names itself in the rendezvous file."""
    if ctx.config.trainer.weight_sync != "transfer":
        return None

    def stage(version: int, state: Mapping[str, torch.Tensor]) -> None:
        if ctx.weight_server is None:
            from tiderl.weightsync.server import WeightServer

            ctx.weight_server = WeightServer()
            atomic_write_text(ctx.paths.weight_server, json.dumps({"address": ctx.weight_server.address,
                                                                   "rank": ctx.rank, "pid": os.getpid()}))
            log.info("rank %d: weight server at %s", ctx.rank, ctx.weight_server.address)
        ctx.weight_server.stage(version, _as_published(ctx.paths.weights_version(version), state), wire_dtype(ctx))

    return stage


def _as_published(directory: Path, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the version just written to `directory`, by the names its files use: the trainer's own
    where they are the same (the common case), else read back from the files (a model whose
    `save_pretrained` renames its weights), so the engines get what a file reload would give them."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.update(dict.fromkeys(sf.keys(), f))
    if names.keys() <= state.keys():
        yield from ((n, t) for n, t in state.items() if n in names)
        return
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for n in sf.keys():
                yield n, sf.get_tensor(n)


def commit_served(ctx: RankContext, version: int) -> None:
    """The version row of `version` is committed: the leader's server gives it from now on. A leader with a
    server staged the version it just published (`stager`), so a version it lacks is an error."""
    if ctx.weight_server is not None:
        ctx.weight_server.commit(version)


def close_weight_server(ctx: RankContext) -> None:
    """This rank no longer leads the trainer: stop its server (the next leader starts its own)."""
    if ctx.weight_server is None:
        return
    address = ctx.weight_server.address
    ctx.weight_server.close()
    ctx.weight_server = None
    if server_address(ctx) == address:
        ctx.paths.weight_server.unlink(missing_ok=True)


def server_address(ctx: RankContext) -> str | None:
    """The current leader's weight server (`host:port`), None where none runs."""
    try:
        return str(json.loads(ctx.paths.weight_server.read_text())["address"])
    except (OSError, ValueError, KeyError):
        return None


async def receive(ctx: RankContext, engine: Engine, version: int) -> int | str:
    """Have `engine` pull `version` (or newer) from the leader's server; the version loaded, or why not
    (the rank then reads the files)."""
    address = server_address(ctx)
    if address is None:
        return "no weight server is running"
    try:
        return await engine.receive_weights(address, version)
    except EngineError as e:
        return str(e)
