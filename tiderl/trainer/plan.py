"""A step's plan: its micro-batches, which actor rank runs each, and in what order.

Built from the step's samples by the same deterministic functions on every
trainer rank, so all ranks agree without exchanging the plan. RA2P's
dispatchers (``tiderl.policy.ra2p``) decide the placement:

- colocated: sequences are spread over the actor ranks longest first in a
  zig-zag (``zigzag_dispatch``), so every rank gets nearly the same number of
  tokens, then each rank packs its own sequences into micro-batches by the
  per-rank token budget;
- decoupled: global micro-batches (budget: per-rank budget x actor ranks) are
  formed smallest last (``smallest_last_microbatches``: the final micro-batch,
  whose forward and backward nothing can overlap, is the cheapest); each is
  split across the actor ranks by zig-zag into one share per rank; the ref
  rank feeds the shares in that order;
- vanilla streaming: global micro-batches by first-fit decreasing, split the
  same way, in ready order.

A *share* (one rank's part of a global micro-batch, one forward pass) is the
unit the executors run; :class:`StepPlan` lists shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.policy import ra2p
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.batch import MicroBatch, TrainSample, collate
from tiderl.trainer.microbatch import form_micro_batches


@dataclass(frozen=True, slots=True)
class StepPlan:
    version: int
    mode: Ra2pMode
    micro_batches: tuple[MicroBatch, ...]  # shares
    assignment: tuple[tuple[int, ...], ...]  # per actor index: micro-batch indices, execution order
    ref_order: tuple[int, ...]  # order the ref rank(s) feed the pipeline (decoupled)
    ready_at_s: tuple[float, ...]  # per micro-batch, seconds after the step start
    normalizer: float  # model tokens of the whole global batch (the GRPO loss divisor)

    @property
    def num_actors(self) -> int:
        return len(self.assignment)


def _micro_batches(
    samples: Sequence[TrainSample], groups: list[list[int]], ready: Sequence[float], pad_id: int
) -> tuple[list[MicroBatch], list[float]]:
    mbs, ready_at = [], []
    for members in groups:
        mbs.append(collate([samples[i] for i in members], index=len(mbs), pad_id=pad_id))
        ready_at.append(max(ready[i] for i in members))
    return mbs, ready_at


FLAT = 1e-9  # |advantage| below this: no signal


def flat_groups(samples: Sequence[TrainSample]) -> set[int | str]:
    """The groups among `samples` whose every advantage is 0."""
    flat: dict[int | str, bool] = {}
    for s in samples:
        flat[s.group_id] = flat.get(s.group_id, True) and abs(s.advantage) < FLAT
    return {g for g, is_flat in flat.items() if is_flat}


def drop_flat_groups(samples: Sequence[TrainSample], sample_ready_s: Sequence[float] | None = None
                     ) -> tuple[list[TrainSample], list[float] | None, int]:
    """The samples without the groups whose every advantage is 0 (equal rewards: no policy-gradient
    signal, only KL; DAPO's dynamic-sampling filter), their ready times alike, and how many groups were
    dropped. A step whose every group is flat keeps them all: it has nothing else to train on."""
    flat = flat_groups(samples)
    keep = [i for i, s in enumerate(samples) if s.group_id not in flat]
    if not keep:
        return list(samples), None if sample_ready_s is None else list(sample_ready_s), 0
    ready = None if sample_ready_s is None else [sample_ready_s[i] for i in keep]
    return [samples[i] for i in keep], ready, len(flat)


def drop_truncated(samples: Sequence[TrainSample], sample_ready_s: Sequence[float] | None = None
                   ) -> tuple[list[TrainSample], list[float] | None, int]:
    """The samples without those their task's turn or context limit cut (overlong masking: none of their
    tokens is trained; their rewards already shaped their groups' advantages), their ready times alike,
    and how many were left out. A step whose every sample was cut keeps them all."""
    keep = [i for i, s in enumerate(samples) if not s.truncated]
    if not keep:
        return list(samples), None if sample_ready_s is None else list(sample_ready_s), 0
    ready = None if sample_ready_s is None else [sample_ready_s[i] for i in keep]
    return [samples[i] for i in keep], ready, len(samples) - len(keep)


def plan_step(
    samples: Sequence[TrainSample],
    *,
    version: int,
    mode: Ra2pMode,
    num_actors: int,
    micro_batch_tokens: int,
    sample_ready_s: Sequence[float] | None = None,
    pad_id: int = 0,
) -> StepPlan:
    """Micro-batches of ``samples`` and their placement on ``num_actors`` actor ranks for ``mode``."""
    if not samples:
        raise ValueError("plan_step: no samples")
    if num_actors < 1:
        raise ValueError(f"plan_step: num_actors must be >= 1, got {num_actors}")
    ready = list(sample_ready_s) if sample_ready_s is not None else [0.0] * len(samples)
    if len(ready) != len(samples):
        raise ValueError(f"plan_step: {len(ready)} ready times for {len(samples)} samples")
    counts = [s.num_tokens for s in samples]
    groups: list[list[int]] = []  # sample indices of each share
    owner: list[int] = []  # actor index of each share
    if mode is Ra2pMode.COLOCATED:
        for rank, members in enumerate(ra2p.zigzag_dispatch(counts, num_actors)):
            for local in form_micro_batches([counts[i] for i in members], micro_batch_tokens):
                groups.append([members[j] for j in local])
                owner.append(rank)
    else:
        budget = micro_batch_tokens * num_actors
        if mode is Ra2pMode.DECOUPLED:
            global_mbs = [list(g) for g in ra2p.smallest_last_microbatches(counts, budget, num_actors)]
        else:
            global_mbs = form_micro_batches(counts, budget)
        # A micro-batch cannot be fed before it is ready; the stable sort keeps the dispatch order otherwise.
        global_mbs.sort(key=lambda members: max(ready[i] for i in members))
        for members in global_mbs:
            # Each global micro-batch is split across the actor ranks (data parallel), balanced by zig-zag.
            for rank, local in enumerate(ra2p.zigzag_dispatch([counts[i] for i in members], num_actors)):
                if local:
                    groups.append([members[j] for j in local])
                    owner.append(rank)
    mbs, ready_at = _micro_batches(samples, groups, ready, pad_id)
    # Shares were created in feed order; on each rank, run them in ready order (stable).
    feed = sorted(range(len(mbs)), key=lambda i: ready_at[i])
    assignment = [[i for i in feed if owner[i] == r] for r in range(num_actors)]
    normalizer = float(sum(s.num_model_tokens for s in samples))
    if normalizer <= 0:
        raise ValueError("plan_step: the samples hold no model tokens (every loss mask is 0)")
    return StepPlan(
        version=version,
        mode=mode,
        micro_batches=tuple(mbs),
        assignment=tuple(tuple(a) for a in assignment),
        ref_order=tuple(feed),
        ready_at_s=tuple(ready_at),
        normalizer=normalizer,
    )


class ChunkPlanner:
    """The plans of one streamed step, chunk by chunk: a step's groups arrive in chunks (each a set of
    complete groups), and each chunk's trainable samples are planned and trained as they come.

    The same on every rank of the trainer group (each feeds it the same chunks), so actors and refs
    agree on every chunk's micro-batches and tags without exchanging them. It keeps the batch step's
    rules: the flat groups (``skip_flat_groups``) and the truncated samples (``mask_truncated``) of a
    chunk are held back, and trained at the end (:meth:`final`) only if the whole step had nothing
    else, as :func:`drop_flat_groups` and :func:`drop_truncated` would over the whole batch. A step fed
    as one chunk trains exactly the micro-batches of :func:`plan_step` over its batch.
    """

    def __init__(self, *, version: int, mode: Ra2pMode, num_actors: int, micro_batch_tokens: int,
                 skip_flat_groups: bool, mask_truncated: bool, pad_id: int = 0) -> None:
        self.version, self.mode, self.num_actors = version, mode, num_actors
        self.micro_batch_tokens, self.pad_id = micro_batch_tokens, pad_id
        self.skip_flat_groups, self.mask_truncated = skip_flat_groups, mask_truncated
        self.held_back: list[TrainSample] = []
        self.tag_base = 0  # micro-batches planned so far: the next plan's first tag
        self.normalizer = 0.0  # model tokens of the samples planned so far
        self.chunks = 0

    def chunk(self, samples: Sequence[TrainSample]) -> tuple[StepPlan, int] | None:
        """The plan of a chunk's trainable samples and its tag base; None if it holds none."""
        self.chunks += 1
        keep = list(samples)
        if self.skip_flat_groups:
            flat = flat_groups(keep)
            self.held_back += [s for s in keep if s.group_id in flat]
            keep = [s for s in keep if s.group_id not in flat]
        if self.mask_truncated:
            self.held_back += [s for s in keep if s.truncated]
            keep = [s for s in keep if not s.truncated]
        return self._plan(keep) if keep else None

    def final(self) -> tuple[StepPlan, int] | None:
        """After the last chunk: the held-back samples' plan if nothing else was trained (the batch rules'
        fallbacks: every group flat, every sample truncated), else None."""
        if self.normalizer > 0 or not self.held_back:
            return None
        samples, _, _ = drop_flat_groups(self.held_back) if self.skip_flat_groups else (self.held_back, None, 0)
        if self.mask_truncated:
            samples, _, _ = drop_truncated(samples)
        return self._plan(samples)

    def _plan(self, samples: list[TrainSample]) -> tuple[StepPlan, int]:
        plan = plan_step(samples, version=self.version, mode=self.mode, num_actors=self.num_actors,
                         micro_batch_tokens=self.micro_batch_tokens, pad_id=self.pad_id)
        base = self.tag_base
        self.tag_base += len(plan.micro_batches)
        self.normalizer += plan.normalizer
        return plan, base
