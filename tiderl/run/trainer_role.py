"""The actor and ref roles: claim complete groups from the store, train one step, publish version k+1.

Exactly-once: groups are claimed (ready -> claimed) for this rank; the step's
weights are written to `weights/v{k+1}` and `publish_version` consumes the
claimed trajectories and commits the version row in one transaction. Weights
or checkpoints newer than the store's version (a step that crashed before its
commit) are deleted when the actor starts, so a resumed run trains from the
committed version and the trajectories of the lost step are trained once.

Staleness: a group whose oldest generated token is more than
`max_staleness` versions behind the weights being trained is dropped, never
trained (its tokens do not count toward goodput).

Trainer groups: with `trainer.actor_ranks` > 1 (data-parallel actors) or in
RA2P decoupled mode, the actors (leader first) and the step's ref ranks form a
gloo group once the leader has the step's data (a fresh rendezvous file, named
by the version, where the layout changed; the previous version's group where it
did not: `tiderl.trainer.group.HeldGroup`); the leader broadcasts the step's data
in chunks (one for a system that does not stream; `SystemBehaviour.streams`: one
as soon as a micro-batch per actor is claimed, then what became ready meanwhile),
each chunk announced by a marker file first so that no rank waits for data inside
a collective; each actor trains its share of every chunk's micro-batches
(gradients all-reduced at the optimizer step), the refs serve ref_logprobs, only
the leader publishes.
With `ers.elastic_actors`, an actor that joined the group at this boundary (or
returns to it) holds an older version: before the step it takes the weights
and optimizer state of an actor that holds the step's version
(`ActorRank.catch_up`), so the data-parallel replicas stay identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tiderl.paths import atomic_write_text, when_room
from tiderl.run import handoff
from tiderl.run.bell import SLICE_S
from tiderl.run.context import RankContext
from tiderl.run.trainer_gather import DataWait, StepGather
from tiderl.systems import FetchPolicy
from tiderl.store.types import (EventRecord, GroupState, MetricPoint, PlanRecord, RankReport, ReadyTrajectory, Role,
                                TaskKind, VersionRecord)

if TYPE_CHECKING:  # torch-backed: imported where a role first needs them
    from tiderl.trainer.modes import TrainerComm
    from tiderl.trainer.rank import ActorRank, PublishedStep, RefRank, StepChunk
    from tiderl.trainer.step import StepStats

T = TypeVar("T")
log = logging.getLogger(__name__)


def _discard_uncommitted(ctx: RankContext, version: int) -> None:
    """Weights and checkpoints of steps after `version` were never committed: delete them."""
    for path in ctx.paths.uncommitted(version):
        shutil.rmtree(path, ignore_errors=True)


def _sharded(ctx: RankContext, actors: list[int]) -> bool:
    """Whether this step's actor is sharded over its data-parallel group (built inside the group)."""
    from tiderl.trainer.registry import SHARDED

    return ctx.config.trainer.backend in SHARDED and len(actors) > 1


def _actor(ctx: RankContext, version: int, *, leader: bool = True, comm: TrainerComm | None = None) -> ActorRank:
    """This rank's actor. With `comm` (a sharded backend's step), the actor whose state is sharded over
    `comm`'s data-parallel group: one built in another group is dropped (its shards went with that group)
    and every member builds anew from the newest published version and optimizer checkpoint."""
    if comm is not None and ctx.actor is not None and ctx.actor.comm is not comm:
        drop_actor(ctx)
    if ctx.actor is None:
        import torch

        from tiderl.run import weights
        from tiderl.trainer.modes import TrainerComm
        from tiderl.trainer.rank import ActorRank

        torch.set_num_threads(1)
        torch.manual_seed(ctx.config.seed)
        if leader:  # the only rank that writes weights and checkpoints
            _discard_uncommitted(ctx, version)
        if handoff.sharded_backend(ctx):  # the ranks that held the state of another layout check it in
            handoff.await_handoff(ctx, version, timeout_s=ctx.config.launch.heartbeat_timeout_s * 4)
        actor = ActorRank(ctx.config.trainer, comm or TrainerComm(rank=0, actor_ranks=(0,)), base_model=ctx.model_dir,
                          weights_root=ctx.paths.weights, ckpt_root=ctx.paths.ckpt, with_ref=True,
                          disk_full_wait_s=ctx.config.store.disk_full_wait_s,
                          temperature=ctx.config.rollout.temperature, stage=weights.stager(ctx))
        if comm is not None:
            log.info("actor group rank %d: %s actor built in the group, %d parameters held here (version %d)",
                     comm.rank, ctx.config.trainer.backend, getattr(actor.actor, "local_params", -1), actor.version)
        # A data-parallel follower that holds another version takes it from the group (catch_up).
        if leader and actor.version != version:
            raise RuntimeError(f"actor rank {ctx.rank}: resumed weights are version {actor.version}, "
                               f"the run store is at version {version}")
        ctx.actor = actor
    return ctx.actor


