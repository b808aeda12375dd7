"""RA2P execution modes and the naive baselines: how ref and actor work is ordered in one step.

Every mode runs the same GRPO step (``step.forward`` / ``step.finish``) and
differs only in where the reference model lives and when it runs:

- ``decoupled``: the reference model has its own rank(s); one ref rank serves
  several actor ranks. The actor posts a receive for each of its
  micro-batches, runs the forward as soon as the micro-batch is ready, and
  waits for that micro-batch's ``ref_logprobs`` only right before backward
  (the loss is built there). Ref forward, actor forward and actor backward
  overlap; no model is ever swapped.
- ``colocated``: ref and actor share the rank. Ready-batch aggregation: all k
  micro-batches ready now go through the ref model (one swap in), then all k
  through the actor (one swap back), so the swap is paid once per burst.
- ``vanilla_stream`` / ``vanilla_stream_offload``: ref and actor share the rank
  and alternate per micro-batch (R1 A1 R2 A2 ...); with offload the idle
  model leaves the device at every switch (two swaps per micro-batch).

Point-to-point traffic (ref -> actor) uses tag = micro-batch index (plus the
number of micro-batches of the step's earlier chunks, when a step is streamed
chunk by chunk), so messages match whatever order they complete in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer import step as grpo_step
from tiderl.trainer.backend import ActorBackend, RefBackend
from tiderl.trainer.plan import StepPlan
from tiderl.trainer.step import LossConfig, StepAccumulator, StepStats


@dataclass(frozen=True, slots=True)
class TrainerComm:
    """Where this process sits in the trainer's process group for one version.

    Ranks are process-group ranks: actors first (``actor_ranks``), then refs.
    ``dp_group`` is the actors' data-parallel group (None: a single actor).
    """

    rank: int
    actor_ranks: tuple[int, ...]
    ref_ranks: tuple[int, ...] = ()
    dp_group: dist.ProcessGroup | None = None

    @property
    def actor_index(self) -> int:
        return self.actor_ranks.index(self.rank)

    def ref_of(self, actor_index: int) -> int:
        if not self.ref_ranks:
            raise ValueError("decoupled mode needs at least one ref rank")
        return self.ref_ranks[actor_index % len(self.ref_ranks)]


class Readiness:
    """When each micro-batch of a plan may start: ``plan.ready_at_s`` after the step start."""

    def __init__(self, plan: StepPlan, started: float) -> None:
        self._ready_at = [started + r for r in plan.ready_at_s]

    def is_ready(self, index: int) -> bool:
        return time.perf_counter() >= self._ready_at[index]

    def wait(self, index: int) -> float:
        """Block until micro-batch ``index`` is ready; returns the seconds waited."""
        delay = self._ready_at[index] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
            return delay
        return 0.0


def _swap(acc: StepAccumulator, out_model: ActorBackend | RefBackend, in_model: ActorBackend | RefBackend) -> None:
    acc.add_swap(out_model.offload() + in_model.onload())


def finish_actor_step(actor: ActorBackend, acc: StepAccumulator, started: float, comm: TrainerComm,
                 grad_scale: float = 1.0) -> StepStats:
    t0 = time.perf_counter()
    optim = actor.step(grad_scale)
    return grpo_step.reduce_stats(acc, optim.grad_norm, time.perf_counter() - t0, started, comm.dp_group)


def run_actor(
    plan: StepPlan,
    actor: ActorBackend,
    ref: RefBackend | None,
    comm: TrainerComm,
    loss: LossConfig,
    *,
    max_aggregate: int = 64,
    started: float | None = None,
) -> StepStats:
    """One actor rank's share of a step in ``plan.mode``, ending with the optimizer step."""
    started = time.perf_counter() if started is None else started
    acc = StepAccumulator(version=plan.version)
    run_actor_share(plan, actor, ref, comm, loss, acc, normalizer=plan.normalizer, max_aggregate=max_aggregate,
                    started=started)
    return finish_actor_step(actor, acc, started, comm)


def run_actor_share(
    plan: StepPlan,
    actor: ActorBackend,
    ref: RefBackend | None,
    comm: TrainerComm,
    loss: LossConfig,
    acc: StepAccumulator,
    *,
    normalizer: float,
    tag_base: int = 0,
    max_aggregate: int = 64,
    started: float | None = None,
) -> None:
    """This actor rank's micro-batches of ``plan`` in ``plan.mode``: forwards and backwards, gradients
    accumulated, no optimizer step (a streamed step runs one plan per chunk of ready groups, then
    steps once). Each loss is divided by ``normalizer``; decoupled traffic is tagged ``tag_base`` + the
    micro-batch's index, so the chunks of one step never share a tag."""
    ready = Readiness(plan, time.perf_counter() if started is None else started)
    mine = list(plan.assignment[comm.actor_index])
    if plan.mode is Ra2pMode.DECOUPLED:
        _actor_decoupled(plan, actor, comm, loss, mine, ready, acc, normalizer, tag_base)
    else:
        if ref is None:
            raise ValueError(f"{plan.mode.value} mode needs the reference model on the actor rank")
        if plan.mode is Ra2pMode.COLOCATED:
            _actor_colocated(plan, actor, ref, loss, mine, ready, acc, max_aggregate, normalizer)
        else:
            _actor_vanilla(plan, actor, ref, loss, mine, ready, acc, plan.mode is Ra2pMode.VANILLA_STREAM_OFFLOAD,
                           normalizer)
    if actor.lockstep and comm.dp_group is not None:
        _pad_lockstep(plan, actor, len(mine))


