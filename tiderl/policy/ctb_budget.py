"""CTB's adaptive KV budget: how many tokens a rollout rank may commit beyond its engine's cache,
learned from what the engine's prefix cache kept (``rollout.ctb_budget: adaptive``), weighed against
what the contexts it loses cost to recompute.

Pure: no torch, no database, no HTTP, no processes. The rollout worker (and the simulator's rollout
ranks, through the same :class:`BudgetTracker`) judge every turn of a task that stayed resident since
its previous generation, and the budget is adjusted once a window of such turns is full.

Why a budget beyond the cache: CTB counts every resident task at its whole context plus the room
of its next generation (:mod:`tiderl.policy.ctb`). A task waiting on its environment holds no
engine blocks: its context sits in the prefix cache, evictable, and comes back as a hit if nothing
needed those blocks meanwhile. Counting it at full size is a worst case, which keeps fewer
sequences decoding than the cache can serve. How much more fits depends on the environment's
latency, the engine's speed and the contexts' lengths, so it is measured, not assumed: the engine
reports for every generation how many prompt tokens it served from the cache, and a resident task
whose previous context did not come back (a block or more short) was evicted because the rank
committed more than the cache could keep.

What a probe past the cache costs depends on the engine: an evicted context is prefilled again,
and while it is, the engine's decoding sequences wait. With a 7B model on a GPU (the simulator's
H100 node), one evicted 4k-token context costs a third to all of the generation of a window of 16
turns; with a tiny model on a CPU, a few tokens. So when the engine states what a re-prefilled token
costs (``reprefill_cost``: tokens of generation forgone per token prefilled again, as the engine runs
now; the simulator from its cost model, the rollout worker from its engine's timed iterations with
:class:`CostMeter`), the rule weighs it; when it does not, the rule counts evicted turns.

Rule, once ``window_turns`` turns of resident tasks were judged. F is the floor (the fixed budget:
the engine's capacity or ``rollout.kv_budget_tokens``), b the budget, g(x) = (x - F) / F the most the
overcommit of a budget x can multiply the floor's generation by, less one: x / F times as many tasks
resident, each generating at most as fast as at the floor.

Why k weighs against g(b): k is the generation forgone while the engine re-prefills, as a share of the
generation the window got, G. Without the re-prefills the N_b resident tasks would have generated
G (1 + k) in the window's time; at the floor, N_F of them, at most G (1 + k) N_F / N_b. So the overcommit
gains iff N_b / N_F > 1 + k, so only if k < g(b), as N_b / N_F <= b / F. The forgone generation is
shared by every resident task, those only the overcommit admits included: weighing k against
(b - F) / b, the overcommitted tasks' share of G, would count it twice (at b = 2F it would refuse the
overcommit from k = 0.5 where it can pay up to k = 1; docs/RESULTS.md, "The adaptive budget's cost rule").

With costs (every judged turn of the window came with a ``reprefill_cost``): the window's cost
share k_w = (sum over evicted turns of lost tokens x reprefill_cost) / (tokens the window's turns
generate), lost tokens being those of the previous context's full blocks the engine did not serve,
and k its moving average, k = (1 - a) x k + a x k_w with a = ``cost_smoothing`` (k = k_w for the first
window with costs): a window of 16 turns is a small sample, and one that happens to see many of its
contexts evicted must not end an overcommit that pays on average (a costly one still shows within a
few windows: a window costing 4 g(b) alone takes an average from 0 past g(b)).
- k > g(b), b above the floor (the re-prefills cost more than the overcommit could gain): back to
  the floor, ``budget = F``, and no rise for the next h = max(ceil(k / ``probe_cost_share``), 2 x m)
  windows (at most ``max_hold_windows``), m being the memory of the last failed probe's hold: a
  failed probe's cost, spread over the windows it keeps the budget down, is at most
  ``probe_cost_share`` of their generation, and probes that keep failing come ever more rarely
  (the hold doubles); m becomes h;
- otherwise, while windows of the hold remain: the budget unchanged, one window less to hold, and
  the window's own re-prefills charged to the failed probe (they are mostly its aftermath: contexts
  it damaged coming back): hold and m grow by floor(k_w / ``probe_cost_share``), at most
  ``max_hold_windows`` (costs below ``probe_cost_share`` do not stop a hold from ending);
- otherwise, above the floor, m fades by one window (the overcommit paid for it: a failure is
  forgotten once the overcommit paid for as many windows as it held the budget down; probing from
  the floor does not fade it), and
  if the budget held a task back and k <= g(b + step) (the costs seen so far stay below
  what the rise could gain; step = ``grow_share x F``): ``budget += step``, at most ``max_factor x F``;
- otherwise unchanged.

Without costs (the count rule, additive increase, multiplicative decrease of the part above the floor):
- evicted share of the judged turns above ``evicted_tolerance``:
  ``budget = F + (budget - F) x shrink``;
- otherwise, if the budget held a task back: ``budget += grow_share x F``, at most ``max_factor x F``;
- otherwise unchanged.

Invariants (each has a test in tests/test_policy_ctb_budget.py)
1. ``floor <= budget <= max_factor x floor`` after every adjustment, whatever the feedback.
2. Fewer than ``window_turns`` judged turns: no change (budget and hold).
3. Count rule: an evicted share above the tolerance never raises the budget, and lowers it when
   above the floor.
4. Count rule: the budget rises only when it held a task back and the evicted share was within the
   tolerance.
5. Pure: equal inputs give equal outputs.
6. :class:`BudgetTracker` (the bookkeeping the rollout worker and the simulator share) adjusts
   exactly once per ``window_turns`` judged turns, with the feedback of those turns only.
7. Cost rule: re-prefills that cost more than the overcommit could gain (k > g(b), b > F) put the
   budget back at the floor and hold it there for max(ceil(k / probe_cost_share), 2 x m) windows
   (at most ``max_hold_windows``; a longer hold pending stays); re-prefills that cost no more
   (k <= g(b)) never lower the budget.
8. Cost rule: the budget rises only when it held a task back, no window of a hold remains, and
   k <= g(budget after the rise); at the floor, only when k <= step / F.
9. Cost rule: the memory m is the last failed probe's hold, plus the costs charged during it, less
   the windows since spent above the floor outside a hold, never below 0 nor above
   ``max_hold_windows``; it grows only with a failed probe or with re-prefill costs during a hold,
   and fades only in windows above the floor that paid for their re-prefills.
10. Cost rule: k is the moving average of the windows' cost shares (``cost_smoothing`` the newest's
   weight; the first window with costs is taken as it is); windows judged by the count rule, and
   fewer than ``window_turns`` judged turns, leave it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["BudgetLimits", "BudgetState", "BudgetTracker", "CacheFeedback", "CostMeter", "adjust_budget",
           "gain_ratio", "next_budget", "prefix_kept", "reprefill_cost"]


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    floor_tokens: int
    """The fixed budget: the engine's KV capacity or rollout.kv_budget_tokens."""
    max_factor: float = 4.0
    """The budget never exceeds this multiple of the floor."""
    grow_share: float = 0.125
    """Increase per window, as a share of the floor."""
    shrink: float = 0.5
    """Count rule: factor applied to the part above the floor when too many prefixes were evicted."""
    evicted_tolerance: float = 0.05
    """Count rule: evicted share of the judged turns above which the rank committed too much."""
    window_turns: int = 16
    """Judged turns per adjustment."""
    probe_cost_share: float = 0.02
    """Cost rule: share of the generation a failed probe may cost, spread over the windows it holds the
    budget at the floor."""
    cost_smoothing: float = 0.25
    """Cost rule: weight of the newest window in k's moving average (a window of 16 turns is a small sample)."""
    max_hold_windows: int = 4096
    """Cost rule: the longest hold after a failed probe, in windows (conditions change: contexts shorten
    as training goes on)."""

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
        if not 0 < self.probe_cost_share <= 1:
            raise ValueError(f"probe_cost_share: must be in (0, 1], got {self.probe_cost_share}")
        if not 0 < self.cost_smoothing <= 1:
            raise ValueError(f"cost_smoothing: must be in (0, 1], got {self.cost_smoothing}")
        if self.max_hold_windows < 0:
            raise ValueError(f"max_hold_windows: must be >= 0, got {self.max_hold_windows}")

    @property
    def ceiling_tokens(self) -> int:
        return math.floor(self.max_factor * self.floor_tokens)

    @property
    def step_tokens(self) -> int:
        return max(1, math.floor(self.grow_share * self.floor_tokens))