def drop_actor(ctx: RankContext) -> None:
    """Free this rank's actor (and its accelerator memory) before another is built."""
    import gc

    import torch

    ctx.actor = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fetch(ctx: RankContext, plan: PlanRecord) -> int:
    """Groups the step trains: by the system's fetch policy; the run's last step also takes every training
    group still open or ready, up to groups_ideal (the feeder sized the run's groups by full batches, so
    after elastic steps some would otherwise be generated and never trained)."""
    t = ctx.config.trainer
    if ctx.system.fetch_policy is FetchPolicy.MIN:
        need = t.groups_min
    elif ctx.system.fetch_policy is FetchPolicy.ERS:
        need = max(t.groups_min, min(t.groups_ideal, plan.fetch_groups))
    else:
        need = t.groups_ideal
    if plan.version == t.num_steps - 1 and need < t.groups_ideal:
        counts = ctx.store.groups_by_state(TaskKind.TRAIN)
        need = max(need, min(t.groups_ideal, counts[GroupState.OPEN] + counts[GroupState.READY]))
    return need


async def run_actor_step(ctx: RankContext, plan: PlanRecord) -> None:
    """Train version `plan.version` into version + 1; the leader (lowest actor rank) gathers the
    data, trains with the other actors (data parallel) and commits the version.

    A streaming system (`SystemBehaviour.streams`: RA2P's streaming) trains the step in chunks: as soon
    as a micro-batch's worth of tokens per actor is claimed, the leader hands the chunk to the group and
    every rank trains it (gradients accumulated), then claims what became ready meanwhile (ready-batch
    aggregation); the optimizer step follows the chunk that completes the fetch. The others train the
    whole fetch as one chunk once it is claimed."""
    from tiderl.policy.ra2p import Ra2pMode
    from tiderl.run import weights
    from tiderl.trainer.rank import PublishedStep

    actors = plan.ranks_with(Role.ACTOR)
    if ctx.rank != actors[0]:
        weights.close_weight_server(ctx)  # another rank leads now
        await _follow_actor_step(ctx, plan, actors)
        return
    sharded = _sharded(ctx, actors)
    actor = None if sharded else _actor(ctx, plan.version)
    started = time.time()
    mode = plan.ra2p_mode
    refs = plan.ranks_with(Role.REF)
    if mode is Ra2pMode.DECOUPLED and not refs:
        raise RuntimeError(f"version {plan.version}: decoupled RA2P mode planned without a ref rank")
    members = refs if mode is Ra2pMode.DECOUPLED else []
    wait = DataWait(ctx, plan.version, Role.ACTOR)
    gather = StepGather(ctx, plan, _fetch(ctx, plan), wait)
    chunk_tokens = ctx.config.trainer.micro_batch_tokens * len(actors) if ctx.system.streams else None
    first = await gather.next(chunk_tokens)
    if members or len(actors) > 1:
        # The other ranks join the group only once the step's first data is here (waiting for data can
        # outlast any rendezvous timeout, e.g. while the rollout engines start), and wait for each later
        # chunk's marker outside any collective.
        generation = ctx.store.trainer_generation().number

        def announce(chunk: int) -> None:
            marker = ctx.paths.data_ready(plan.version, generation, chunk)
            when_room(lambda: atomic_write_text(marker, json.dumps({"actors": actors, "refs": members})),
                      wait_s=ctx.config.store.disk_full_wait_s, what=f"the step marker {marker}")

        announce(0)
        result = await _in_group(ctx, plan, generation, actors, members,
                                 lambda comm: _lead(ctx, actor or _actor(ctx, plan.version, comm=comm), comm, plan,
                                                    gather, first, chunk_tokens, announce))
    else:
        release_trainer_group(ctx)
        assert actor is not None  # one actor: never sharded
        result = await _lead(ctx, actor, None, plan, gather, first, chunk_tokens, None)
    if not isinstance(result, PublishedStep):
        raise RuntimeError(f"actor rank {ctx.rank}: led version {plan.version} but published nothing")
    claimed, dropped = gather.claimed, gather.dropped
    ras, tprm = gather.readiness()
    wait_s, waited = wait.seconds, wait.rest()
    stats = result.stats
    record = VersionRecord(version=plan.version + 1, path=str(result.published.path),
                           checksum=result.published.checksum, trajectory_ids=[t.id for t in claimed],
                           step_started_at=started, duration_s=time.time() - started, ras=ras, tprm_s=tprm,
                           ra2p_mode=mode, loss=stats.loss)
    handoff.record_holders(ctx, plan.version + 1, actors, ctx.store.trainer_generation().number)
    ctx.store.publish_version(record, owner=ctx.rank)
    weights.commit_served(ctx, plan.version + 1)  # engines may take it without files from now on
    ctx.bell("published").ring()  # the control plane plans the next version now, not at its next tick
    from tiderl.trainer.step import MISMATCH_KEYS

    v = plan.version
    from tiderl.trainer.rank import lr_at

    metrics = [waited, MetricPoint("loss", stats.loss, v, "actor"), MetricPoint("pg_loss", stats.pg_loss, v, "actor"),
               MetricPoint("grad_norm", stats.grad_norm, v, "actor"),
               MetricPoint("lr", lr_at(ctx.config.trainer, v), v, "actor"),
               MetricPoint("response_tokens_mean", stats.num_tokens / max(stats.num_sequences, 1), v, "actor"),
               MetricPoint("kl", stats.kl, v, "actor"), MetricPoint("entropy", stats.entropy, v, "actor"),
               MetricPoint("clip_frac", stats.clip_frac, v, "actor"),
               *(MetricPoint(n, getattr(stats, n), v, "actor") for n in MISMATCH_KEYS if not math.isnan(getattr(stats, n))),
               MetricPoint("is_weight_mean", stats.is_weight_mean, v, "actor"),
               MetricPoint("is_truncated_frac", stats.is_truncated_frac, v, "actor"),
               MetricPoint("staleness_max", stats.staleness_max, v, "actor"),
               MetricPoint("train_s", stats.duration_s, v, "actor"), MetricPoint("chunks", gather.chunks, v, "actor")]
    metrics += [MetricPoint(n, getattr(stats, n), v, "actor") for n in ("t_ref_s", "t_act_f_s", "t_act_b_s",
                                                                          "t_swap_s") if getattr(stats, n) > 0]
    events = [EventRecord("stale_dropped", f"{dropped} groups dropped as too stale for version {v}")] if dropped else []
    ctx.store.report(RankReport(rank=ctx.rank, metrics=metrics, events=events, role=Role.ACTOR, version=v + 1))
    log.info("rank %d: version %d published (%d trajectories in %d chunks, %s, RAS %d, waited %.1f s)", ctx.rank,
             v + 1, len(claimed), gather.chunks, mode.value, ras, wait_s)


