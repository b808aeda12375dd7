"""One rollout rank's inference engine, vLLM-like, at the level of requests.

Mechanics (none of them knows which system runs it):
- Continuous batching: every running request gains one token per engine
  iteration; the iteration time comes from :class:`tiderl.sim.costs.Costs`
  (weights + KV bytes read, or FLOPs, whichever dominates). Time advances in
  iterations between events (processor sharing): the simulation costs per
  request, not per token.
- Chunked prefill: prompt tokens still to compute form a first-come
  first-served backlog; each iteration carries up to
  ``prefill_chunk_tokens`` of it (adding their FLOPs to the iteration). A
  request admitted behind a backlog of D tokens with P tokens of its own
  starts decoding after max(1, (D + P) / chunk) iterations.
- KV cache: running requests pin their context; a finished turn's context
  stays cached (unpinned) and is a prefix hit for the task's next turn.
  Space is reclaimed least recently used first, partially from the tail of
  an entry; entries marked *kept* (tasks CTB keeps resident) go only after
  every other entry. When pinned contexts alone outgrow the capacity, the
  most recently admitted request is preempted and recomputed later from
  scratch (vLLM's recompute preemption). A request waits (first come first
  served) until its context fits.
- On a shared host (``Costs.host_compute_slots``) iterations stretch by
  1 / ``speed``, the engine's share of the host, set by the rollout side.
- A weight sync drops the whole cache, interrupts every request (tokens so
  far are kept; they are re-prefilled with the new weights) and stalls the
  engine for the sync time.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from tiderl.sim.costs import Costs

_EPS = 1e-9


class Request:
    """One turn of one task on the engine."""

    __slots__ = ("task", "ctx", "gen_left", "v_join", "v_gen", "alive", "running", "kept")

    def __init__(self, task: Any, ctx: int, gen_left: int, kept: bool) -> None:
        self.task = task
        self.ctx = ctx
        self.gen_left = gen_left
        self.v_join = 0.0  # iteration clock when admitted (its KV starts growing)
        self.v_gen = 0.0  # iteration clock when its prompt is in and generation starts
        self.alive = True
        self.running = False
        self.kept = kept

    def generated(self, v: float) -> int:
        return min(self.gen_left, max(0, int(v - self.v_gen)))


class SimEngine:
    """The simulated rollout engine of one rank (the real one is `tiderl.rollout.engine.Engine`)."""

    def __init__(self, costs: Costs, capacity_tokens: int) -> None:
        self.costs = costs
        self.capacity = capacity_tokens
        self.chunk = costs.prefill_chunk_tokens
        self.t = 0.0
        self.v = 0.0
        self.busy_until = 0.0
        self.speed = 1.0  # share of the host this engine gets (1: its own accelerator)
        self._heap: list[tuple[float, int, Request]] = []
        self._order: list[Request] = []  # admission order of running requests (preemption victims last)
        self._num_running = 0
        self._ctx_offset = 0.0  # sum over running requests of (ctx - v_join): context sum = this + n * v
        self._debt = 0.0  # prefill tokens still to compute
        self._debt_pos = 0.0  # their mean position (attention cost)
        self._waiting: deque[Request] = deque()
        self._live: dict[Any, Request] = {}
        self._cache: OrderedDict[Any, float] = OrderedDict()
        self._kept: OrderedDict[Any, float] = OrderedDict()
        self._cached = 0.0
        self._seq = 0
        self.query_tokens = 0.0
        self.hit_tokens = 0.0
        self.prefill_tokens = 0.0
        self.decode_tokens = 0.0
        self.preemptions = 0
        self.evicted_tokens = 0.0
        self.on_admit: Callable[[Any, float], None] | None = None  # told (task, prefix-cache hit tokens)

    # -- state -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._num_running or self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences in the running batch now."""
        return self._num_running

    def pinned_tokens(self) -> float:
        return self._ctx_offset + self._num_running * self.v

    def used_tokens(self) -> float:
        return self.pinned_tokens() + self._cached

    def cached_tokens(self, task: Any) -> float:
        return self._cache.get(task, 0.0) or self._kept.get(task, 0.0)

    # -- time --------------------------------------------------------------------------------
    def _segments(self) -> tuple[float, float, float]:
        """(iterations the prefill backlog lasts, iteration time meanwhile, iteration time after).
        The iteration time is Costs.decode_iteration_s, inlined: this is the simulator's hot path."""
        c = self.costs
        n = self._num_running
        memory = c.weights_read_s + (self._ctx_offset + n * self.v) * c.kv_read_s_per_token
        after = c.step_overhead_s + max(memory, n * c.flop_s_per_token)
        if self._debt <= _EPS:
            return 0.0, after, after
        rate = min(self.chunk, self._debt)
        compute = n * c.flop_s_per_token + rate * (c.prefill_s_per_token + self._debt_pos * c.attn_flop_s_per_token_pos)
        return self._debt / rate, c.step_overhead_s + max(memory, compute), after

    def advance(self, t: float) -> None:
        start = self.t if self.t > self.busy_until else self.busy_until
        if t > start and self._num_running:
            dt = (t - start) * self.speed
            if self._debt == 0.0:
                c = self.costs
                n = self._num_running
                memory = c.weights_read_s + (self._ctx_offset + n * self.v) * c.kv_read_s_per_token
                compute = n * c.flop_s_per_token
                self.v += dt / (c.step_overhead_s + (memory if memory > compute else compute))
                self.t = t
                return
            n_pf, tau_pf, tau = self._segments()
            if n_pf * tau_pf >= dt:
                dv = dt / tau_pf
                done = dv * min(self.chunk, self._debt)
            else:
                dv = n_pf + (dt - n_pf * tau_pf) / tau
                done = self._debt
            self._debt -= done
            self.prefill_tokens += done
            if self._debt <= _EPS:
                self._debt = 0.0
                self._debt_pos = 0.0
            self.v += dv
        if t > self.t:
            self.t = t

    def next_event_s(self) -> float:
        """Time of the next finished turn; inf when nothing runs."""
        if not self._num_running:
            return float("inf")
        heap = self._heap
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
        if not heap:
            return float("inf")
        dv = max(heap[0][0] - self.v, 0.0)
        n_pf, tau_pf, tau = self._segments()
        start = max(self.t, self.busy_until)
        if dv <= n_pf:
            return start + dv * tau_pf / self.speed
        return start + (n_pf * tau_pf + (dv - n_pf) * tau) / self.speed

    # -- requests ----------------------------------------------------------------------------
    def submit(self, t: float, task: Any, ctx: int, gen_tokens: int, kept: bool) -> None:
        self.advance(t)
        req = Request(task, ctx, gen_tokens, kept)
        self._live[task] = req
        self._waiting.append(req)
        self._admit()

    def pop_finished(self, t: float) -> list[Any]:
        """Advance to t; return the tasks whose turn finished (their context stays cached)."""
        self.advance(t)
        done = []
        heap = self._heap
        while heap and (heap[0][0] <= self.v + 1e-6 or not heap[0][2].alive):
            _, _, req = heapq.heappop(heap)
            if not req.alive:
                continue
            req.alive = False
            self._num_running -= 1
            self._ctx_offset -= req.ctx - req.v_join
            self.decode_tokens += req.gen_left
            del self._live[req.task]
            self._put_cache(req.task, req.ctx + req.gen_left, req.kept)
            done.append(req.task)
        if len(self._order) > 2 * self._num_running + 64:
            self._order = [r for r in self._order if r.alive]
        self._fit()
        self._admit()
        return done

    def _stop(self, req: Request) -> tuple[int, int]:
        """Take a running request off the engine; returns (context now, tokens still to generate)."""
        req.alive = False
        self._num_running -= 1
        self._ctx_offset -= req.ctx - req.v_join
        made = req.generated(self.v)
        self.decode_tokens += made
        return req.ctx + made, max(1, req.gen_left - made)

    def abort(self, task: Any) -> tuple[int, int] | None:
        """Stop the task's request, keeping what it generated and caching its context.
        Returns (context tokens now, tokens still to generate), or None if it had none."""
        req = self._live.pop(task, None)
        if req is None:
            return None
        if not req.running:
            req.alive = False
            self._waiting.remove(req)
            return req.ctx, req.gen_left
        ctx, left = self._stop(req)
        self._put_cache(task, ctx if self.v >= req.v_gen else 0.0, req.kept)
        return ctx, left

    def set_kept(self, task: Any, kept: bool) -> None:
        """Mark the task's cached context kept (CTB resident) or ordinary (paused, finished)."""
        req = self._live.get(task)
        if req is not None:
            req.kept = kept
        src, dst = (self._cache, self._kept) if kept else (self._kept, self._cache)
        tokens = src.pop(task, None)
        if tokens is not None:
            dst[task] = tokens

    def truncate_cache(self, task: Any, tokens: float) -> None:
        """Keep at most the first `tokens` of the task's cached context (the rest no longer matches it)."""
        kept = task in self._kept
        cached = self._cache.get(task, 0.0) or self._kept.get(task, 0.0)
        if cached > tokens:
            self._put_cache(task, tokens, kept)

    def flush(self, t: float, stall_s: float) -> list[tuple[Any, int, int]]:
        """Weight sync: interrupt every request (returned as (task, context, tokens left)),
        drop the whole cache, stall for `stall_s`."""
        self.advance(t)
        out = []
        for task, req in self._live.items():
            if req.running and req.alive:
                ctx, left = self._stop(req)
                out.append((task, ctx, left))
            else:
                out.append((task, req.ctx, req.gen_left))
            req.alive = False
        self._heap.clear()
        self._order.clear()
        self._num_running = 0
        self._ctx_offset = 0.0
        self._debt = 0.0
        self._debt_pos = 0.0
        self._waiting.clear()
        self._live.clear()
        self._cache.clear()
        self._kept.clear()
        self._cached = 0.0
        self.v = 0.0
        self.busy_until = max(self.busy_until, t + stall_s)
        return out

    # -- memory ------------------------------------------------------------------------------
    def _put_cache(self, task: Any, tokens: float, kept: bool) -> None:
        old = self._cache.pop(task, None) or self._kept.pop(task, None)
        if old:
            self._cached -= old
        if tokens > 0:
            (self._kept if kept else self._cache)[task] = tokens
            self._cached += tokens

    def _evict(self, need: float) -> None:
        """Reclaim `need` cached tokens: ordinary entries first, least recently used first."""
        for pool in (self._cache, self._kept):
            while need > _EPS and pool:
                task, tokens = next(iter(pool.items()))
                take = min(tokens, need)
                if take >= tokens - _EPS:
                    pool.popitem(last=False)
                else:
                    pool[task] = tokens - take
                self._cached -= take
                self.evicted_tokens += take
                need -= take
            if need <= _EPS:
                return

    def _fit(self) -> None:
        over = self.used_tokens() - self.capacity
        if over > _EPS:
            self._evict(over)
        while self.pinned_tokens() > self.capacity and self._order:
            victim = self._order.pop()
            if not victim.alive:
                continue
            ctx, left = self._stop(victim)
            fresh = Request(victim.task, ctx, left, victim.kept)
            self._live[victim.task] = fresh
            self._waiting.appendleft(fresh)
            self.preemptions += 1

    def _admit(self) -> None:
        if not self._waiting:
            return
        while self._waiting and self._num_running < self.costs.max_num_seqs:
            req = self._waiting[0]
            if self.pinned_tokens() + req.ctx > self.capacity:
                return  # first come first served: the head waits for memory
            self._waiting.popleft()
            entry = self._cache.pop(req.task, None) or self._kept.pop(req.task, None) or 0.0
            self._cached -= entry
            over = self.pinned_tokens() + req.ctx + self._cached - self.capacity
            if over > _EPS:
                self._evict(over)
            hit = min(entry, req.ctx - 1)
            if self.on_admit is not None:
                self.on_admit(req.task, hit)
            new = req.ctx - hit
            self.query_tokens += req.ctx
            self.hit_tokens += hit
            pos = hit + new / 2
            self._debt_pos = (self._debt_pos * self._debt + pos * new) / (self._debt + new)
            self._debt += new
            req.v_join = self.v
            req.v_gen = self.v + max(1.0, self._debt / self.chunk)
            req.running = True
            self._num_running += 1
            self._ctx_offset += req.ctx - self.v
            self._seq += 1
            heapq.heappush(self._heap, (req.v_gen + req.gen_left, self._seq, req))
            self._order.append(req)
