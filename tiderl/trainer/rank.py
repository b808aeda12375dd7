"""Trainer ranks: one step of an actor rank or of a ref rank, given the step's input.

One step on an actor rank (`ActorRank.train_step`): plan the step's input
(deterministic, so every rank of the trainer group agrees), run this rank's
share in the step's RA2P mode, optimizer step; then actor 0 publishes weights
version k+1 and checkpoints every M steps. A ref rank (`RefRank.serve_step`,
decoupled mode) plans the same step and serves ref_logprobs.

A streamed step (`begin_step`, `feed` per chunk, `finish_step`) trains the
step's groups in chunks as they become ready: each chunk is planned by a
`ChunkPlanner` (the same on every rank) and trained at once, its losses
divided by a provisional divisor (the first chunk's model tokens); the
optimizer step rescales the gradients to the whole batch's divisor, so the
update equals the batch step's over the same samples.

The run drives them from tiderl.run.trainer_role (claims from the run store in,
the version row committed after the publish); tools/bench_ra2p.py through
tiderl.trainer.local (a `StepSource` broadcast to the group).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tiderl.config.trainer import TrainerConfig
from tiderl.paths import version_dir, weight_versions_in
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.backend import ActorBackend, OptimConfig, RefBackend, make_backend
from tiderl.trainer.batch import TrainSample
from tiderl.trainer.modes import RefStats, TrainerComm, finish_actor_step, run_actor, run_actor_share, run_ref
from tiderl.trainer.plan import ChunkPlanner, StepPlan, drop_flat_groups, drop_truncated, plan_step
from tiderl.trainer.publish import Checkpoint, Checkpointer, ChecksumError, PublishedVersion, WeightPublisher, verify
from tiderl.trainer.step import LossConfig, StepAccumulator, StepStats

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class StepInput:
    """What one step trains on: complete groups' samples, the mode, optional ready times."""

    version: int  # weights version being trained; the step publishes version + 1
    samples: tuple[TrainSample, ...]
    mode: Ra2pMode
    sample_ready_s: tuple[float, ...] | None = None  # seconds after the step start; None: all ready


@dataclass(frozen=True, slots=True)
class StepChunk:
    """One chunk of a streamed step, as the leader broadcasts it to the trainer group: complete groups'
    samples that became ready; ``last``: the step's fetch is complete, the optimizer step follows."""

    version: int
    mode: Ra2pMode
    samples: tuple[TrainSample, ...]
    last: bool


class StepSource(Protocol):
    def next_step(self, version: int) -> StepInput | None:
        """The input of the step that trains ``version``; None when training is over."""


@dataclass(frozen=True, slots=True)
class PublishedStep:
    """What the leader returns for a step whose weights version it published."""

    stats: StepStats
    published: PublishedVersion
    trajectory_ids: tuple[int | str, ...]
    mode: Ra2pMode
    checkpoint: Path | None


@dataclass(frozen=True, slots=True)
class ResumePoint:
    version: int
    weights_path: Path  # where the actor's weights come from
    checkpoint: Checkpoint | None  # optimizer state (None: fresh AdamW moments)

    @property
    def is_exact(self) -> bool:
        """Whether the optimizer state belongs to exactly these weights."""
        return self.checkpoint is not None and self.checkpoint.version == self.version


def find_resume_point(base_model: Path, weights_root: Path, ckpt_root: Path, keep_checkpoints: int = 2) -> ResumePoint:
    """Continue from the newest published version that verifies, with the newest optimizer checkpoint.

    Weights are published every step and checkpoints every M steps, so the
    newest weights are never older than the checkpoint; when the checkpoint is
    older, its AdamW moments are reused for the newer weights (no step is
    redone, so no trajectory is trained twice).
    """
    ckpt = Checkpointer(ckpt_root, every=1, keep=keep_checkpoints).latest()
    for v in reversed(weight_versions_in(weights_root)):
        path = version_dir(weights_root, v)
        try:
            verify(path)
        except ChecksumError:
            continue
        return ResumePoint(version=v, weights_path=path, checkpoint=ckpt)
    return ResumePoint(version=0, weights_path=base_model, checkpoint=None)


