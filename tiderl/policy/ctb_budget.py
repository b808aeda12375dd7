"""CTB's adaptive KV budget: how many tokens a rollout rank may commit beyond its engine's cache,
learned from what the engine's prefix cache kept (``rollout.ctb_budget: adaptive``).

Pure: no torch, no database, no HTTP, no processes. The rollout worker counts, over its recent
turns, how many came back from the prefix cache whole and how many had lost their context, and
calls :func:`adjust_budget` once a window of such turns is full.

Why a budget beyond the cache: CTB counts every resident task at its whole context plus the room
of its next generation (:mod:`tiderl.policy.ctb`). A task waiting on its environment holds no
engine blocks: its context sits in the prefix cache, evictable, and comes back as a hit if nothing
needed those blocks meanwhile. Counting it at full size is a worst case, which keeps fewer
sequences decoding than the cache can serve. How much more fits depends on the environment's
latency, the engine's speed and the contexts' lengths, so it is measured, not assumed: the engine
reports for every generation how many prompt tokens it served from the cache, and a resident task
whose previous context did not come back (a block or more short) was evicted because the rank
committed more than the cache could keep.

Rule, once ``window_turns`` turns of resident tasks were judged (additive increase,
multiplicative decrease of the part above the floor):
- evicted share of those turns above ``evicted_tolerance``:
  ``budget = floor + (budget - floor) x shrink``;
- otherwise, if the budget held back a task (an admission or a resume waited for room, or tasks
  were paused) during the window: ``budget += grow_share x floor``, at most ``max_factor x floor``;
- otherwise unchanged.
The floor is the fixed budget (the engine's capacity or ``rollout.kv_budget_tokens``).

Invariants (each has a test in tests/test_policy_ctb_budget.py)
1. ``floor <= budget <= max_factor x floor`` after every adjustment, whatever the feedback.
2. Fewer than ``window_turns`` judged turns: no change.
3. An evicted share above the tolerance never raises the budget, and lowers it when above the floor.
4. The budget rises only when it held a task back and the evicted share was within the tolerance.
5. Pure: equal inputs give equal outputs.
6. :class:`BudgetTracker` (the bookkeeping the rollout worker and the simulator share) adjusts
   exactly once per ``window_turns`` judged turns, with the feedback of those turns only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["BudgetLimits", "BudgetTracker", "CacheFeedback", "adjust_budget", "prefix_kept"]


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    floor_tokens: int
    """The fixed budget: the engine's KV capacity or rollout.kv_budget_tokens."""
    max_factor: float = 4.0
    """The budget never exceeds this multiple of the floor."""
    grow_share: float = 0.125
    """Increase per window, as a share of the floor."""
    shrink: float = 0.5
    """Factor applied to the part above the floor when too many prefixes were evicted."""
    evicted_tolerance: float = 0.05
    """Evicted share of the judged turns above which the rank committed too much."""
    window_turns: int = 16
    """Judged turns per adjustment."""

    def __post_init__(self) -> None:
        if self.floor_tokens < 1:
            raise ValueError(f"floor_tokens: must be >= 1, got {self.floor_tokens}")
        if self.max_factor < 1:
            raise ValueError(f"max_factor: must be >= 1, got {self.max_factor}")
        if not 0 < self.grow_share <= 1:
            raise ValueError(f"grow_share: must be in (0, 1], got {self.grow_share}")
        if not 0 <= self.shrink < 1:
            raise ValueError(f"shrink: must be in [0, 1), got {self.shrink}")
        if not 0 <= self.evicted_tolerance < 1:
            raise ValueError(f"evicted_tolerance: must be in [0, 1), got {self.evicted_tolerance}")
        if self.window_turns < 1:
            raise ValueError(f"window_turns: must be >= 1, got {self.window_turns}")

    @property
    def ceiling_tokens(self) -> int:
        return math.floor(self.max_factor * self.floor_tokens)


@dataclass(frozen=True, slots=True)
class CacheFeedback:
    """What the engine showed since the last adjustment."""

    kept_turns: int
    """Turns of resident tasks whose previous context came back from the prefix cache."""
    evicted_turns: int
    """Turns of resident tasks whose previous context had been evicted (a block or more short)."""
    budget_bound: bool
    """The budget held a task back: an admission or resume waited for room, or tasks were paused."""

    @property
    def judged_turns(self) -> int:
        return self.kept_turns + self.evicted_turns


def prefix_kept(prefix_tokens: int, cached_tokens: int, block_tokens: int) -> bool | None:
    """Whether a turn got back the context its previous generation left in the cache: its full blocks,
    less one block of slack (None: less than two blocks to judge by)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens: must be >= 1, got {block_tokens}")
    full = prefix_tokens // block_tokens * block_tokens
    if full < 2 * block_tokens:
        return None
    return cached_tokens >= full - block_tokens


def adjust_budget(budget_tokens: int, feedback: CacheFeedback, limits: BudgetLimits) -> int:
    """The budget for the next window (see the module rule and invariants)."""
    floor, ceiling = limits.floor_tokens, limits.ceiling_tokens
    budget = min(max(budget_tokens, floor), ceiling)
    if feedback.judged_turns < limits.window_turns:
        return budget
    if feedback.evicted_turns > limits.evicted_tolerance * feedback.judged_turns:
        return floor + math.floor((budget - floor) * limits.shrink)
    if feedback.budget_bound:
        return min(ceiling, budget + max(1, math.floor(limits.grow_share * floor)))
    return budget


@dataclass(slots=True)
class BudgetTracker:
    """One rank's adaptive-budget bookkeeping, kept the same way by the rollout worker and the simulator
    (so that the simulator hands CTB the budget the run would): turns are judged as they start
    (:meth:`judge`), decisions say whether the budget held a task back (:meth:`held_back`), and once
    ``window_turns`` turns are judged the budget is adjusted (:func:`adjust_budget`). No state beyond
    these counters; without limits the budget stays fixed (turns are still judged, for the metrics)."""

    budget_tokens: int
    limits: BudgetLimits | None = None
    window: list[int] = field(default_factory=lambda: [0, 0])
    """Judged turns since the last adjustment: kept, evicted."""
    bound: bool = False
    """The budget held a task back since the last adjustment."""

    def held_back(self, bound: bool) -> None:
        self.bound = self.bound or bound

    def judge(self, prefix_tokens: int, cached_tokens: int, block_tokens: int) -> bool | None:
        """Judge a turn of a task that stayed resident since its previous generation (with the same
        weights): `prefix_tokens` its previous generation left in the cache, `cached_tokens` the engine
        served from it. Returns whether the context was kept (None: too short to judge)."""
        kept = prefix_kept(prefix_tokens, cached_tokens, block_tokens)
        if kept is None:
            return None
        self.window[0 if kept else 1] += 1
        if self.limits is not None and sum(self.window) >= self.limits.window_turns:
            feedback = CacheFeedback(kept_turns=self.window[0], evicted_turns=self.window[1], budget_bound=self.bound)
            self.budget_tokens = adjust_budget(self.budget_tokens, feedback, self.limits)
            self.window = [0, 0]
            self.bound = False
        return kept
