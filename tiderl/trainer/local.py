"""Run a trainer group (actor ranks + ref ranks) as local processes over gloo.

Used by the data-parallel tests and ``tools/bench_ra2p.py``; the real run's
ranks form the same group through :func:`tiderl.trainer.group.init_trainer_group`.
The group is formed once (actors + refs); then, for each mode in ``modes``,
the actor ranks start fresh from the base model and run ``warmup_steps +
num_steps`` steps of the (picklable) source in that mode; the ref ranks serve
the decoupled ones and sit the others out. Each rank writes its step figures
to ``out_dir/rank{R}.json`` (``{mode: [records of its measured steps]}``) and,
for actors, the final weights of each mode to ``out_dir/rank{R}-{mode}.pt``.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiderl.config.trainer import TrainerConfig
from tiderl.paths import RunPaths
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.rank import StepInput
from tiderl.trainer.synthetic import random_samples


@dataclass(frozen=True, slots=True)
class SyntheticSource:
    """Deterministic step inputs: the same on every rank, different every version."""

    num_groups: int = 4
    group_size: int = 4
    min_tokens: int = 16
    max_tokens: int = 64
    seed: int = 0
    vocab_size: int = 320

    def next_step(self, version: int, mode: Ra2pMode) -> StepInput:
        samples = random_samples(
            self.num_groups, self.group_size, vocab_size=self.vocab_size, min_tokens=self.min_tokens,
            max_tokens=self.max_tokens, version=version, seed=self.seed * 100_003 + version,
        )
        return StepInput(version=version, samples=tuple(samples), mode=mode)


@dataclass(frozen=True, slots=True)
class _ModeSource:
    source: SyntheticSource
    mode: Ra2pMode

    def next_step(self, version: int) -> StepInput:
        return self.source.next_step(version, self.mode)


@dataclass(frozen=True, slots=True)
class LocalGroupJob:
    config: TrainerConfig
    base_model: Path
    run_dir: Path  # one run directory per mode under it (RunPaths: its weights/ and ckpt/)
    out_dir: Path
    source: SyntheticSource
    modes: tuple[Ra2pMode, ...]
    num_actors: int
    num_refs: int
    num_steps: int
    threads_per_rank: int = 1
    warmup_steps: int = 0  # steps run (and published) before the measured ones


class LocalGroupError(RuntimeError):
    """A rank of a local trainer group failed."""


def _rank_main(rank: int, job: LocalGroupJob) -> None:
    import torch

    torch.set_num_threads(job.threads_per_rank)
    from tiderl.trainer.group import init_trainer_group, leave_trainer_group
    from tiderl.trainer.rank import ActorRank, RefRank
    from tiderl.trainer.step import StepStats
    from tiderl.trainer.store_io import BroadcastSource

    comm = init_trainer_group(rank, job.num_actors, job.num_refs, job.out_dir / "rendezvous")
    records: dict[str, list[dict[str, Any]]] = {}
    total = job.warmup_steps + job.num_steps
    try:
        ref = RefRank(job.config, comm, base_model=job.base_model) if rank >= job.num_actors else None
        for mode in job.modes:
            paths = RunPaths(job.run_dir / mode.value)
            out: list[dict[str, Any]] = []
            # Rank 0 makes each step's input and broadcasts it, as the leader does with the run store.
            source = BroadcastSource(_ModeSource(job.source, mode) if rank == 0 else None, rank)
            if ref is not None:
                for version in range(total):
                    inp = source.next_step(version)
                    if mode is Ra2pMode.DECOUPLED:
                        out.append(dataclasses.asdict(ref.serve_step(inp)))
            else:
                node = ActorRank(job.config, comm, base_model=job.base_model, weights_root=paths.weights,
                                 ckpt_root=paths.ckpt, with_ref=mode is not Ra2pMode.DECOUPLED, resume=False)
                for _ in range(total):
                    result = node.train_step(source.next_step(node.version))
                    stats = result if isinstance(result, StepStats) else result.stats
                    out.append(dataclasses.asdict(stats))
                weights = node.actor.full_weights()
                if weights:  # a sharded actor's full weights are gathered on the group's first rank only
                    torch.save(weights, job.out_dir / f"rank{rank}-{mode.value}.pt")
                del node
            # A mode may appear several times (benchmark rounds): its measured steps accumulate.
            records.setdefault(mode.value, []).extend(out[job.warmup_steps:])
        (job.out_dir / f"rank{rank}.json").write_text(json.dumps(records))
    finally:
        leave_trainer_group()


def run_local_group(job: LocalGroupJob, timeout_s: float = 600.0) -> list[dict[str, list[dict[str, Any]]]]:
    """Start every rank of ``job``, wait for all; returns each rank's ``{mode: per-step records}``."""
    if any(m is Ra2pMode.DECOUPLED for m in job.modes) and job.num_refs < 1:
        raise ValueError("decoupled mode needs num_refs >= 1")
    job.out_dir.mkdir(parents=True, exist_ok=True)
    (job.out_dir / "rendezvous").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    world = job.num_actors + job.num_refs
    procs = [ctx.Process(target=_rank_main, args=(r, job), name=f"trainer-rank{r}") for r in range(world)]
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(job.threads_per_rank)
    try:
        for p in procs:
            p.start()
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    failed = []
    for r, p in enumerate(procs):
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
            failed.append(f"rank {r} timed out after {timeout_s:.0f} s")
        elif p.exitcode != 0:
            failed.append(f"rank {r} exited with {p.exitcode}")
    if failed:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise LocalGroupError("; ".join(failed))
    return [json.loads((job.out_dir / f"rank{r}.json").read_text()) for r in range(world)]