def loss_config(config: TrainerConfig) -> LossConfig:
    return LossConfig(clip_eps=config.clip_eps, kl_coef=config.kl_coef, kl_estimator=config.kl_estimator,
                      dual_clip=config.dual_clip, off_policy=config.off_policy, is_cap=config.is_cap)


def lr_at(config: TrainerConfig, version: int) -> float:
    """The learning rate of the step that trains ``version`` under ``config.lr_schedule``, scaled by
    the warm-up (``config.lr_warmup_steps``)."""
    warmup = min(1.0, (version + 1) / config.lr_warmup_steps) if config.lr_warmup_steps else 1.0
    if config.lr_schedule == "constant":
        return config.lr * warmup
    progress = min(max(version / config.num_steps, 0.0), 1.0)
    if config.lr_schedule == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * warmup * (config.lr_final_ratio + (1.0 - config.lr_final_ratio) * shape)


def chunk_planner(config: TrainerConfig, version: int, mode: Ra2pMode, num_actors: int) -> ChunkPlanner:
    """The planner of a streamed step, the same on every actor and ref rank."""
    return ChunkPlanner(version=version, mode=mode, num_actors=num_actors, micro_batch_tokens=config.micro_batch_tokens,
                        skip_flat_groups=config.skip_flat_groups, mask_truncated=config.mask_truncated)


@dataclass(slots=True)
class _Streamed:
    """A streamed step in progress on an actor rank."""

    planner: ChunkPlanner
    acc: StepAccumulator
    started: float
    trajectory_ids: list[int | str]
    provisional: float = 0.0  # the losses' divisor until the step's whole batch is known


def build_plan(inp: StepInput, config: TrainerConfig, comm: TrainerComm, pad_id: int = 0) -> StepPlan:
    """The step's plan, the same on every actor and ref rank (each builds it from the same input)."""
    samples, ready = list(inp.samples), inp.sample_ready_s
    if config.skip_flat_groups:
        samples, ready, _ = drop_flat_groups(samples, ready)
    if config.mask_truncated:
        samples, ready, _ = drop_truncated(samples, ready)
    return plan_step(
        samples,
        version=inp.version,
        mode=inp.mode,
        num_actors=len(comm.actor_ranks),
        micro_batch_tokens=config.micro_batch_tokens,
        sample_ready_s=ready,
        pad_id=pad_id,
    )