def _samples(ctx: RankContext, trajectories: list[ReadyTrajectory]) -> tuple:
    from tiderl.trainer.images import ImageInputs
    from tiderl.trainer.store_io import samples_from_ready

    images = ImageInputs.of_model(ctx.model_dir) if any(t.images for t in trajectories) else None
    return tuple(s for t in trajectories for s in samples_from_ready(t, images))


async def _lead(ctx: RankContext, actor: ActorRank, comm: TrainerComm | None, plan: PlanRecord, gather: StepGather,
                first: list[ReadyTrajectory], chunk_tokens: int | None,
                announce: Callable[[int], None] | None) -> PublishedStep | StepStats:
    """The leader's step: hand each chunk to the group (marker, then broadcast) and train its share."""
    import torch.distributed as dist

    from tiderl.trainer.rank import StepChunk

    async def chunk(k: int) -> StepChunk:
        claimed = first if k == 0 else await gather.next(chunk_tokens)
        msg = StepChunk(plan.version, plan.ra2p_mode, _samples(ctx, claimed), last=gather.complete)
        if comm is not None:
            if k and announce is not None:
                announce(k)
            dist.broadcast_object_list([msg], src=0)
        return msg

    with _joined(actor, comm):
        return await _train_chunks(actor, chunk, lambda msg: _begin(actor, comm, msg))


