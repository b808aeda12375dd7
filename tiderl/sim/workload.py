"""Sampling the tasks of a workload: per group a task type, per task a number
of turns, tokens generated and observed per turn, and environment latencies.

Turns follow a geometric distribution shifted to `turns_min` and capped at
`turns_max` (a few tasks wander until the turn limit: the long tail), whose
parameter is solved so the capped mean equals the workload's mean. A group's
tasks play one prompt: with `turns_group_icc` their turns share a group draw
(a Gaussian copula whose latent correlation is solved so that the turns'
intraclass correlation is the workload's), the same marginal distribution. The
observation tokens per turn are set so the mean trajectory length matches the
workload's `tokens_mean`. A task whose context would pass the context limit
ends there. Every group draws from its own random stream seeded by (seed,
group index), so two systems simulated with one seed see the same tasks
(up to the drift step and the phase at which a group starts). A phase
(`WorkloadSpec.phases`) scales the environment latencies (the same draws,
multiplied) and reweights the training mix of the groups that start at or
after its step.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from dataclasses import dataclass, field

from tiderl.sim.spec import TaskType, WorkloadSpec


@dataclass(slots=True)
class TaskPlan:
    task_type: str
    prompt_tokens: int
    gen_tokens: list[int]
    """Tokens generated in each turn."""
    obs_tokens: list[int]
    """Observation tokens appended after each turn but the last."""
    env_latency_s: list[float]
    """Environment latency after each turn (the last one returns the reward)."""
    start_latency_s: float
    prune_tokens: list[int] = field(default_factory=list)
    """Context tokens the image window prunes once each observation is in (empty: never)."""
    prune_kept: list[int] = field(default_factory=list)
    """Per prune (0 elsewhere): the context tokens before the oldest image it drops, which stay cached (a
    message's images come before its text, as in the run's chat format: the first prune keeps none)."""

    @property
    def num_turns(self) -> int:
        return len(self.gen_tokens)

    @property
    def segments(self) -> list[int]:
        """Tokens of each trained sequence: the whole trajectory, or its parts split where the image window
        pruned the context (each part holds the context the engine saw for its turns)."""
        ctx = self.prompt_tokens
        out = []
        for i, g in enumerate(self.gen_tokens):
            ctx += g
            if i < len(self.obs_tokens):
                if i < len(self.prune_tokens) and self.prune_tokens[i]:
                    out.append(ctx)  # the part ends before the observation that filled the window
                    ctx -= self.prune_tokens[i]
                ctx += self.obs_tokens[i]
        out.append(ctx)
        return out

    def turn_prefills(self) -> list[tuple[int, int]]:
        """Per turn, at best (every prefix cached): (tokens to prefill, context already cached before
        them). The prompt, then each observation; after the image window pruned the context, everything
        from the oldest pruned image on (the kept images moved: their cache no longer matches)."""
        out = [(self.prompt_tokens, 0)]
        ctx = self.prompt_tokens
        for i, g in enumerate(self.gen_tokens[:-1]):
            ctx += g
            if i >= len(self.obs_tokens):
                break
            cut = self.prune_tokens[i] if i < len(self.prune_tokens) else 0
            if cut:
                ctx += self.obs_tokens[i] - cut
                out.append((ctx - self.prune_kept[i], self.prune_kept[i]))
            else:
                out.append((self.obs_tokens[i], ctx))
                ctx += self.obs_tokens[i]
        return out

    @property
    def total_tokens(self) -> int:
        """Tokens trained: every part's (the trajectory's own length when nothing was pruned)."""
        return sum(self.segments)


@functools.lru_cache(maxsize=4096)
def geometric_p(mean: float, lo: int, hi: int) -> float:
    """p of a geometric on {lo, lo+1, ...} capped at hi whose capped mean is `mean`."""
    if mean <= lo or hi <= lo:
        return 1.0

    def capped_mean(p: float) -> float:
        q = 1 - p
        return lo + sum(q**k for k in range(1, hi - lo + 1))

    a, b = 1e-6, 1.0
    if capped_mean(a) < mean:
        return a  # the cap cannot reach that mean: as spread out as possible
    for _ in range(60):
        mid = (a + b) / 2
        if capped_mean(mid) > mean:
            a = mid
        else:
            b = mid
    return (a + b) / 2


_NORMAL = statistics.NormalDist()
_GRID = [i / 10 for i in range(-80, 81)]  # latent group draws from -8 to 8, for the quadrature below
_WEIGHTS = [_NORMAL.pdf(z) for z in _GRID]


def intraclass_correlation(groups: list[list[float]]) -> float:
    """ICC(1) of one-way ANOVA over the groups of the most common size (complete groups): the share of the
    values' variance that a group's members share; 0 where it cannot be told (fewer than two groups, no
    variance) or comes out negative. What `turns_group_icc` means, measured on a run or a sample."""
    if not groups:
        return 0.0
    size = statistics.mode(len(g) for g in groups)
    full = [g for g in groups if len(g) == size]
    if len(full) < 2 or size < 2:
        return 0.0
    grand = statistics.fmean(x for g in full for x in g)
    msb = size * sum((statistics.fmean(g) - grand) ** 2 for g in full) / (len(full) - 1)
    msw = sum((x - statistics.fmean(g)) ** 2 for g in full for x in g) / (len(full) * (size - 1))
    if msb + (size - 1) * msw <= 0:
        return 0.0
    return min(1.0, max(0.0, (msb - msw) / (msb + (size - 1) * msw)))


@functools.lru_cache(maxsize=4096)
def turn_thresholds(p: float, lo: int, hi: int) -> tuple[float, ...]:
    """Latent normal cut points of the capped geometric: a task plays lo + (cuts below its latent) turns."""
    return tuple(_NORMAL.inv_cdf(min(1 - 1e-12, 1 - (1 - p) ** (k - lo + 1))) for k in range(lo, hi))


def turns_icc(p: float, lo: int, hi: int, rho: float) -> float:
    """Intraclass correlation of two tasks' turns whose latents correlate by `rho`: the variance of the
    group's conditional mean over the variance of a task's turns."""
    cuts = turn_thresholds(p, lo, hi)
    pmf = [(1 - p) ** (k - lo) * p for k in range(lo, hi)]
    pmf.append(1 - sum(pmf))
    mean = sum((lo + i) * q for i, q in enumerate(pmf))
    var = sum((lo + i - mean) ** 2 * q for i, q in enumerate(pmf))
    if var <= 0 or rho <= 0:
        return 0.0
    if rho >= 1:
        return 1.0
    s, r = math.sqrt(rho), math.sqrt(1 - rho)
    means = [lo + sum(1 - _NORMAL.cdf((a - s * z) / r) for a in cuts) for z in _GRID]
    total = sum(_WEIGHTS)
    m1 = sum(w * m for w, m in zip(_WEIGHTS, means)) / total
    m2 = sum(w * m * m for w, m in zip(_WEIGHTS, means)) / total
    return max(0.0, m2 - m1 * m1) / var


@functools.lru_cache(maxsize=4096)
def latent_correlation(p: float, lo: int, hi: int, icc: float) -> float:
    """The latent correlation whose turns have intraclass correlation `icc` (bisection; it grows with rho)."""
    a, b = 0.0, 1.0
    for _ in range(40):
        mid = (a + b) / 2
        if turns_icc(p, lo, hi, mid) < icc:
            a = mid
        else:
            b = mid
    return (a + b) / 2


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    if sigma <= 0:
        return mean
    return math.exp(math.log(mean) - sigma * sigma / 2 + sigma * rng.gauss(0.0, 1.0))


def _cumulative(task_types: tuple[TaskType, ...], shares: tuple[float, ...]) -> list[tuple[float, TaskType]]:
    total = sum(shares)
    cum: list[tuple[float, TaskType]] = []
    acc = 0.0
    for t, share in zip(task_types, shares):
        if share > 0:
            acc += share / total
            cum.append((acc, t))
    return cum


class TaskSampler:
    def __init__(self, workload: WorkloadSpec, seed: int) -> None:
        self.workload = workload
        self.seed = seed
        self._phases = workload.resolved_phases()
        self._eval_cum = _cumulative(workload.task_types, self._phases[0].shares)
        self._train_cum = [_cumulative(workload.task_types, r.shares) for r in self._phases]

    def group(self, group_index: int, step: int, size: int, is_eval: bool) -> list[TaskPlan]:
        """The tasks of a group that starts at `step`: drift and phases read that step. The random
        stream is the group's own and a phase consumes it the same way: the same uniform picks the
        type under the phase's shares, and the latencies are the same draws, scaled."""
        rng = random.Random(f"{self.seed}:{'eval' if is_eval else 'train'}:{group_index}")
        index = max(i for i, r in enumerate(self._phases) if step >= r.from_step)
        phase = self._phases[index]
        cum = self._eval_cum if is_eval else self._train_cum[index]
        u = rng.random()
        task_type = next((t for acc, t in cum if u <= acc), cum[-1][1])
        # Only a correlated type draws the group's share (the others' streams stay as they were).
        shared = rng.gauss(0.0, 1.0) if task_type.turns_group_icc > 0 else None
        return [
            self._task(rng, task_type, step, phase.env_latency_scale, phase.env_start_scale, phase.gen_tokens_scale,
                       shared)
            for _ in range(size)
        ]

    def _task(
        self, rng: random.Random, tt: TaskType, step: int, latency_scale: float = 1.0, start_scale: float = 1.0,
        gen_scale: float = 1.0, shared: float | None = None,
    ) -> TaskPlan:
        w = self.workload
        turns_mean = tt.turns_mean.at(step, w.drift_steps)
        tokens_mean = tt.tokens_mean.at(step, w.drift_steps)
        p = geometric_p(turns_mean, tt.turns_min, tt.turns_max)
        if shared is None:
            turns = tt.turns_min
            while turns < tt.turns_max and rng.random() > p:
                turns += 1
        else:
            cuts = turn_thresholds(p, tt.turns_min, tt.turns_max)
            rho = latent_correlation(p, tt.turns_min, tt.turns_max, tt.turns_group_icc)
            z = math.sqrt(rho) * shared + math.sqrt(1 - rho) * rng.gauss(0.0, 1.0)
            turns = tt.turns_min + sum(1 for a in cuts if z > a)
        obs_mean = (tokens_mean - tt.prompt_tokens - turns_mean * tt.gen_tokens_per_turn) / max(turns_mean - 1, 1)
        obs_mean = max(obs_mean, 1.0)
        lat_mu, lat_sigma = tt.env_latency.lognormal_params()
        start_mu, start_sigma = tt.env_start.lognormal_params()
        img = tt.image_tokens
        ctx = tt.prompt_tokens + img
        images = 1 if img else 0
        gen: list[int] = []
        obs: list[int] = []
        prune: list[int] = []
        kept: list[int] = []
        at = [0] if img else []  # where each image in the context starts: first in its message
        lat: list[float] = []
        for i in range(turns):
            g = max(1, round(gen_scale * _lognormal(rng, tt.gen_tokens_per_turn, tt.gen_tokens_sigma)))
            o = max(1, round(_lognormal(rng, obs_mean, tt.obs_tokens_sigma)))
            latency = latency_scale * math.exp(lat_mu + lat_sigma * rng.gauss(0.0, 1.0))
            if ctx + g >= w.max_context_tokens:
                g = max(1, w.max_context_tokens - ctx)
                gen.append(g)
                lat.append(latency)
                break
            ctx += g
            gen.append(g)
            lat.append(latency)
            o += img
            cut = 0
            if img and w.max_images is not None and images + 1 >= w.max_images:
                cut = (images + 1 - w.keep_images) * img  # the oldest images leave; the newest stay
            if i == turns - 1 or ctx + o - cut >= w.max_context_tokens:
                break
            kept.append(at[0] if cut else 0)
            if cut:
                at = [p - cut for p in at[cut // img:]]
            ctx -= cut
            if img:
                at.append(ctx)
            ctx += o
            images = images + 1 - cut // img if img else 0
            obs.append(o)
            prune.append(cut)
        return TaskPlan(
            task_type=tt.name,
            prompt_tokens=tt.prompt_tokens + img,
            gen_tokens=gen,
            obs_tokens=obs,
            env_latency_s=lat,
            start_latency_s=start_scale * rng.lognormvariate(start_mu, start_sigma),
            prune_tokens=prune if any(prune) else [],
            prune_kept=kept if any(prune) else [],
        )
