"""The trainer of one step: micro-batch formation from ready groups and the
execution of reference and actor work on the actor ranks (and ref ranks).

Execution kinds (mechanics; the RA2P mode is chosen outside):
- ``BATCH``: wait until the step's whole batch is ready, then one colocated
  burst: switch to the ref, ref over everything, switch to the actor,
  forward+backward over everything (VeRL/AReaL's standard execution).
- ``STREAM``: a micro-batch is formed as soon as enough tokens are ready and
  processed alone: switch, ref, switch, actor (naive streaming, a swap pair
  per micro-batch).
- ``RA2P``: streaming micro-batches with RA2P's dispatchers (zig-zag across
  actor ranks, smallest-last final micro-batches) executed either colocated
  with ready-batch aggregation (every micro-batch ready when the ranks free
  up goes into one burst) or decoupled (ref ranks compute reference log-probs
  share by share while actors run forwards; an actor's backward starts when
  its share's ref result is in).

A micro-batch is split across the M actor ranks; a rank's share costs
``forward_s`` per sequence for the actor forward, ``ref_ratio`` x that for
the reference forward and ``backward_ratio`` x that for the backward (the
roofline: 1 and 2). A colocated burst runs the ranks in lock-step (they switch models
together); a rank finishing its share early idles (bubble).

Accounting in GPU-seconds: ``twt`` (trainer ranks starved of ready data),
``bubble`` (idle inside the pipeline: ref waits, imbalance, drain), ``swap``
(model switches), ``busy`` (ref + actor compute).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tiderl.policy.ra2p import Ra2pMode, smallest_last_microbatches, zigzag_dispatch
from tiderl.sim.costs import Costs
from tiderl.sim.tasks import SimGroup


class TrainerKind(enum.Enum):
    BATCH = "batch"
    STREAM = "stream"
    RA2P = "ra2p"


@dataclass(slots=True)
class SimStepStats:
    """One simulated training step's bookkeeping (the real trainer's is `tiderl.trainer.step.StepStats`)."""

    start_s: float
    num_actors: int
    num_refs: int
    mode: Ra2pMode
    fetch_groups: int
    ready_rel_s: list[float] = field(default_factory=list)
    twt_gpu_s: float = 0.0
    actor_wait_gpu_s: float = 0.0
    """The actor ranks' share of `twt_gpu_s` (the ref ranks' waits are the rest): the control plane's
    trainer wait is the actor ranks' (`twt_s` of role actor, per actor rank)."""
    bubble_gpu_s: float = 0.0
    work_s: float = 0.0
    """Compute seconds of the step's stages at full speed (a burst's or a share's, once each)."""
    wall_s: float = 0.0
    """The same stages' seconds at the speed a shared host left them (= `work_s` without one)."""
    swap_gpu_s: float = 0.0
    busy_gpu_s: float = 0.0
    num_swaps: int = 0
    compute_done_s: float = 0.0
    consumed_tokens: int = 0
    consumed_seqs: int = 0
    consumed_gen_tokens: int = 0