@dataclass(frozen=True, slots=True)
class CacheFeedback:
    """What the engine showed since the last adjustment."""

    kept_turns: int
    """Turns of resident tasks whose previous context came back from the prefix cache."""
    evicted_turns: int
    """Turns of resident tasks whose previous context had been evicted (a block or more short)."""
    budget_bound: bool
    """The budget held a task back: an admission or resume waited for room, or tasks were paused."""
    reprefill_cost_tokens: float | None = None
    """Generation the evicted turns' re-prefills cost, in generated tokens (sum of lost tokens x
    reprefill_cost); None: the engine stated no cost (the count rule)."""
    generated_tokens: int = 0
    """Tokens the judged turns generate."""

    @property
    def judged_turns(self) -> int:
        return self.kept_turns + self.evicted_turns

    @property
    def cost_share(self) -> float | None:
        """k: the re-prefills' cost as a share of the window's generation (None: no costs)."""
        if self.reprefill_cost_tokens is None:
            return None
        return self.reprefill_cost_tokens / max(self.generated_tokens, 1)


def prefix_kept(prefix_tokens: int, cached_tokens: int, block_tokens: int) -> bool | None:
    """Whether a turn got back the context its previous generation left in the cache: its full blocks,
    less one block of slack (None: less than two blocks to judge by)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens: must be >= 1, got {block_tokens}")
    full = prefix_tokens // block_tokens * block_tokens
    if full < 2 * block_tokens:
        return None
    return cached_tokens >= full - block_tokens


def gain_ratio(budget_tokens: int, floor_tokens: int) -> float:
    """g(b) = (b - F) / F: at most, the generation the overcommit adds over the floor's, as a multiple of
    the floor's (0 at the floor). A window's re-prefill cost share k must stay within it (module rule)."""
    return max(0, budget_tokens - floor_tokens) / max(floor_tokens, 1)


def reprefill_cost(prefill_s_per_token: float, iteration_s: float, decoding_sequences: int) -> float:
    """Generated tokens one re-prefilled token costs on an engine now: while it is prefilled (compute
    bound, ``prefill_s_per_token``), the engine's ``decoding_sequences`` wait, each of which gains a
    token per ``iteration_s``. The rollout worker and the simulator state it from their engine."""
    if iteration_s <= 0:
        raise ValueError(f"iteration_s: must be > 0, got {iteration_s}")
    return max(0.0, prefill_s_per_token) * max(1, decoding_sequences) / iteration_s


@dataclass(slots=True)
class CostMeter:
    """What a re-prefilled token costs on a real engine, learned from its iterations (the rollout
    worker's input to :func:`reprefill_cost`): a least-squares fit, over recent iterations (weights
    decaying by ``decay`` an iteration), of each iteration's wall time on a fixed part, the sequences it
    decoded and the prompt tokens it prefilled: ``wall = c0 + c_d x decoding + c_p x prefilled``. ``c_p``
    is ``prefill_s_per_token``; the mean iteration's wall time ``iteration_s``, and its mean decoding
    sequences wait while a token is prefilled.

    Why iterations, with a fixed part: an engine's iteration costs a fixed overhead plus its tokens'
    compute, and on a small model the overhead is most of it (a prefilled token then costs almost
    nothing). A fit of each *turn's* wall time on its own generated and prefilled tokens, without a fixed
    part, charged the overhead and the other sequences' work to the turns that prefilled: on the tiny
    bench it priced a re-prefilled token at 0.36 generated tokens where the budget that evicted most ran
    fastest (docs/rollout.md).

    :meth:`cost` is None until ``min_iterations`` iterations were seen, some of them prefilling and
    some not (the fit needs both); once a fit was made, recent iterations that cannot tell the parts
    apart keep the last fit. A fit with ``c_p <= 0`` (prefill free within the noise) costs 0."""

    decay: float = 0.995
    min_iterations: int = 64
    sums: list[float] = field(default_factory=lambda: [0.0] * 9)
    """Weighted sums of 1, D, P, D x D, D x P, P x P, wall, wall x D, wall x P."""
    iterations: int = 0
    last_fit: tuple[float, float, float] | None = None
    """The last fit: (iteration_s, prefill_s_per_token, mean decoding sequences)."""

    def observe(self, wall_s: float, prefilled_tokens: int, decoding: int) -> None:
        """One engine iteration: its wall time, the prompt tokens it prefilled, the sequences it decoded."""
        d, p, w = float(max(0, decoding)), float(max(0, prefilled_tokens)), max(0.0, wall_s)
        if d + p == 0:
            return
        self.sums = [x * self.decay for x in self.sums]
        for i, v in enumerate((1.0, d, p, d * d, d * p, p * p, w, w * d, w * p)):
            self.sums[i] += v
        self.iterations += 1
        if self.iterations < self.min_iterations:
            return
        n, sd, sp, dd, dp, pp, sw, wd, wp = self.sums
        solved = _solve3(((n, sd, sp), (sd, dd, dp), (sp, dp, pp)), (sw, wd, wp))
        if solved is None:
            return  # the parts cannot be told apart (no iteration prefilled, or every one did alike)
        prefill_s = max(0.0, solved[2])
        iteration_s = sw / n
        if iteration_s > 0:
            self.last_fit = (iteration_s, prefill_s, sd / n)

    def fit(self) -> tuple[float, float, float] | None:
        """(iteration_s, prefill_s_per_token, mean decoding sequences), or None (see the class)."""
        return self.last_fit

    def cost(self) -> float | None:
        """Generated tokens one re-prefilled token costs now (:func:`reprefill_cost`), or None."""
        fit = self.fit()
        if fit is None:
            return None
        return reprefill_cost(fit[1], fit[0], round(fit[2]))


def _solve3(a: tuple[tuple[float, float, float], ...], b: tuple[float, float, float]) -> tuple[float, ...] | None:
    """x of the symmetric 3 x 3 system a x = b (Cramer's rule); None where a is near singular."""

    def det(m: tuple[tuple[float, float, float], ...]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    whole = det(a)
    if abs(whole) <= 1e-9 * a[0][0] * a[1][1] * a[2][2]:
        return None
    cols = []
    for j in range(3):
        m = tuple(tuple(b[i] if k == j else a[i][k] for k in range(3)) for i in range(3))
        cols.append(det(m) / whole)
    return tuple(cols)


@dataclass(frozen=True, slots=True)
class BudgetState:
    """The adaptive budget between windows."""

    budget_tokens: int
    hold_windows: int = 0
    """Windows the budget still stays at the floor after a failed probe (the cost rule)."""
    memory_windows: int = 0
    """m: the last failed probe's hold, fading by one per window above the floor that paid (the cost rule)."""
    cost_share: float | None = None
    """The cost rule's k, averaged over recent windows (None: no window judged with costs yet)."""


def next_budget(state: BudgetState, feedback: CacheFeedback, limits: BudgetLimits) -> BudgetState:
    """The state for the next window (see the module rule and invariants)."""
    floor, ceiling = limits.floor_tokens, limits.ceiling_tokens
    budget = min(max(state.budget_tokens, floor), ceiling)
    hold, memory = max(0, state.hold_windows), max(0, state.memory_windows)
    if feedback.judged_turns < limits.window_turns:
        return BudgetState(budget, hold, memory, state.cost_share)
    window_k = feedback.cost_share
    if window_k is None:  # the count rule (it leaves the average of k alone)
        if feedback.evicted_turns > limits.evicted_tolerance * feedback.judged_turns:
            budget = floor + math.floor((budget - floor) * limits.shrink)
        elif feedback.budget_bound:
            budget = min(ceiling, budget + limits.step_tokens)
        return BudgetState(budget, hold, memory, state.cost_share)
    k = window_k if state.cost_share is None else (
        (1 - limits.cost_smoothing) * state.cost_share + limits.cost_smoothing * window_k)
    if budget > floor and k > gain_ratio(budget, floor):
        new = min(limits.max_hold_windows, max(math.ceil(k / limits.probe_cost_share), 2 * memory))
        return BudgetState(floor, max(hold, new), new, k)
    if hold > 0:
        charge = math.floor(window_k / limits.probe_cost_share)
        return BudgetState(budget, min(limits.max_hold_windows, hold - 1 + charge),
                           min(limits.max_hold_windows, memory + charge), k)
    if budget > floor:
        memory = max(0, memory - 1)
    raised = min(ceiling, budget + limits.step_tokens)
    if feedback.budget_bound and raised > budget and k <= gain_ratio(raised, floor):
        return BudgetState(raised, 0, memory, k)
    return BudgetState(budget, 0, memory, k)


def adjust_budget(budget_tokens: int, feedback: CacheFeedback, limits: BudgetLimits) -> int:
    """The budget for the next window, with no hold and no memory of a failed probe (:func:`next_budget`)."""
    return next_budget(BudgetState(budget_tokens), feedback, limits).budget_tokens


@dataclass(slots=True)
class BudgetTracker:
    """One rank's adaptive-budget bookkeeping, kept the same way by the rollout worker and the simulator
    (so that the simulator hands CTB the budget the run would): turns are judged as they start
    (:meth:`judge`), decisions say whether the budget held a task back (:meth:`held_back`), and once
    ``window_turns`` turns are judged the budget is adjusted (:func:`next_budget`). No state beyond
    these counters; without limits the budget stays fixed (turns are still judged, for the metrics)."""

    budget_tokens: int
    limits: BudgetLimits | None = None
    window: list[int] = field(default_factory=lambda: [0, 0])
    """Judged turns since the last adjustment: kept, evicted."""
    bound: bool = False
    """The budget held a task back since the last adjustment."""
    generated: int = 0
    """Tokens the window's judged turns generate."""
    cost: float | None = 0.0
    """The window's re-prefill cost in generated tokens (None: a judged turn came without a cost)."""
    hold: int = 0
    """Windows the budget still holds at the floor after a failed probe (the cost rule)."""
    memory: int = 0
    """The memory of the last failed probe's hold (the cost rule)."""
    cost_share: float | None = None
    """The cost rule's moving average of k."""
    lost_tokens: int = 0
    """Tokens of evicted contexts judged since the tracker started (for the metrics)."""

    def held_back(self, bound: bool) -> None:
        self.bound = self.bound or bound

    def judge(self, prefix_tokens: int, cached_tokens: int, block_tokens: int, generated_tokens: int = 0,
              reprefill_cost: float | None = None) -> bool | None:
        """Judge a turn of a task that stayed resident since its previous generation (with the same
        weights): `prefix_tokens` its previous generation left in the cache, `cached_tokens` the engine
        served from it, `generated_tokens` the turn generates, `reprefill_cost` the generated tokens one
        re-prefilled token costs on the engine now (:func:`reprefill_cost`; None: not stated, and the
        window is judged by the count rule). Returns whether the context was kept (None: too short to
        judge)."""
        kept = prefix_kept(prefix_tokens, cached_tokens, block_tokens)
        if kept is None:
            return None
        self.window[0 if kept else 1] += 1
        self.generated += max(0, generated_tokens)
        if not kept:
            lost = prefix_tokens // block_tokens * block_tokens - max(0, cached_tokens)
            self.lost_tokens += lost
            if self.cost is not None and reprefill_cost is not None:
                self.cost += lost * max(0.0, reprefill_cost)
        if reprefill_cost is None:
            self.cost = None
        if self.limits is not None and sum(self.window) >= self.limits.window_turns:
            feedback = CacheFeedback(kept_turns=self.window[0], evicted_turns=self.window[1], budget_bound=self.bound,
                                     reprefill_cost_tokens=self.cost, generated_tokens=self.generated)
            state = next_budget(BudgetState(self.budget_tokens, self.hold, self.memory, self.cost_share), feedback,
                                self.limits)
            self.budget_tokens, self.hold, self.memory = state.budget_tokens, state.hold_windows, state.memory_windows
            self.cost_share = state.cost_share
            self.window = [0, 0]
            self.bound = False
            self.generated = 0
            self.cost = 0.0
        return kept