def _pad_lockstep(plan: StepPlan, actor: ActorBackend, done: int) -> None:
    """A lockstep (sharded) actor runs as many forward and backward passes as the rank with the most
    micro-batches of ``plan``: the missing ones on the plan's first micro-batch, with a zero loss (FSDP's
    collectives run inside the passes; the gradients they add are zeros)."""
    most = max((len(a) for a in plan.assignment), default=0)
    for _ in range(most - done):
        if not actor.is_resident:
            actor.onload()
        actor.backward(actor.forward(plan.micro_batches[0]).sum() * 0.0)


def _actor_decoupled(
    plan: StepPlan, actor: ActorBackend, comm: TrainerComm, loss: LossConfig,
    mine: list[int], ready: Readiness, acc: StepAccumulator, normalizer: float, tag_base: int,
) -> None:
    src = comm.ref_of(comm.actor_index)
    buffers: dict[int, torch.Tensor] = {}
    works: dict[int, dist.Work] = {}
    for i in mine:
        buffers[i] = torch.empty(plan.micro_batches[i].loss_mask.shape, dtype=torch.float32)
        works[i] = dist.irecv(buffers[i], src=src, tag=tag_base + i)
    for i in mine:
        mb = plan.micro_batches[i]
        acc.wait_data_s += ready.wait(i)
        out = grpo_step.forward(actor, mb, acc)
        t0 = time.perf_counter()
        works[i].wait()  # the loss needs ref_logprobs only now, right before backward
        acc.wait_ref_s += time.perf_counter() - t0
        grpo_step.finish(actor, mb, out, buffers.pop(i), loss, normalizer, acc)


def _actor_colocated(
    plan: StepPlan, actor: ActorBackend, ref: RefBackend, loss: LossConfig,
    mine: list[int], ready: Readiness, acc: StepAccumulator, max_aggregate: int, normalizer: float,
) -> None:
    if not ref.is_resident and not actor.is_resident:
        actor.onload()
    pending = list(mine)
    while pending:
        acc.wait_data_s += ready.wait(pending[0])
        burst = [i for i in pending if ready.is_ready(i)][:max_aggregate]
        if actor.is_resident and ref.is_resident:
            # Both fit (a previous mode left them so): keep one model on the device, as colocation assumes.
            ref.offload()
        _swap(acc, actor, ref)
        ref_logprobs = {i: grpo_step.reference(ref, plan.micro_batches[i], acc) for i in burst}
        _swap(acc, ref, actor)
        for i in burst:
            mb = plan.micro_batches[i]
            grpo_step.finish(
                actor, mb, grpo_step.forward(actor, mb, acc), ref_logprobs.pop(i), loss, normalizer, acc
            )
        taken = set(burst)
        pending = [i for i in pending if i not in taken]


def _actor_vanilla(
    plan: StepPlan, actor: ActorBackend, ref: RefBackend, loss: LossConfig,
    mine: list[int], ready: Readiness, acc: StepAccumulator, offload: bool, normalizer: float,
) -> None:
    if offload and ref.is_resident and actor.is_resident:
        ref.offload()
    if not offload:
        actor.onload()
        ref.onload()
    for i in mine:
        mb = plan.micro_batches[i]
        acc.wait_data_s += ready.wait(i)
        if offload:
            _swap(acc, actor, ref)
        ref_logprobs = grpo_step.reference(ref, mb, acc)
        if offload:
            _swap(acc, ref, actor)
        grpo_step.finish(actor, mb, grpo_step.forward(actor, mb, acc), ref_logprobs, loss, normalizer, acc)
    if not actor.is_resident:
        actor.onload()


@dataclass(frozen=True, slots=True)
class RefStats:
    num_served: int
    ref_s: float  # seconds of reference forwards
    duration_s: float


def run_ref(plan: StepPlan, ref: RefBackend, comm: TrainerComm, *, started: float | None = None,
            tag_base: int = 0) -> RefStats:
    """A decoupled ref rank's share of a step (or of one streamed chunk of it): ref forwards in the plan's
    feed order, sent to the owners tagged ``tag_base`` + the micro-batch's index."""
    if plan.mode is not Ra2pMode.DECOUPLED:
        raise ValueError(f"a ref rank only runs in decoupled mode, the plan is {plan.mode.value}")
    if not ref.is_resident:
        ref.onload()
    started = time.perf_counter() if started is None else started
    ready = Readiness(plan, started)
    owner = {i: a for a, indices in enumerate(plan.assignment) for i in indices}
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    ref_s = 0.0
    for i in plan.ref_order:
        actor_index = owner[i]
        if comm.ref_of(actor_index) != comm.rank:
            continue
        ready.wait(i)
        t0 = time.perf_counter()
        logprobs = ref.logprobs(plan.micro_batches[i]).contiguous()
        ref_s += time.perf_counter() - t0
        sends.append((dist.isend(logprobs, dst=comm.actor_ranks[actor_index], tag=tag_base + i), logprobs))
    for work, _ in sends:
        work.wait()
    return RefStats(num_served=len(sends), ref_s=ref_s, duration_s=time.perf_counter() - started)