class Trainer:
    def __init__(
        self,
        costs: Costs,
        kind: TrainerKind,
        micro_batch_tokens: int,
        schedule: Callable[[float, Callable[[float], None]], None],
        on_compute_done: Callable[[float], None],
        *,
        gather_first: bool = False,
        host: Callable[[int], float] | None = None,
    ) -> None:
        self.costs = costs
        self.kind = kind
        self.micro_batch_tokens = micro_batch_tokens
        self.schedule = schedule
        self.on_compute_done = on_compute_done
        self.gather_first = gather_first
        # Shared host: tell it how many trainer ranks compute; it answers their speed.
        self.host = host or (lambda busy: 1.0)
        self._burst_token = 0
        self._burst_work = self._burst_t = self._burst_start = 0.0
        self._burst_speed = 1.0
        self.stats: SimStepStats | None = None
        self.active = False
        self.busy = False

    def begin_step(self, t: float, num_actors: int, num_refs: int, mode: Ra2pMode, fetch_groups: int) -> None:
        if mode is Ra2pMode.DECOUPLED and (num_refs < 1 or self.kind is not TrainerKind.RA2P):
            raise ValueError("the decoupled mode needs RA2P and at least one ref rank")
        self.stats = SimStepStats(t, num_actors, num_refs, mode, fetch_groups)
        self.active = True
        self.claimed = 0
        self.pool: list[int] = []
        self.pool_tokens = 0
        self.queue: deque[list[list[int]]] = deque()
        self.busy = False
        self.idle_since = t
        self.actor_free = [t] * num_actors
        self.ref_free = [t] * max(num_refs, 0)
        self.done = False

    @property
    def capacity_tokens(self) -> int:
        return self.micro_batch_tokens * self.stats.num_actors  # type: ignore[union-attr]

    def offer(self, t: float, buffer: deque[SimGroup],
              stale: Callable[[SimGroup], bool] | None = None) -> tuple[list[SimGroup], list[SimGroup]]:
        """Claim ready groups (up to the fetch size) in the order they became ready, form micro-batches,
        run. A claimed group that `stale` rejects is dropped, as the real trainer drops a group older than
        the staleness bound, and the next ready one taken instead. Returns (claimed, dropped)."""
        if not self.active or self.done:
            return [], []
        st = self.stats
        claimed, dropped = [], []
        while self.claimed < st.fetch_groups and buffer:
            group = buffer.popleft()
            if stale is not None and stale(group):
                dropped.append(group)
                continue
            claimed.append(group)
            self.claimed += 1
            st.consumed_gen_tokens += group.gen_tokens
            for n in group.seq_tokens:
                self.pool.append(n)
                self.pool_tokens += n
                st.consumed_tokens += n
                st.consumed_seqs += 1
        if claimed:
            self._form(t)
            self._run(t)
        return claimed, dropped

    # -- formation ---------------------------------------------------------------------------
    def _form(self, t: float) -> None:
        cap = self.capacity_tokens
        complete = self.claimed >= self.stats.fetch_groups
        if self.gather_first and not complete:
            return
        if self.kind is TrainerKind.BATCH:
            if complete and self.pool:
                for mb in _next_fit(self.pool, cap):
                    self._push(t, mb)
                self.pool, self.pool_tokens = [], 0
            return
        while self.pool_tokens >= cap:
            if self.kind is TrainerKind.STREAM:
                mb = _next_fit(self.pool, cap)[0]
            else:
                mb = _first_fit_decreasing_one(self.pool, cap)
            for n in mb:
                self.pool.remove(n)
            self.pool_tokens -= sum(mb)
            self._push(t, mb)
        if complete and self.pool:
            if self.kind is TrainerKind.STREAM:
                mbs = _next_fit(self.pool, cap)
            else:
                mbs = [[self.pool[i] for i in mb] for mb in
                       smallest_last_microbatches(self.pool, cap, self.stats.num_actors)]
            for mb in mbs:
                self._push(t, mb)
            self.pool, self.pool_tokens = [], 0

    def _push(self, t: float, seqs: list[int]) -> None:
        m = self.stats.num_actors
        if self.kind is TrainerKind.RA2P:
            shares = [[seqs[i] for i in rank] for rank in zigzag_dispatch(seqs, m)]
        else:
            shares = [seqs[r::m] for r in range(m)]
        self.stats.ready_rel_s.append(t - self.stats.start_s)
        self.queue.append(shares)

    # -- execution ---------------------------------------------------------------------------
    def _share_forward_s(self, share: list[int]) -> float:
        return sum(self.costs.forward_s(n) for n in share)

    def _run(self, t: float) -> None:
        st = self.stats
        if st.mode is Ra2pMode.DECOUPLED:
            while self.queue:
                self._pipeline(t, self.queue.popleft())
            self._maybe_done_decoupled()
            return
        if self.busy or not self.queue:
            self._maybe_done_colocated(t)
            return
        k = 1 if self.kind is TrainerKind.STREAM else len(self.queue)
        burst = [self.queue.popleft() for _ in range(k)]
        m = st.num_actors
        per_rank = [0.0] * m
        for shares in burst:
            for r, share in enumerate(shares):
                per_rank[r] += self._share_forward_s(share)
        c = self.costs
        ref_phase = max(per_rank) * c.ref_ratio
        actor_phase = max(per_rank) * (1.0 + c.backward_ratio)  # forward + backward of the same shares
        swap = self.costs.swap_s
        duration = 2 * swap + ref_phase + actor_phase
        # A shared host: the burst runs at the trainer's share of it, re-timed when the share changes.
        speed = self.host(m)
        st.twt_gpu_s += m * (t - self.idle_since)
        st.actor_wait_gpu_s += m * (t - self.idle_since)
        st.swap_gpu_s += 2 * swap * m
        st.num_swaps += 2
        busy = (c.ref_ratio + 1.0 + c.backward_ratio) * sum(per_rank)
        st.busy_gpu_s += busy
        st.bubble_gpu_s += m * (ref_phase + actor_phase) - busy
        self.busy = True
        st.work_s += duration
        self._burst_start = t
        self._burst_work, self._burst_t, self._burst_speed = duration, t, speed
        self._burst_token += 1
        self.schedule(t + duration / speed, self._burst_end, self._burst_token)

    def speed_changed(self, t: float, speed: float) -> None:
        """The trainer's share of a shared host changed: the running colocated burst is re-timed."""
        if not self.busy or speed == self._burst_speed:
            return
        self._burst_work -= (t - self._burst_t) * self._burst_speed
        self._burst_t, self._burst_speed = t, speed
        self._burst_token += 1
        self.schedule(t + max(self._burst_work, 0.0) / speed, self._burst_end, self._burst_token)

    def _burst_end(self, t: float, token: int) -> None:
        if token != self._burst_token:
            return  # re-timed
        self.busy = False
        self.host(0)
        self.stats.wall_s += t - self._burst_start  # type: ignore[union-attr]
        self.idle_since = t
        self._run(t)

    def _maybe_done_colocated(self, t: float) -> None:
        if self.busy or self.queue or self.pool or self.claimed < self.stats.fetch_groups or self.done:
            return
        self.done = True
        self.stats.compute_done_s = t
        self.on_compute_done(t)

    def _pipeline(self, a: float, shares: list[list[int]]) -> None:
        st = self.stats
        speed = self.host(st.num_actors + st.num_refs)  # a shared host: the share when dispatched
        for r, share in enumerate(shares):
            work = self._share_forward_s(share)
            fwd = work / speed
            stages = self.costs.ref_ratio + 1.0 + self.costs.backward_ratio
            st.work_s += work * stages
            st.wall_s += fwd * stages
            i = min(range(len(self.ref_free)), key=self.ref_free.__getitem__)
            ref_start = max(a, self.ref_free[i])
            st.twt_gpu_s += max(0.0, a - self.ref_free[i])
            ref_done = ref_start + fwd * self.costs.ref_ratio
            self.ref_free[i] = ref_done
            f_start = max(a, self.actor_free[r])
            st.twt_gpu_s += max(0.0, a - self.actor_free[r])
            st.actor_wait_gpu_s += max(0.0, a - self.actor_free[r])
            f_end = f_start + fwd
            b_start = max(f_end, ref_done)
            st.bubble_gpu_s += b_start - f_end
            self.actor_free[r] = b_start + self.costs.backward_ratio * fwd
            st.busy_gpu_s += (self.costs.ref_ratio + 1.0 + self.costs.backward_ratio) * fwd

    def _maybe_done_decoupled(self) -> None:
        st = self.stats
        if self.pool or self.claimed < st.fetch_groups or self.done:
            return
        self.done = True
        end = max(self.actor_free + self.ref_free)
        st.bubble_gpu_s += sum(end - f for f in self.actor_free) + sum(end - f for f in self.ref_free)
        # The step's coordination between the actor and ref ranks (measured where the cluster says so).
        end += self.costs.decoupled_step_s
        st.compute_done_s = end
        self.schedule(end, self._decoupled_end)

    def _decoupled_end(self, t: float) -> None:
        self.host(0)
        self.on_compute_done(t)

    def finish_step(self) -> SimStepStats:
        self.active = False
        return self.stats  # type: ignore[return-value]


def _next_fit(seqs: list[int], cap: int) -> list[list[int]]:
    """Arrival order, a new micro-batch when the next sequence does not fit."""
    out: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for n in seqs:
        if cur and tokens + n > cap:
            out.append(cur)
            cur, tokens = [], 0
        cur.append(n)
        tokens += n
    if cur:
        out.append(cur)
    return out


def _first_fit_decreasing_one(seqs: list[int], cap: int) -> list[int]:
    """One full micro-batch: longest sequences first, each taken if it still fits."""
    out: list[int] = []
    tokens = 0
    for n in sorted(seqs, reverse=True):
        if tokens + n <= cap or not out:
            out.append(n)
            tokens += n
    return out