class ActorRank:
    """An actor rank for one layout; holds the reference model too when it may run colocated."""

    def __init__(
        self,
        config: TrainerConfig,
        comm: TrainerComm,
        *,
        base_model: Path,
        weights_root: Path,
        ckpt_root: Path,
        with_ref: bool,
        device: str = "cpu",
        resume: bool = True,
        disk_full_wait_s: float = 0.0,
        temperature: float = 1.0,
        stage: Callable[[int, Mapping[str, torch.Tensor]], None] | None = None,
    ) -> None:
        """`temperature`: the sampling temperature of the trajectories (rollout.temperature); the actor and
        the reference score tokens under softmax(logits / temperature), as the engine sampled them.
        `stage`: the leader hands it each version it publishes, with the full weights (the weight server's
        :meth:`~tiderl.weightsync.server.WeightServer.stage`, for engines that receive weights without files)."""
        self.config = config
        self.comm = comm
        self.stage = stage
        point = (
            find_resume_point(base_model, weights_root, ckpt_root, config.keep_checkpoints)
            if resume
            else ResumePoint(0, base_model, None)
        )
        self.resumed_from = point
        self.version = point.version
        # Whether the optimizer state belongs to these weights: fresh moments do at version 0, a
        # checkpoint of another version does not; after a step (or a catch_up) it always does.
        self.exact = point.version == 0 or point.is_exact
        optim = OptimConfig(lr=config.lr, weight_decay=config.weight_decay, grad_clip=config.grad_clip)
        self.actor: ActorBackend = make_backend(
            config.backend, "actor", point.weights_path, device=device, optim=optim, dp_group=comm.dp_group,
            temperature=temperature, dtype=config.dtype, activation_checkpointing=config.activation_checkpointing,
        )
        self.ref: RefBackend | None = None
        if with_ref:
            self.ref = make_backend(config.backend, "ref", base_model, device=device, temperature=temperature)
            self.ref.offload()  # colocation: one model on the device at a time
        self.checkpointer = Checkpointer(ckpt_root, config.checkpoint_every, config.keep_checkpoints,
                                         disk_full_wait_s=disk_full_wait_s)
        if point.checkpoint is not None:
            self.checkpointer.restore(self.actor, point.checkpoint, weights=False)
        self.publisher = WeightPublisher(weights_root, base_model, config.keep_versions,
                                         disk_full_wait_s=disk_full_wait_s)
        self.steps_done = 0
        self._streamed: _Streamed | None = None

    @property
    def is_leader(self) -> bool:
        return self.comm.actor_index == 0

    def catch_up(self, version: int) -> bool:
        """Bring every actor of this rank's data-parallel group to the same state before it trains
        ``version``.

        Collective over ``comm.dp_group`` (every actor of the step calls it). An actor that joined
        the group at this boundary (an elastic-actor move) loaded the published weights with the
        optimizer moments of an older checkpoint; one that returns holds the version it had when it
        left. The lowest group rank whose weights are ``version`` and whose optimizer state belongs
        to them (:attr:`exact`) sends both to every member that differs, so the replicas stay
        identical. If no member is exact, members at ``version`` loaded the same files and the
        lowest of them is the source. Returns whether this rank's state was replaced; raises if no
        actor holds ``version``.
        """
        import torch.distributed as dist

        group = self.comm.dp_group
        if group is None:
            if self.version != version:
                raise RuntimeError(f"actor: holds version {self.version}, the step trains version {version}, "
                                   f"and no other actor rank can send it")
            return False
        states: list[tuple[int, bool] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, (self.version, self.exact), group=group)
        at_version = [i for i, st in enumerate(states) if st is not None and st[0] == version]
        sources = [i for i in at_version if states[i][1]] or at_version  # type: ignore[index]
        if not sources:
            raise RuntimeError(f"actor group: no rank holds version {version} to train it "
                               f"(ranks hold versions {[st[0] for st in states if st is not None]})")
        best = states[sources[0]]
        if all(st == best for st in states):
            return False
        self.actor.take_state_from(dist.get_global_rank(group, sources[0]))  # tensor by tensor, nothing pickled
        if (self.version, self.exact) == best:
            return False
        self.version, self.exact = best  # type: ignore[misc]
        return True

    def hand_off(self) -> Path | None:
        """Checkpoint the state this rank holds, now, for the actor ranks that train the next step in another
        layout (ERS moved actors, or a ref rank joined or left the group): they read it re-sharded onto their
        own group. Every rank the state is sharded over calls it (a collective); the group's first rank
        returns the checkpoint's path."""
        return self.checkpointer.save(self.actor, step=self.version, version=self.version,
                                      extra={"handoff": True})

    def train_step(self, inp: StepInput) -> PublishedStep | StepStats:
        """Train one step; the leader publishes and returns a PublishedStep, the others their StepStats."""
        if inp.version != self.version:
            raise ValueError(f"step input trains version {inp.version}, this rank holds version {self.version}")
        started = time.perf_counter()
        self.actor.set_lr(lr_at(self.config, inp.version))
        plan = build_plan(inp, self.config, self.comm)
        stats = run_actor(
            plan, self.actor, self.ref, self.comm, loss_config(self.config),
            max_aggregate=self.config.max_aggregate, started=started,
        )
        return self._complete(stats, tuple(s.trajectory_id for s in inp.samples), inp.mode)

    # ---- a streamed step: begin, one feed per chunk of ready groups, finish --------------------------
    def begin_step(self, version: int, mode: Ra2pMode) -> None:
        """Start a step that trains ``version`` from chunks of groups as they become ready (RA2P's
        streaming: each chunk's micro-batches are trained, gradients accumulated, while later groups are
        still being generated). Every rank of the step's group calls it, then :meth:`feed` with the same
        chunks, then :meth:`finish_step`."""
        if version != self.version:
            raise ValueError(f"step trains version {version}, this rank holds version {self.version}")
        self.actor.set_lr(lr_at(self.config, version))
        self._streamed = _Streamed(chunk_planner(self.config, version, mode, len(self.comm.actor_ranks)),
                                   StepAccumulator(version=version), time.perf_counter(), [])

    def feed(self, samples: tuple[TrainSample, ...]) -> None:
        """Train this rank's share of a chunk's micro-batches (collective over the step's group)."""
        st = self._stream()
        st.trajectory_ids += [s.trajectory_id for s in samples]
        self._run_chunk(st, st.planner.chunk(samples))

    def finish_step(self) -> PublishedStep | StepStats:
        """The optimizer step over the whole batch; the leader publishes (as :meth:`train_step`)."""
        st = self._stream()
        self._run_chunk(st, st.planner.final())
        if st.planner.normalizer <= 0:
            raise ValueError(f"step of version {st.acc.version}: no sample with model tokens in {st.planner.chunks} "
                             f"chunks")
        # Every loss was divided by the provisional divisor: rescale to the batch's (the GRPO loss divides
        # by the whole global batch's model tokens), so the update is the batch step's.
        scale = st.provisional / st.planner.normalizer
        st.acc.loss_sum *= scale
        stats = finish_actor_step(self.actor, st.acc, st.started, self.comm, grad_scale=scale)
        self._streamed = None
        return self._complete(stats, tuple(st.trajectory_ids), st.planner.mode)

    def _stream(self) -> _Streamed:
        if self._streamed is None:
            raise RuntimeError("actor: no streamed step begun (begin_step first)")
        return self._streamed

    def _run_chunk(self, st: _Streamed, planned: tuple[StepPlan, int] | None) -> None:
        if planned is None:
            return
        plan, tag_base = planned
        if not st.provisional:
            st.provisional = plan.normalizer  # the first chunk's tokens: the same order as the batch's
        run_actor_share(plan, self.actor, self.ref, self.comm, loss_config(self.config), st.acc,
                        normalizer=st.provisional, tag_base=tag_base, max_aggregate=self.config.max_aggregate)

    def _complete(self, stats: StepStats, trajectory_ids: tuple[int | str, ...], mode: Ra2pMode
                  ) -> PublishedStep | StepStats:
        self.version += 1
        self.exact = True
        self.steps_done += 1
        if not self.is_leader:
            if self.actor.collective_io:  # a sharded actor: this rank's shards take part in what the leader writes
                self.actor.save_weights(None)
                if self.checkpointer.is_due(self.version):
                    self.checkpointer.save(self.actor, step=self.version, version=self.version)
            return stats
        published = self.publisher.publish(self.actor, self.version)
        if self.stage is not None:  # the weights just written (a sharded actor's gather is held for the step)
            self.stage(self.version, self.actor.full_weights())
        ckpt = None
        if self.checkpointer.is_due(self.version):
            ckpt = self.checkpointer.save(self.actor, step=self.version, version=self.version)
        return PublishedStep(stats=stats, published=published, trajectory_ids=trajectory_ids, mode=mode,
                             checkpoint=ckpt)