async def _train_chunks(rank: ActorRank | RefRank, chunk: Callable[[int], Awaitable[StepChunk]],
                        begin: Callable[[StepChunk], None]) -> PublishedStep | StepStats | None:
    """The chunk loop of every trainer rank in a step (the leader, a data-parallel follower, a ref): take
    chunk k (`chunk(k)`: the leader claims and broadcasts it, the others receive it), `begin` the step
    with chunk 0, feed each chunk's samples to `rank`, and after the last chunk return `rank`'s
    `finish_step()`."""
    k = 0
    while True:
        msg = await chunk(k)
        if k == 0:
            begin(msg)
        rank.feed(msg.samples)
        if msg.last:
            return rank.finish_step()
        k += 1


@contextlib.contextmanager
def _joined(actor: ActorRank, comm: TrainerComm | None) -> Iterator[None]:
    """The actor trains as a member of this version's group (its data-parallel subgroup too)."""
    if comm is None:
        yield
        return
    previous, actor.comm = actor.comm, comm
    previous_dp, actor.actor.dp_group = actor.actor.dp_group, comm.dp_group
    try:
        yield
    finally:
        actor.comm, actor.actor.dp_group = previous, previous_dp


def _begin(actor: ActorRank, comm: TrainerComm | None, msg: StepChunk) -> None:
    if comm is not None:
        held, exact = actor.version, actor.exact
        if actor.catch_up(msg.version):
            log.info("actor group rank %d: took version %d (weights and optimizer state) from the group, "
                     "held version %d%s", comm.rank, msg.version, held,
                     "" if exact else " with the optimizer state of another version")
    actor.begin_step(msg.version, msg.mode)


