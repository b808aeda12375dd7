"""Resource-Aware Ref-Actor Pipelining (RA2P): the readiness signals, the
analytical cost model of the paper's Appendix A, the mode choice and the
micro-batch dispatchers (paper section 5.1).

Pure: no torch, no database, no HTTP, no processes. The trainer (and the
simulator) passes micro-batch ready times and measured stage times; these
functions return costs, a mode and dispatch plans.

Terms
- Ready times ``a_1..a_N`` are seconds relative to the start of the training
  step; a micro-batch already in the buffer at the start has ``a <= 0``.
- A micro-batch is the global unit the actor group consumes: its sequences
  are split across the M actor ranks (data parallel). ``StageTimes`` holds the
  times of one rank's share: ``t_ref_s`` (reference forward of one share),
  ``t_act_f_s``/``t_act_b_s`` (actor forward/backward of one share) and
  ``t_swap_s`` (one switch between the reference and the actor model on a
  colocated rank).
- RAS (Ready-at-Start) ``N0 = |{i : a_i <= 0}|``. TPRM (Time Per Ready
  Micro-batch) is the mean post-start gap ``a_i - a_(i-1)`` for
  ``i > N0 + 1``; with a single post-start arrival it is that arrival's
  time; with none it is ``None``.

Cost of the decoupled mode (Appendix A)::

    C_dec = sum_{i=0}^{M-1} floor(i/R) * t_ref  +  sum_{i=1}^{N} max(delta_i, s)

with ``delta_i = 0`` for ``i <= N0``, ``delta_(N0+1) = max(a_(N0+1), 0)``,
``delta_i = a_i - a_(i-1)`` otherwise. With one ref rank (R = 1) and a ref
that keeps up, ``s = t_act_f + t_act_b`` and this is the paper's formula
exactly. Two documented generalisations: R ref ranks share the shares of a
micro-batch (the fill term uses ``floor(i/R)``), and ``s = max(t_act_f +
t_act_b, M * t_ref / R)`` because one micro-batch needs M shares of reference
work, which a ref rank that cannot keep up turns into the steady-state period.
Note the paper's fill term sums the waits of the M actors (rank-seconds), so
it grows with M squared: a conservative latency estimate for large groups.

Cost of the colocated mode: the paper's ready-batch aggregation loop,
simulated (clock T = 0; wait for the next arrival; take every micro-batch
ready by T, at most ``max_aggregate``; ``T += t_swap + k t_ref``;
``T += t_swap + k (t_act_f + t_act_b)``; repeat).

Invariants (each has a test in tests/test_policy_ra2p.py)
1. RAS + the number of post-start arrivals = N; TPRM is None iff no
   micro-batch arrives after the start; both ignore input order.
2. Both costs are 0 for no micro-batches; C_dec is infinite with no ref rank.
3. C_col >= the last ready time + 2 t_swap + t_ref + t_act_f + t_act_b (its
   final burst holds at least the last micro-batch) and C_col <= the cost of
   vanilla streaming (one burst per micro-batch) on the same ready times.
4. With every micro-batch ready at the start, C_col is one burst:
   ``2 t_swap + N (t_ref + t_act_f + t_act_b)`` (unless capped).
5. With one ref rank that keeps up (M t_ref <= t_act_f + t_act_b), C_dec is
   the paper's formula term by term. (Neither cost is monotone in the ready
   times: the paper's sum of gaps is an approximation, and greedy aggregation
   can finish later than waiting for a second micro-batch would.)
6. The chosen mode is the one with the smaller cost; a tie goes to the
   colocated mode (it frees the ref ranks); with no ref rank it is colocated.
7. Regimes: with the fill bubble paid once, enough ready-at-start work (large
   RAS) or short TPRM makes the decoupled mode cheaper; small RAS with long
   TPRM makes the colocated mode cheaper (hand-worked timelines in the tests).
8. :func:`break_even_ras` returns the smallest RAS for which decoupled wins
   (with the rest arriving every TPRM), or None if no RAS does.
9. Zig-zag dispatch gives every sequence to exactly one rank, rank counts
   differ by at most 1 and rank loads differ by at most the longest sequence.
10. Smallest-last micro-batches hold every sequence exactly once, stay within
    the token budget (a longer sequence goes alone), the micro-batches before
    the last are in non-increasing token order, the last holds at most one
    sequence per rank, and the very last sequence dispatched is a shortest one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Ra2pChoice",
    "Ra2pMode",
    "StageTimes",
    "break_even_ras",
    "choose_mode",
    "colocated_cost_s",
    "decoupled_cost_s",
    "ready_at_start",
    "refs_keep_up",
    "refs_needed",
    "smallest_last_microbatches",
    "time_per_ready_microbatch_s",
    "vanilla_stream_cost_s",
    "zigzag_dispatch",
]


class Ra2pMode(str, enum.Enum):
    """How a training step orders its ref and actor work. :func:`choose_mode` picks one of the two RA2P
    modes; the vanilla ones are the baselines a job can fix (``trainer.ra2p_mode``). The values are the
    names the config, the store and the metrics use."""

    DECOUPLED = "decoupled"
    """Ref on its own rank(s), streaming; the actor defers its loss to the backward pass."""
    COLOCATED = "colocated"
    """Ref and actor on the same ranks, ready-batch aggregation amortises the swaps."""
    VANILLA_STREAM = "vanilla_stream"
    """Baseline: ref and actor on the same ranks alternate per micro-batch, both resident."""
    VANILLA_STREAM_OFFLOAD = "vanilla_stream_offload"
    """Baseline: as ``VANILLA_STREAM``, and the idle model leaves the device at every switch."""

    @classmethod
    def parse(cls, name: str) -> Ra2pMode:
        """The mode named ``name``; a ValueError naming it and the known modes otherwise."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown RA2P mode {name!r} (known: {known})") from None


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds for one actor rank's share of one micro-batch."""

    t_ref_s: float
    t_act_f_s: float
    t_act_b_s: float
    t_swap_s: float

    def __post_init__(self) -> None:
        for name in ("t_ref_s", "t_act_f_s", "t_act_b_s", "t_swap_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Ra2pChoice:
    mode: Ra2pMode
    decoupled_s: float
    colocated_s: float
    ras: int
    tprm_s: float | None


def ready_at_start(ready_times: Sequence[float]) -> int:
    """RAS: micro-batches already ready when the step starts (ready time <= 0)."""
    return sum(1 for a in ready_times if a <= 0)


def time_per_ready_microbatch_s(ready_times: Sequence[float]) -> float | None:
    """TPRM: mean gap between post-start arrivals (see the module docstring)."""
    post = sorted(a for a in ready_times if a > 0)
    if not post:
        return None
    if len(post) == 1:
        return post[0]
    return (post[-1] - post[0]) / (len(post) - 1)


def decoupled_cost_s(
    ready_times: Sequence[float], times: StageTimes, num_actor_ranks: int, num_ref_ranks: int = 1
) -> float:
    """C_dec of Appendix A (generalised to R ref ranks; see the module docstring)."""
    if num_actor_ranks < 1:
        raise ValueError(f"num_actor_ranks: must be >= 1, got {num_actor_ranks}")
    ts = sorted(ready_times)
    if not ts:
        return 0.0
    if num_ref_ranks < 1:
        return math.inf
    fill = sum((i // num_ref_ranks) * times.t_ref_s for i in range(num_actor_ranks))
    period = max(times.t_act_f_s + times.t_act_b_s, num_actor_ranks * times.t_ref_s / num_ref_ranks)
    total = fill
    prev = 0.0
    for a in ts:
        delta = max(a - prev, 0.0) if a > 0 else 0.0
        if a > 0:
            prev = a
        total += max(delta, period)
    return total


KEEP_UP_TOLERANCE = 1e-9
"""A tie of :func:`refs_needed` (M t_ref / R equal to t_act_f + t_act_b) keeps up, within this relative
share: float rounding must not decide it (with the roofline's t_ref = t_act_f, t_act_b = 2 t_act_f, one
ref rank per three actors is such a tie)."""


def refs_needed(actors: int, times: StageTimes | None) -> int:
    """The fewest ref ranks that keep up with `actors` actor ranks in the decoupled pipeline: the smallest
    R >= 1 with M t_ref / R <= t_act_f + t_act_b (a further ref rank would idle; fewer set the period, see
    :func:`decoupled_cost_s`). 0 without stage times or actors (nothing to keep up with); `actors` where
    the actors' work is 0 (no count keeps up then: one per actor). The one rule of "the refs keep up":
    the ERS planners and the simulator's fixed splits call it (or :func:`refs_keep_up`)."""
    if times is None or actors < 1:
        return 0
    work = times.t_act_f_s + times.t_act_b_s
    if work <= 0:
        return actors
    return max(1, math.ceil(actors * times.t_ref_s / (work * (1 + KEEP_UP_TOLERANCE))))


def refs_keep_up(actors: int, refs: int, times: StageTimes | None) -> bool:
    """Whether `refs` ref ranks keep up with `actors` actor ranks (at least :func:`refs_needed`); no ref
    rank never does. A further ref rank is worth adding only while this is False."""
    return refs >= 1 and refs >= refs_needed(actors, times)


def colocated_cost_s(
    ready_times: Sequence[float], times: StageTimes, max_aggregate: int | None = None
) -> float:
    """C_col: the Appendix A ready-batch aggregation loop, simulated."""
    if max_aggregate is not None and max_aggregate < 1:
        raise ValueError(f"max_aggregate: must be >= 1, got {max_aggregate}")
    ts = sorted(ready_times)
    n = len(ts)
    clock = 0.0
    j = 0
    while j < n:
        clock = max(clock, ts[j])
        k = 0
        while j + k < n and ts[j + k] <= clock and (max_aggregate is None or k < max_aggregate):
            k += 1
        clock += times.t_swap_s + k * times.t_ref_s
        clock += times.t_swap_s + k * (times.t_act_f_s + times.t_act_b_s)
        j += k
    return clock


def vanilla_stream_cost_s(ready_times: Sequence[float], times: StageTimes) -> float:
    """Naive streaming: a ref/actor swap pair for every micro-batch (aggregation capped at 1)."""
    return colocated_cost_s(ready_times, times, max_aggregate=1)


def choose_mode(
    ready_times: Sequence[float],
    times: StageTimes,
    num_actor_ranks: int,
    num_ref_ranks: int = 1,
    max_aggregate: int | None = None,
) -> Ra2pChoice:
    """The cheaper RA2P mode for these ready times; ties go to colocated."""
    c_dec = decoupled_cost_s(ready_times, times, num_actor_ranks, num_ref_ranks)
    c_col = colocated_cost_s(ready_times, times, max_aggregate)
    mode = Ra2pMode.DECOUPLED if c_dec < c_col else Ra2pMode.COLOCATED
    return Ra2pChoice(
        mode=mode,
        decoupled_s=c_dec,
        colocated_s=c_col,
        ras=ready_at_start(ready_times),
        tprm_s=time_per_ready_microbatch_s(ready_times),
    )


def break_even_ras(
    times: StageTimes,
    tprm_s: float,
    num_microbatches: int,
    num_actor_ranks: int,
    num_ref_ranks: int = 1,
    max_aggregate: int | None = None,
) -> int | None:
    """Smallest RAS in [0, N] for which the decoupled mode is cheaper, the other
    N - RAS micro-batches arriving every ``tprm_s``; None if none is."""
    if tprm_s < 0:
        raise ValueError(f"tprm_s: must be >= 0, got {tprm_s}")
    for ras in range(num_microbatches + 1):
        ready = [0.0] * ras + [tprm_s * (i + 1) for i in range(num_microbatches - ras)]
        choice = choose_mode(ready, times, num_actor_ranks, num_ref_ranks, max_aggregate)
        if choice.mode is Ra2pMode.DECOUPLED:
            return ras
    return None


def zigzag_dispatch(lengths: Sequence[int], num_ranks: int) -> tuple[tuple[int, ...], ...]:
    """Colocated-mode balancing: sequences sorted longest first, dealt to the
    ranks in a zig-zag (0..M-1, M-1..0, ...). Returns indices into ``lengths`` per rank."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks: must be >= 1, got {num_ranks}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    for pos, i in enumerate(order):
        lap, offset = divmod(pos, num_ranks)
        ranks[offset if lap % 2 == 0 else num_ranks - 1 - offset].append(i)
    return tuple(tuple(r) for r in ranks)


def smallest_last_microbatches(
    lengths: Sequence[int], microbatch_tokens: int, num_ranks: int
) -> tuple[tuple[int, ...], ...]:
    """Decoupled-mode micro-batching: full micro-batches first (first-fit
    decreasing into ``microbatch_tokens``), then a last micro-batch as small as
    possible (the shortest sequences, at most one per rank), ending with the
    shortest sequence. Returns micro-batches of indices, in dispatch order."""
    if microbatch_tokens < 1:
        raise ValueError(f"microbatch_tokens: must be >= 1, got {microbatch_tokens}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks: must be >= 1, got {num_ranks}")
    if not lengths:
        return ()
    ascending = sorted(range(len(lengths)), key=lambda i: (lengths[i], -i))
    tail = [ascending[0]]
    tail_tokens = lengths[ascending[0]]
    for i in ascending[1:]:
        if len(tail) >= num_ranks or tail_tokens + lengths[i] > microbatch_tokens:
            break
        tail.append(i)
        tail_tokens += lengths[i]
    in_tail = set(tail)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in reversed(ascending):
        if i in in_tail:
            continue
        for b, load in enumerate(loads):
            if load + lengths[i] <= microbatch_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    body = sorted(range(len(bins)), key=lambda b: -loads[b])
    tail.reverse()  # longest of the tail first, the shortest sequence last
    return tuple(tuple(bins[b]) for b in body) + (tuple(tail),)