class RefRank:
    """A decoupled-mode reference rank serving the actor group."""

    def __init__(self, config: TrainerConfig, comm: TrainerComm, *, base_model: Path, device: str = "cpu",
                 temperature: float = 1.0) -> None:
        self.config = config
        self.comm = comm
        self.ref: RefBackend = make_backend(config.backend, "ref", base_model, device=device, temperature=temperature)
        self._planner: ChunkPlanner | None = None

    def serve_step(self, inp: StepInput) -> RefStats:
        return run_ref(build_plan(inp, self.config, self.comm), self.ref, self.comm)

    def begin_step(self, version: int, mode: Ra2pMode) -> None:
        """Serve a streamed step (:meth:`ActorRank.begin_step`): then :meth:`feed` each chunk, :meth:`finish_step`."""
        self._planner = chunk_planner(self.config, version, mode, len(self.comm.actor_ranks))

    def feed(self, samples: tuple[TrainSample, ...]) -> None:
        planned = self._stream().chunk(samples)
        if planned is not None:
            run_ref(planned[0], self.ref, self.comm, tag_base=planned[1])

    def finish_step(self) -> None:
        planned = self._stream().final()
        self._planner = None
        if planned is not None:
            run_ref(planned[0], self.ref, self.comm, tag_base=planned[1])

    def _stream(self) -> ChunkPlanner:
        if self._planner is None:
            raise RuntimeError("ref: no streamed step begun (begin_step first)")
        return self._planner
