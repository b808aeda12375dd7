"""A sharded actor's state across a change of layout: the old ranks check it in, the new ranks read it.

A sharded backend's actor (``trainer.backend: fsdp``) lives as shards over the trainer group it was built in.
When the next step's layout differs (ERS moved an actor to or from rollout, or a decoupled step's ref rank
joined or left the group), that group ends, and with it the shards. So, before a rank acts on the plan of the
next version, the ranks that hold the state and do not keep it check it in together: a DCP checkpoint of the
version they hold (`ActorRank.hand_off`: every rank writes its own shards, nothing is gathered). The ranks of
the new layout build their actor from the published weights and that checkpoint, re-sharded onto their own
group: the same weights, and the same AdamW moments, bit for bit.

The new ranks may form their group before the old ones have checked the state in (when none of the old ranks
is in the new layout). So the leader that publishes a version of a sharded actor names the ranks that hold it
and their processes (`RunPaths.trainer_layout`), and a rank that builds a sharded actor for that version waits
for its checkpoint while those same processes run in the same restart generation. A restart (a new generation,
or a rank's new process) ends the wait: the new ranks then resume from the newest checkpoint, as after any
restart.

A lone actor of a sharded backend (its state whole, on one rank) hands off alike when the next step shards it.
The replicated ``torch`` backend needs none of this: a rank that joins the group takes the state from a
replica (`ActorRank.catch_up`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from tiderl.paths import atomic_write_text
from tiderl.run.context import RankContext
from tiderl.store.types import EventRecord, MetricPoint, PlanRecord, RankReport, Role

log = logging.getLogger(__name__)
POLL_S = 0.05


def sharded_backend(ctx: RankContext) -> bool:
    from tiderl.trainer.registry import SHARDED

    return ctx.config.trainer.backend in SHARDED


def layout_of(plan: PlanRecord, generation: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The trainer group of `plan`'s step (tiderl.trainer.group.Layout): its actors, the refs of a decoupled
    step, the restart generation."""
    from tiderl.policy.ra2p import Ra2pMode

    refs = plan.ranks_with(Role.REF) if plan.ra2p_mode is Ra2pMode.DECOUPLED else []
    return tuple(plan.ranks_with(Role.ACTOR)), tuple(refs), generation


def record_holders(ctx: RankContext, version: int, actors: Sequence[int], generation: int) -> None:
    """The leader, before it commits `version` of a sharded actor: which rank processes hold its state."""
    if not sharded_backend(ctx):
        return
    started = {r.rank: r.started_at for r in ctx.store.ranks() if r.rank in actors}
    atomic_write_text(ctx.paths.trainer_layout, json.dumps(
        {"version": version, "generation": generation, "holders": {str(r): started.get(r) for r in actors}}))


def hand_off(ctx: RankContext, plan: PlanRecord) -> None:
    """Before this rank acts on `plan`: if it holds a sharded actor's state that `plan`'s step does not train
    where it is, check the state in with the other holders (a collective over their group), then free it."""
    from tiderl.run.trainer_role import drop_actor, release_trainer_group

    actor = ctx.actor
    if actor is None or not sharded_backend(ctx):
        return
    generation = ctx.store.trainer_generation().number
    layout = layout_of(plan, generation)
    held = ctx.trainer_group
    sharded = actor.comm.dp_group is not None
    if (held.continues(layout, plan.version) if sharded and held is not None else layout[0] == (ctx.rank,)):
        return  # the state stays where it is
    same_group = (held is not None and held.layout[2] == generation) if sharded else True
    due = plan.version == actor.version and plan.version < ctx.config.trainer.num_steps and same_group
    if due and not ctx.paths.checkpoint(actor.version).is_dir():  # (the step's own checkpoint is as good)
        t0 = time.perf_counter()
        path = actor.hand_off()
        seconds = time.perf_counter() - t0
        log.info("rank %d: checked in the actor's state of version %d for the next layout (%.2f s)", ctx.rank,
                 actor.version, seconds)
        if path is not None:
            ctx.store.report(RankReport(rank=ctx.rank, role=Role.ACTOR, version=actor.version, metrics=[
                MetricPoint("handoff_s", seconds, actor.version, "actor")], events=[EventRecord(
                    "actor_handoff", f"actor state of version {actor.version} checked in by ranks "
                    f"{list(held.layout[0]) if sharded and held else [ctx.rank]} for actors {list(layout[0])}",
                    {"version": actor.version, "to": list(layout[0])})]))
    release_trainer_group(ctx)
    drop_actor(ctx)


def await_handoff(ctx: RankContext, version: int, timeout_s: float) -> None:
    """Before this rank builds a sharded actor for the step of `version`: if the processes that trained
    `version` still run in this generation, wait until their checkpoint of it is committed."""
    try:
        record = json.loads(ctx.paths.trainer_layout.read_text())
    except FileNotFoundError:
        return
    if record["version"] != version or ctx.paths.checkpoint(version).is_dir():
        return
    deadline = time.monotonic() + timeout_s
    while not ctx.paths.checkpoint(version).is_dir():
        if ctx.store.trainer_generation().number != record["generation"]:
            return  # a restart: the holders are gone
        started = {str(r.rank): r.started_at for r in ctx.store.ranks()}
        if any(started.get(r) != t for r, t in record["holders"].items()):
            return  # a holder's process was replaced
        ctx.position()  # leaves if the run stopped
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {ctx.rank}: the actor ranks {sorted(record['holders'])} did not check in the "
                               f"state of version {version} within {timeout_s:.0f} s")
        time.sleep(POLL_S)