async def _next_chunk(ctx: RankContext, version: int, generation: int, k: int, role: Role) -> StepChunk:
    """A follower's chunk `k` of the step: its marker (chunk 0's was awaited before the group formed),
    then the leader's broadcast."""
    import torch.distributed as dist

    if k:
        await _await_marker(ctx, ctx.paths.data_ready(version, generation, k), DataWait(ctx, version, role))
    box: list[StepChunk | None] = [None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None  # broadcast_object_list filled it in
    return box[0]


async def _follow_actor_step(ctx: RankContext, plan: PlanRecord, actors: list[int]) -> None:
    """A data-parallel actor that does not lead: take the leader's chunks of the step, train its share of
    each chunk's micro-batches (gradients all-reduced at the optimizer step), publish nothing."""
    sharded = _sharded(ctx, actors)
    held = None if sharded else _actor(ctx, plan.version, leader=False)
    members, generation = await _wait_marker(ctx, plan.version, Role.ACTOR)

    async def follow(comm: TrainerComm) -> PublishedStep | StepStats | None:
        actor = held or _actor(ctx, plan.version, leader=False, comm=comm)
        with _joined(actor, comm):
            return await _train_chunks(actor, lambda k: _next_chunk(ctx, plan.version, generation, k, Role.ACTOR),
                                       lambda msg: _begin(actor, comm, msg))

    stats = await _in_group(ctx, plan, generation, actors, members, follow)
    ctx.store.report(RankReport(rank=ctx.rank, role=Role.ACTOR, version=plan.version, metrics=[
        MetricPoint("train_s", stats.duration_s, plan.version, "actor")]))


async def _in_group(ctx: RankContext, plan: PlanRecord, generation: int, actors: list[int], refs: list[int],
                    body: Callable[[TrainerComm], Awaitable[T]]) -> T:
    """Run `body(comm)` inside this version's trainer group of restart generation `generation`: the
    actors (group ranks 0.., the leader first), then the refs of a decoupled step. The group of the
    previous version is kept where it continues (`HeldGroup.continues`), else formed anew; a failed step
    leaves it."""
    from tiderl.trainer.group import HeldGroup, init_trainer_group

    layout = (tuple(actors), tuple(refs), generation)
    held = ctx.trainer_group
    if held is None or not held.continues(layout, plan.version):
        release_trainer_group(ctx)
        index = actors.index(ctx.rank) if ctx.rank in actors else len(actors) + refs.index(ctx.rank)
        comm = init_trainer_group(index, len(actors), len(refs),
                                  ctx.paths.rendezvous_version(plan.version, generation),
                                  timeout_s=ctx.config.launch.heartbeat_timeout_s * 4)
        held = ctx.trainer_group = HeldGroup(layout, plan.version, comm)
    try:
        result = await body(held.comm)
    except BaseException:
        release_trainer_group(ctx)
        raise
    held.version = plan.version
    return result


def release_trainer_group(ctx: RankContext) -> None:
    """Leave the trainer group this rank holds, if any (before another role, or a step without a group)."""
    if ctx.trainer_group is not None:
        from tiderl.trainer.group import leave_trainer_group

        ctx.trainer_group = None
        if ctx.actor is not None and ctx.actor.actor.collective_io and ctx.actor.comm.dp_group is not None:
            drop_actor(ctx)  # its shards are of this group's state: useless without the group
        leave_trainer_group()


async def _wait_marker(ctx: RankContext, version: int, role: Role) -> tuple[list[int], int]:
    """Wait until the leader has the step's data; returns the ref ranks of the step's group and the
    trainer group's restart generation it meets in. The wait is this trainer rank's TWT (recorded every
    `trainer_gather.TWT_REPORT_S` while it lasts)."""
    generation = ctx.store.trainer_generation().number
    marker = ctx.paths.data_ready(version, generation)
    await _await_marker(ctx, marker, DataWait(ctx, version, role))
    return list(json.loads(marker.read_text())["refs"]), generation


async def _await_marker(ctx: RankContext, marker: Path, wait: DataWait) -> None:
    """Wait for the leader's marker file: a stat every bell's look (the leader's broadcast waits for this
    rank), the store (has the run stopped?) every poll."""
    wait.begin()
    polled = float("-inf")
    while not marker.exists():
        if time.monotonic() - polled >= ctx.poll_s:
            polled = time.monotonic()
            ctx.position()  # leaves if the run stopped
            wait.tick()
        await asyncio.sleep(SLICE_S)
    ctx.store.report(RankReport(rank=ctx.rank, metrics=[wait.rest()]))


def _ref(ctx: RankContext) -> RefRank:
    if ctx.ref is None:
        import torch

        from tiderl.trainer.modes import TrainerComm
        from tiderl.trainer.rank import RefRank

        torch.set_num_threads(1)
        ctx.ref = RefRank(ctx.config.trainer, TrainerComm(rank=1, actor_ranks=(0,), ref_ranks=(1,)),
                          base_model=ctx.model_dir, temperature=ctx.config.rollout.temperature)
    return ctx.ref


async def run_ref_step(ctx: RankContext, plan: PlanRecord) -> None:
    """Serve the actor's reference forwards of step `plan.version` (decoupled mode only), chunk by chunk."""
    ref = _ref(ctx)
    refs, generation = await _wait_marker(ctx, plan.version, Role.REF)

    async def serve(comm: TrainerComm) -> None:
        previous, ref.comm = ref.comm, comm
        try:
            await _train_chunks(ref, lambda k: _next_chunk(ctx, plan.version, generation, k, Role.REF),
                                lambda msg: ref.begin_step(msg.version, msg.mode))
        finally:
            ref.comm = previous

    await _in_group(ctx, plan, generation, plan.ranks_with(Role.ACTOR), refs, serve)
